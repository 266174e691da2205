"""Integrity and bad conditions of the paged buffer pool's NVMe tier.

Checksums (a flipped byte, another process's write, a torn write), the preallocated
slab, a full disk, unusable paths, an oversized host budget, I/O mode detection and
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


def store(pool: PagedBufferPool, data: dict[str, np.ndarray]) -> None:
    """Allocate each tensor of ``data`` (id -> array) on the host and write it."""
    for tid, d in data.items():
        pool.allocate(tid, d.shape, d.dtype)
        pool.write(tid, d)


def budgeted_pool(nvme_path: Path) -> PagedBufferPool:
    """A pool of 4 host pages over an 8-page (preallocated) NVMe budget at ``nvme_path``."""
    return PagedBufferPool(
        page_size_bytes=PS,
        host_budget_bytes=4 * PS,
        nvme_path=str(nvme_path),
        nvme_budget_bytes=8 * PS,
    )


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


def test_corruption_by_another_process_is_detected_at_page_in_not_before(tmp_path):
    """dd (another process, conv=notrunc) overwrites 512 bytes inside page 2 of a
    preallocated slab; the pool only notices when that page is paged in, and the other
    pages, before and after it in the file, come back intact."""
    data = {f"t{i}": values(F32_PER_PAGE, 10 + i) for i in range(4)}
    with budgeted_pool(tmp_path) as pool:
        store(pool, data)
        pool.evict(list(data), "nvme")
        slot = pool.describe("t2").pages[0].slot
        garbage = tmp_path / "garbage"
        garbage.write_bytes(b"\x5a" * 512)
        subprocess.run(
            [
                "dd",
                f"if={garbage}",
                f"of={pool.nvme_file}",
                "bs=512",
                f"seek={slot * PS // 512 + 3}",
                "conv=notrunc,fsync",
                "status=none",
            ],
            check=True,
        )
        pool.prefetch(["t0", "t1"])
        pool.synchronize()  # pages not touched by dd page in cleanly
        with pytest.raises(PageChecksumError, match="crc32c") as info:
            pool.acquire("t2")
        assert (info.value.offset, info.value.tensor_id) == (slot * PS, "t2")
        assert tiers_of(pool, "t2") == ["nvme"]
        for tid in ("t0", "t1", "t3"):
            assert np.array_equal(pool.acquire(tid), data[tid])
            pool.release(tid)


def test_a_torn_write_is_detected_by_the_checksum(tmp_path, monkeypatch):
    """A torn write: the page is rewritten in its slot, but only the first half of the new
    contents reaches the file while the write reports success (a device that loses part
    of a write). The slot then holds half new and half old bytes, and the next page-in
    must refuse it rather than return a page that never existed."""
    old, new = values(F32_PER_PAGE, 20), values(F32_PER_PAGE, 21)
    with PagedBufferPool(
        page_size_bytes=PS, host_budget_bytes=2 * PS, nvme_path=str(tmp_path)
    ) as pool:
        pool.allocate("a", old.shape, old.dtype)
        pool.write("a", old)
        pool.evict("a", "nvme")
        slot = pool.describe("a").pages[0].slot
        pool.acquire("a", writable=True)[:] = new  # paged in, changed on the host
        pool.release("a")
        real_pwrite = os.pwrite

        def torn(fd, data, offset):
            if os.readlink(f"/proc/self/fd/{fd}") != pool.nvme_file:
                return real_pwrite(fd, data, offset)
            real_pwrite(fd, memoryview(data)[: len(data) // 2], offset)
            return len(data)  # reports the whole write

        monkeypatch.setattr(os, "pwrite", torn)
        pool.evict("a", "nvme")  # the page-out "succeeds"
        monkeypatch.undo()
        assert pool.describe("a").pages[0].slot == slot  # the old page's slot, reused
        on_disk = np.fromfile(pool.nvme_file, np.float32, PS // 4, offset=slot * PS)
        half = F32_PER_PAGE // 2
        assert np.array_equal(on_disk[:half], new[:half])
        assert np.array_equal(on_disk[half:], old[half:])  # torn: half old, half new
        with pytest.raises(PageChecksumError, match="page 0 of tensor 'a'"):
            pool.acquire("a")
        assert tiers_of(pool, "a") == ["nvme"]


# --- the slab file --------------------------------------------------------------------
def test_budgeted_slab_is_preallocated_and_pages_sit_at_aligned_offsets(tmp_path):
    with PagedBufferPool(
        page_size_bytes=PS,
        host_budget_bytes=4 * PS,
        nvme_path=str(tmp_path),
        nvme_budget_bytes=6 * PS + 100,  # whole pages are reserved: 6
    ) as pool:
        slab = Path(pool.nvme_file)
        before = slab.stat()
        assert before.st_size == 6 * PS and before.st_blocks * 512 >= 6 * PS
        a = values(3 * F32_PER_PAGE - 7, 30)  # a partial last page
        pool.allocate("a", a.shape, a.dtype)
        pool.write("a", a)
        pool.evict("a", "nvme")
        offsets = [p.slot * PS for p in pool.describe("a").pages]
        assert offsets == [0, PS, 2 * PS] and all(o % 4096 == 0 for o in offsets)
        assert slab.stat().st_size == 6 * PS  # no write grew the file
        assert np.array_equal(pool.read("a"), a)
        assert "(preallocated)" in pool._p.nvme.description


def test_unbounded_slab_preallocates_each_slot_before_its_first_write(tmp_path):
    with PagedBufferPool(
        page_size_bytes=PS, host_budget_bytes=4 * PS, nvme_path=str(tmp_path)
    ) as pool:
        slab = Path(pool.nvme_file)
        assert slab.stat().st_size == 0
        pool.allocate("one", (F32_PER_PAGE,), np.float32)
        pool.evict("one", "nvme")
        assert slab.stat().st_size == PS
        pool.allocate("more", (3 * F32_PER_PAGE,), np.float32)
        pool.evict("more", "nvme")
        assert pool._p.nvme.file.reserved_bytes == slab.stat().st_size == 4 * PS
        assert slab.stat().st_blocks * 512 >= 4 * PS
        pool.acquire("one")  # paged in: its slot is free again, and reused next
        pool.release("one")
        pool.evict("one", "nvme")
        assert slab.stat().st_size == 4 * PS


def test_slab_falls_back_to_growing_when_fallocate_is_unsupported(tmp_path, monkeypatch, caplog):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with caplog.at_level("INFO", logger="zero_runtime.memory.io"):
        pool = PagedBufferPool(
            page_size_bytes=PS,
            host_budget_bytes=4 * PS,
            nvme_path=str(tmp_path),
            nvme_budget_bytes=8 * PS,
        )
    with pool:
        assert "(not preallocated (no fallocate))" in pool._p.nvme.description
        a = values(2 * F32_PER_PAGE, 31)
        pool.allocate("a", a.shape, a.dtype)
        pool.write("a", a)
        with caplog.at_level("INFO", logger="zero_runtime.memory.io"):
            pool.evict("a", "nvme")
        assert Path(pool.nvme_file).stat().st_size == 2 * PS  # grown by the writes
        assert np.array_equal(pool.read("a"), a)
    said = [r for r in caplog.records if "fallocate is not supported" in r.getMessage()]
    assert len(said) == 1  # said once, not per write


# --- a full disk ----------------------------------------------------------------------
def test_disk_full_while_paging_out_keeps_pages_on_host(tmpfs):
    """Real ENOSPC: a 1 MiB tmpfs, filled by another file after the pool has started. The
    tier is unbounded, so its slab is preallocated only as slots are first used."""
    nvme = tmpfs("small", "size=1m")
    data = {f"t{i}": values(F32_PER_PAGE, i) for i in range(4)}
    with PagedBufferPool(
        page_size_bytes=PS,
        host_budget_bytes=4 * PS,
        nvme_path=str(nvme),
        queue_depth=1,  # one write at a time: exactly two pages fit
    ) as pool:
        store(pool, data)
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


def test_a_budgeted_slab_is_reserved_at_start_so_a_full_disk_later_cannot_fail_it(tmpfs):
    """The same 1 MiB tmpfs and filler as above, with an 8-page budget: the budget was
    preallocated when the pool started, so every page-out still finds its extent."""
    nvme = tmpfs("reserved", "size=1m")
    data = {f"t{i}": values(F32_PER_PAGE, i) for i in range(4)}
    with budgeted_pool(nvme) as pool:
        slab = Path(pool.nvme_file)
        assert slab.stat().st_size == 8 * PS and slab.stat().st_blocks * 512 >= 8 * PS
        store(pool, data)
        filler = nvme / "filler"
        filler.write_bytes(b"\xa5" * shutil.disk_usage(nvme).free)
        assert shutil.disk_usage(nvme).free < PS
        pool.evict(list(data), "nvme")
        assert [tiers_of(pool, tid)[0] for tid in data] == ["nvme"] * 4
        assert slab.stat().st_size == 8 * PS  # writes land inside the reservation
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
