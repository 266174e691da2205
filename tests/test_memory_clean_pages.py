"""Clean pages: a page read in from NVMe keeps its NVMe copy until it is written, so its
eviction writes nothing (``PageState.ON_HOST_CLEAN``, counted as ``h2n_clean``).

Real slab files in tmp_path; the writes are read from the I/O threads' own counters
(``h2n_pages``/``h2n_bytes`` count jobs that ran) and the slab's bytes are checked by
reading the tensors back through the CRC-checked path.
"""

from __future__ import annotations

import numpy as np
import pytest

from zero_runtime.memory import PagedBufferPool, PageState

PS = 64 << 10
F32_PER_PAGE = PS // 4


def make_pool(tmp_path, host: int, nvme: int | None) -> PagedBufferPool:
    d = tmp_path / "nvme"
    d.mkdir(exist_ok=True)
    return PagedBufferPool(
        page_size_bytes=PS,
        host_budget_bytes=host * PS,
        nvme_path=str(d),
        nvme_budget_bytes=None if nvme is None else nvme * PS,
    )


def states(pool: PagedBufferPool, tid: str) -> list[PageState]:
    return [p.state for p in pool.describe(tid).pages]


def values(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_a_page_read_and_evicted_again_is_not_rewritten(tmp_path):
    data = values(3 * F32_PER_PAGE, 0)
    with make_pool(tmp_path, host=4, nvme=8) as pool:
        pool.allocate("w", data.shape, np.float32, kind="param")
        pool.write("w", data)
        pool.evict("w", "nvme")
        first = pool.step_boundary(0)
        assert (first.h2n_pages, first.h2n_bytes, first.h2n_clean_pages) == (3, data.nbytes, 0)

        got = pool.acquire("w")  # read in: clean, the NVMe copy kept
        assert np.array_equal(got, data)
        pool.release("w")
        assert states(pool, "w") == [PageState.ON_HOST_CLEAN] * 3
        assert pool.usage()["nvme"].pages == 3 and pool.usage()["host"].pages == 3
        pool.evict("w", "nvme")
        second = pool.step_boundary(1)
        assert (second.n2h_pages, second.n2h_bytes) == (3, data.nbytes)
        assert (second.h2n_pages, second.h2n_bytes) == (0, 0)  # no write
        assert (second.h2n_clean_pages, second.h2n_clean_bytes) == (3, data.nbytes)
        assert states(pool, "w") == [PageState.ON_NVME] * 3
        assert pool.usage()["host"].pages == 0
        assert np.array_equal(pool.read("w"), data)  # the kept copy, CRC-checked


@pytest.mark.parametrize("how", ["write", "writable acquire"])
def test_a_written_page_is_dirty_and_written_at_its_eviction(tmp_path, how):
    data = values(2 * F32_PER_PAGE, 1)
    new = values(2 * F32_PER_PAGE, 2)
    with make_pool(tmp_path, host=4, nvme=8) as pool:
        pool.allocate("w", data.shape, np.float32, kind="optimizer")
        pool.write("w", data)
        pool.evict("w", "nvme")
        pool.acquire("w")
        pool.release("w")
        assert states(pool, "w") == [PageState.ON_HOST_CLEAN] * 2
        pool.step_boundary(0)
        if how == "write":
            pool.write("w", new)
        else:
            got = pool.acquire("w", writable=True)
            got[:] = new
            pool.release("w")
        # Dirty: the stale NVMe copies were given back to the NVMe tier.
        assert states(pool, "w") == [PageState.ON_HOST] * 2
        assert pool.usage()["nvme"].pages == 0
        pool.evict("w", "nvme")
        c = pool.step_boundary(1)
        assert (c.h2n_pages, c.h2n_clean_pages) == (2, 0)
        assert np.array_equal(pool.read("w"), new)


def test_clean_victims_make_room_without_writes(tmp_path):
    # Host of 2 pages: reading a, then b, then a again evicts clean pages only.
    a, b = values(2 * F32_PER_PAGE, 3), values(2 * F32_PER_PAGE, 4)
    with make_pool(tmp_path, host=2, nvme=8) as pool:
        for tid, d in (("a", a), ("b", b)):
            pool.allocate(tid, d.shape, np.float32, kind="param")
            pool.write(tid, d)
            pool.evict(tid, "nvme")
        pool.step_boundary(0)
        for tid, d in (("a", a), ("b", b), ("a", a)):
            assert np.array_equal(pool.acquire(tid), d)
            pool.release(tid)
        c = pool.step_boundary(1)
        assert c.n2h_pages == 6
        assert (c.h2n_pages, c.h2n_clean_pages, c.evictions) == (0, 4, 4)


def test_a_full_nvme_tier_takes_back_clean_copies_for_dirty_pages(tmp_path):
    # NVMe of 2 pages, both held by clean copies of "a"; paging "b" out needs one of
    # them: that copy is dropped (a turns dirty), and a is rewritten when it goes down.
    a, b = values(F32_PER_PAGE, 5), values(F32_PER_PAGE, 6)
    with make_pool(tmp_path, host=3, nvme=2) as pool:
        pool.allocate("a", (2 * F32_PER_PAGE,), np.float32)
        pool.write("a", np.concatenate([a, b]))
        pool.evict("a", "nvme")
        pool.acquire("a")
        pool.release("a")
        assert pool.usage()["nvme"].pages == 2  # clean copies fill the tier
        pool.allocate("b", (F32_PER_PAGE,), np.float32)
        pool.write("b", b)
        pool.evict("b", "nvme")
        assert states(pool, "b") == [PageState.ON_NVME]
        assert sorted(s.name for s in states(pool, "a")) == ["ON_HOST", "ON_HOST_CLEAN"]
        assert np.array_equal(pool.read("a"), np.concatenate([a, b]))
        assert np.array_equal(pool.read("b"), b)


def test_page_views_read_in_place_and_a_writable_view_dirties_the_page(tmp_path):
    """``acquire_pages``: each page's own host memory, no copy. Read-only views leave
    the pages clean (evicted with no write); writes through writable views are in the
    pool with no release-time copy, and the stale NVMe copies are dropped (evicting
    writes them)."""
    pool = make_pool(tmp_path, host=4, nvme=None)
    n = 2 * F32_PER_PAGE + 100  # 3 pages, the last one short
    data = values(n, 3)
    pool.allocate("t", (n,), np.float32, kind="optimizer", tier="host")
    pool.write("t", data)
    pool.evict(["t"], "nvme")
    pool.step_boundary(0)
    views = pool.acquire_pages("t")
    assert [len(v) for v in views] == [F32_PER_PAGE, F32_PER_PAGE, 100]
    np.testing.assert_array_equal(np.concatenate(views), data)
    assert not views[0].flags.writeable
    with pytest.raises(ValueError, match="acquire_pages"):
        pool.acquire("t")  # an array copy beside the views would overwrite them
    pool.release("t")
    pool.evict(["t"], "nvme")
    c = pool.step_boundary(1)
    assert (c.n2h_pages, c.h2n_pages, c.h2n_clean_pages) == (3, 0, 3)
    views = pool.acquire_pages("t", writable=True)
    assert states(pool, "t") == [PageState.ON_HOST] * 3  # NVMe copies dropped: stale
    views[1][:5] = -1.0
    views[2][-1] = 7.0
    expected = data.copy()
    expected[F32_PER_PAGE : F32_PER_PAGE + 5] = -1.0
    expected[-1] = 7.0
    np.testing.assert_array_equal(pool.read("t"), expected)  # in the pages already
    pool.release("t")
    pool.evict(["t"], "nvme")
    c = pool.step_boundary(2)
    assert (c.h2n_pages, c.h2n_clean_pages) == (3, 0)
    np.testing.assert_array_equal(pool.read("t"), expected)
    array = pool.acquire("t")
    with pytest.raises(ValueError, match="acquired by acquire"):
        pool.acquire_pages("t")
    np.testing.assert_array_equal(array, expected)
    pool.release("t")
    pool.close()


def test_fork_hands_a_clean_tensors_host_copy_over_and_keeps_its_nvme_copy(tmp_path):
    """``fork``: the copy-on-write step of shadow paging. A tensor read in from NVMe
    (clean) gives its host pages to the new tensor and keeps its NVMe copy: no page is
    written and no room is made (the host holds exactly what it held). Writes to the new
    tensor leave the source as it was. A source written on the host since its read (no
    NVMe copy) or acquired is refused with nothing changed."""
    pool = make_pool(tmp_path, host=4, nvme=None)
    n = 2 * F32_PER_PAGE + 10
    data = values(n, 4)
    pool.allocate("old", (n,), np.float32, kind="optimizer", tier="host")
    pool.write("old", data)
    pool.evict(["old"], "nvme")
    pool.step_boundary(0)
    assert pool.fork("old", "new")  # on NVMe only: read in first, then handed over
    c = pool.step_boundary(1)
    assert (c.n2h_pages, c.h2n_pages, c.h2n_clean_pages) == (3, 0, 3)
    assert states(pool, "old") == [PageState.ON_NVME] * 3
    assert states(pool, "new") == [PageState.ON_HOST] * 3
    assert pool.usage()["host"].used_bytes == 3 * PS
    info = pool.describe("new")
    assert (info.shape, info.dtype, info.kind) == ((n,), np.dtype(np.float32), "optimizer")
    np.testing.assert_array_equal(pool.read("new"), data)
    changed = data * 2
    pool.write("new", changed)
    np.testing.assert_array_equal(pool.read("old"), data)  # from its NVMe copy
    np.testing.assert_array_equal(pool.read("new"), changed)
    with pytest.raises(ValueError, match="already allocated"):
        pool.fork("old", "new")
    assert not pool.fork("new", "other")  # dirty: nothing on NVMe to keep
    pool.acquire("old")
    assert not pool.fork("old", "other")  # acquired
    pool.release("old")
    assert "other" not in pool.tensor_ids()
    pool.evict(["new"], "nvme")
    pool.step_boundary(2)
    np.testing.assert_array_equal(pool.read("new"), changed)
    np.testing.assert_array_equal(pool.read("old"), data)
    pool.close()


def _mixed_kinds_run(pool: PagedBufferPool) -> list:
    """Two steps and an open third on a host of 2 pages: a 'param' tensor of 2 pages and
    an 'optimizer' tensor of 1 page paged out, read back in turn (clean victims), the
    optimizer page written (dirty) and paged out again. Returns the closed steps'
    counters."""
    p, o = values(2 * F32_PER_PAGE, 7), values(F32_PER_PAGE, 8)
    pool.allocate("p", p.shape, np.float32, kind="param")
    pool.allocate("o", o.shape, np.float32, kind="optimizer")
    for tid, d in (("p", p), ("o", o)):
        pool.write(tid, d)
        pool.evict(tid, "nvme")
    steps = [pool.step_boundary(0)]
    for tid, d in (("p", p), ("o", o), ("p", p)):
        assert np.array_equal(pool.acquire(tid), d)
        pool.release(tid)
    steps.append(pool.step_boundary(1))
    got = pool.acquire("o", writable=True)  # read in again, then written: dirty
    got += 1
    pool.release("o")
    pool.evict("o", "nvme")  # written
    return steps


def test_pool_totals_sum_the_steps_and_split_the_moves_by_kind(tmp_path):
    """``PagedBufferPool.totals``: every step's counters summed, the open step's
    included and untouched by ``step_boundary``, and the page moves by tensor kind:
    per kind the bytes read from and written to NVMe, and the clean page-outs (writes
    avoided) that left the host with no write."""
    with make_pool(tmp_path, host=2, nvme=8) as pool:
        closed = _mixed_kinds_run(pool)
        totals = pool.totals()
        open_step = pool.step_boundary(2)
        assert pool.totals() == totals  # closing a step changes no total
    steps = [*closed, open_step]
    for name in ("h2n_pages", "h2n_bytes", "n2h_pages", "n2h_bytes", "h2n_clean_pages"):
        assert getattr(totals.counters, name) == sum(getattr(c, name) for c in steps), name
    assert totals.counters.evictions == sum(c.evictions for c in steps)
    page = PS
    param, opt = totals.by_kind["param"], totals.by_kind["optimizer"]
    # Written once each at step 0; the optimizer page again after its write.
    assert (param["h2n_pages"], param["h2n_bytes"]) == (2, 2 * page)
    assert (opt["h2n_pages"], opt["h2n_bytes"]) == (2, 2 * page)
    # Read: p's 2 pages, then o (a p page evicted clean), then p's evicted page again
    # (o evicted clean), then o again (a p page evicted clean).
    assert (param["n2h_pages"], param["n2h_bytes"]) == (3, 3 * page)
    assert (opt["n2h_pages"], opt["n2h_bytes"]) == (2, 2 * page)
    assert (param["h2n_clean_pages"], opt["h2n_clean_pages"]) == (2, 1)
    for name in ("h2n_pages", "n2h_bytes", "h2n_clean_bytes"):
        assert param[name] + opt[name] == getattr(totals.counters, name), name
    assert param["h2n_clean_pages"] + opt["h2n_clean_pages"] == totals.counters.h2n_clean_pages
    summary = totals.as_dict()
    assert summary["writes_avoided_bytes"] == totals.counters.h2n_clean_bytes
    assert summary["clean_page_outs"] == totals.counters.h2n_clean_pages
    assert summary["read_bytes_by_kind"] == {"param": 3 * page, "optimizer": 2 * page}
    assert summary["written_bytes_by_kind"] == {"param": 2 * page, "optimizer": 2 * page}
    assert "grad" not in summary["by_kind"]


def test_bench_max_model_reports_each_pools_totals(tmp_path):
    """bench_max_model's ``page_totals``: the parameter pool's and the NVMe optimizer
    store's totals apart (the store's pool), None for a host store (no pages)."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from zero_runtime.optim.host_state import HostOptimizerState
    from zero_runtime.optim.layout import FlatLayout
    from zero_runtime.optim.nvme_state import NvmeOptimizerState

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import bench_max_model
    finally:
        sys.path.pop(0)
    layout = FlatLayout.from_variables([SimpleNamespace(shape=(4 * F32_PER_PAGE,), path="w")], 2)
    nvme = tmp_path / "opt"
    nvme.mkdir(exist_ok=True)
    store = NvmeOptimizerState(layout, ("m",), str(nvme), F32_PER_PAGE, PS)
    with make_pool(tmp_path, host=2, nvme=8) as pool:
        _mixed_kinds_run(pool)
        n = layout.shard_size
        step = lambda slots, scratch, p, g: np.add(slots["m"], g, out=slots["m"])  # noqa: E731
        for s in range(2):
            store.update(0, ((0, n),), np.zeros(n, np.float32), np.ones(n, np.float32), step)
            store.step_boundary(s)
        got = bench_max_model.page_totals(pool, store)
        assert got["param_pool"] == pool.totals().as_dict()
        assert got["optimizer_store"] == store.pool.totals().as_dict()
        assert set(got["optimizer_store"]["by_kind"]) == {"optimizer"}
        assert got["optimizer_store"]["written_bytes_by_kind"]["optimizer"] >= 2 * PS
        host = HostOptimizerState(layout, ("m",))
        assert bench_max_model.page_totals(pool, host)["optimizer_store"] is None
    store.close()
