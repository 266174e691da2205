"""Integrity and bad conditions of the paged buffer pool's NVMe tier.

Checksums, a full disk, unusable paths, an oversized host budget, I/O mode detection and
ownership of slab files. Where a test needs a small or read-only filesystem it mounts a
tmpfs (this runs as root); if ``mount`` is not permitted that test is skipped and the
fallback test beside it still runs.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import faults

from zero_runtime.memory import (
    NvmeFullError,
    NvmePathError,
    PageChecksumError,
    PagedBufferPool,
    PoolOutOfMemoryError,
)

PS = 64 << 10
F32_PER_PAGE = PS // 4


def values(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def tiers_of(pool: PagedBufferPool, tid: str) -> list[str | None]:
    return [p.tier for p in pool.describe(tid).pages]


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(name, options) -> Path``: a tmpfs under tmp_path, unmounted after the test."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        target = faults.mount_tmpfs_or_skip(tmp_path / name, options)
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        faults.unmount(target)


# --- checksums ------------------------------------------------------------------------
def test_corrupted_page_on_disk_raises_checksum_error_naming_file_page_and_tensor(tmp_path):
    a, b = values(2 * F32_PER_PAGE, 0), values(F32_PER_PAGE, 1)
    with PagedBufferPool(
        page_size_bytes=PS, host_budget_bytes=4 * PS, nvme_path=str(tmp_path)
    ) as pool:
        pool.allocate("a", a.shape, a.dtype)
        pool.allocate("b", b.shape, b.dtype)
        pool.write("a", a)
        pool.write("b", b)
        pool.evict(["a", "b"], "nvme")
        offset = pool.describe("a").pages[1].slot * PS
        with open(pool.nvme_file, "r+b") as f:  # flip one byte of page 1 of "a"
            f.seek(offset + 100)
            byte = f.read(1)
            f.seek(offset + 100)
            f.write(bytes([byte[0] ^ 0x01]))
            f.flush()
            os.fsync(f.fileno())
        with pytest.raises(PageChecksumError) as info:
            pool.acquire("a")
        err = info.value
        assert (err.path, err.offset, err.tensor_id, err.page_index) == (
            pool.nvme_file,
            offset,
            "a",
            1,
        )
        assert f"page 1 of tensor 'a' from {pool.nvme_file} at offset {offset}" in str(err)
        assert pool.describe("a").pages[1].tier == "nvme"  # it stays where it was
        with pytest.raises(PageChecksumError, match="page 1 of tensor 'a'"):
            pool.read("a")
        assert np.array_equal(pool.read("b"), b)  # other data intact
        pool.write("a", a)  # rewriting the page repairs it
        assert np.array_equal(pool.acquire("a"), a)
        pool.release("a")


# --- a full disk ----------------------------------------------------------------------
def test_disk_full_while_paging_out_keeps_pages_on_host(tmpfs):
    """Real ENOSPC: a 1 MiB tmpfs, filled by another file after the pool has started."""
    nvme = tmpfs("small", "size=1m")
    data = {f"t{i}": values(F32_PER_PAGE, i) for i in range(4)}
    with PagedBufferPool(
        page_size_bytes=PS,
        host_budget_bytes=4 * PS,
        nvme_path=str(nvme),
        nvme_budget_bytes=8 * PS,
        queue_depth=1,  # one write at a time: exactly two pages fit
    ) as pool:
        for tid, d in data.items():
            pool.allocate(tid, d.shape, d.dtype)
            pool.write(tid, d)
        filler = nvme / "filler"
        filler.write_bytes(b"\xa5" * (shutil.disk_usage(nvme).free - 2 * PS))
        with pytest.raises(NvmeFullError) as info:
            pool.evict(list(data), "nvme")
        err = info.value
        assert isinstance(err, PoolOutOfMemoryError) and err.errno == errno.ENOSPC
        assert f"disk full (ENOSPC) writing to {pool.nvme_file}" in err.message
        assert "the page stays on the host tier and no data was lost" in err.message
        pool.synchronize()
        placed = [tiers_of(pool, tid)[0] for tid in data]
        assert sorted(placed) == ["host", "host", "nvme", "nvme"]
        for tid, d in data.items():
            assert np.array_equal(pool.read(tid), d)
        filler.unlink()
        pool.evict(list(data), "nvme")
        assert [tiers_of(pool, tid)[0] for tid in data] == ["nvme"] * 4
        for tid, d in data.items():
            assert np.array_equal(pool.read(tid), d)


def test_short_write_then_enospc_from_a_wrapped_pwrite_loses_nothing(tmp_path, monkeypatch):
    """Injected ENOSPC (no mount needed): os.pwrite on the slab writes half, then fails."""
    a = values(F32_PER_PAGE, 3)
    with PagedBufferPool(
        page_size_bytes=PS, host_budget_bytes=2 * PS, nvme_path=str(tmp_path)
    ) as pool:
        pool.allocate("a", a.shape, a.dtype)
        pool.write("a", a)
        real_pwrite = os.pwrite
        calls = []

        def full_disk(fd, data, offset):
            if os.readlink(f"/proc/self/fd/{fd}") != pool.nvme_file:
                return real_pwrite(fd, data, offset)
            calls.append(len(data))
            if len(calls) == 1:
                return real_pwrite(fd, memoryview(data)[: len(data) // 2], offset)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwrite", full_disk)
        with pytest.raises(NvmeFullError, match="page 0 of tensor 'a' at offset 0"):
            pool.evict("a", "nvme")
        assert calls == [PS, PS // 2]
        assert tiers_of(pool, "a") == ["host"]
        assert pool.usage()["nvme"].used_bytes == 0
        assert np.array_equal(pool.read("a"), a)
        monkeypatch.undo()
        pool.evict("a", "nvme")
        assert tiers_of(pool, "a") == ["nvme"] and np.array_equal(pool.read("a"), a)


# --- paths and budgets ----------------------------------------------------------------
def test_read_only_nvme_path_is_refused(tmpfs):
    """A tmpfs mounted read-only (chmod would not stop root)."""
    ro = tmpfs("ro", "ro,size=1m")
    with pytest.raises(NvmePathError, match=rf"nvme_path '{ro}' is not writable \(EROFS"):
        PagedBufferPool(page_size_bytes=PS, host_budget_bytes=PS, nvme_path=str(ro))


def test_nvme_path_under_a_regular_file_is_refused(tmp_path):
    """The no-mount fallback: a path whose parent is a regular file."""
    parent = tmp_path / "a_file"
    parent.write_text("not a directory")
    with pytest.raises(NvmePathError, match="a_file/nvme' does not exist"):
        PagedBufferPool(page_size_bytes=PS, host_budget_bytes=PS, nvme_path=str(parent / "nvme"))
    with pytest.raises(NvmePathError, match="a_file' is not a directory"):
        PagedBufferPool(page_size_bytes=PS, host_budget_bytes=PS, nvme_path=str(parent))
    assert parent.read_text() == "not a directory"


def test_nvme_budget_above_free_disk_space_is_refused_with_both_numbers(tmpfs):
    small = tmpfs("budget", "size=1m")
    with pytest.raises(NvmePathError) as info:
        PagedBufferPool(
            page_size_bytes=PS,
            host_budget_bytes=PS,
            nvme_path=str(small),
            nvme_budget_bytes=4 << 20,
        )
    assert f"nvme_budget_bytes={4 << 20} exceeds the free space" in str(info.value)
    assert "(1048576 bytes free)" in str(info.value)
    assert list(small.iterdir()) == []  # its slab file was removed


def test_buffered_io_is_used_when_o_direct_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    pool = PagedBufferPool(page_size_bytes=PS, host_budget_bytes=PS, nvme_path=str(tmp_path))
    monkeypatch.undo()
    with pool:
        assert pool.nvme_io_mode == "buffered"
        a = values(100, 5)
        pool.allocate("a", a.shape, a.dtype)
        pool.write("a", a)
        pool.evict("a")
        assert np.array_equal(pool.acquire("a"), a)
        pool.release("a")


# --- file ownership -------------------------------------------------------------------
def test_files_of_dead_pids_are_removed_and_of_live_pids_kept(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        stale = tmp_path / f"zrpool-{dead.pid}-0123abcd.slab"
        kept = tmp_path / f"zrpool-{live.pid}-4567abcd.slab"
        other = tmp_path / "zrpool-notes.txt"
        for path in (stale, kept, other):
            path.write_bytes(b"page data")
        with PagedBufferPool(page_size_bytes=PS, host_budget_bytes=PS, nvme_path=str(tmp_path)):
            assert not stale.exists()
            assert kept.read_bytes() == b"page data" and other.read_bytes() == b"page data"
    finally:
        live.kill()
        live.wait()


def test_slab_of_a_killed_process_is_kept_while_it_lives_and_removed_after(tmp_path):
    child_code = textwrap.dedent(
        f"""
        import sys, time
        from zero_runtime.memory import PagedBufferPool
        pool = PagedBufferPool(page_size_bytes={PS}, host_budget_bytes={PS},
                               nvme_path={str(tmp_path)!r})
        print(pool.nvme_file, flush=True)
        time.sleep(120)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE, text=True)
    try:
        child_file = Path(child.stdout.readline().strip())
        assert child_file.exists()
        with PagedBufferPool(page_size_bytes=PS, host_budget_bytes=PS, nvme_path=str(tmp_path)):
            assert child_file.exists()  # its owner is alive
        child.kill()
        child.wait()
        assert child_file.exists()  # SIGKILL: the child could not clean up
        with PagedBufferPool(
            page_size_bytes=PS, host_budget_bytes=PS, nvme_path=str(tmp_path)
        ) as pool:
            assert not child_file.exists()
            assert [p.name for p in tmp_path.iterdir()] == [Path(pool.nvme_file).name]
    finally:
        child.kill()
        child.wait()
