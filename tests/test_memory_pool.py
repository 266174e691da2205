"""Tests of zero_runtime.memory.pool: the public API of the paged buffer pool.

Small capacities (64 KiB pages, a few pages per tier) and real slab files in tmp_path.
"""

from __future__ import annotations

import crc32c
import numpy as np
import psutil
import pytest
import tensorflow as tf

from zero_runtime.memory import (
    PagedBufferPool,
    PageState,
    PoolClosedError,
    PoolOutOfMemoryError,
)

PS = 64 << 10  # bytes per page in these tests
F32_PER_PAGE = PS // 4


def make_pool(tmp_path, device=0, host=4, nvme: int | None = 8, **kw) -> PagedBufferPool:
    nvme_dir = None
    if nvme is not None:
        nvme_dir = tmp_path / "nvme"
        nvme_dir.mkdir(exist_ok=True)
    return PagedBufferPool(
        page_size_bytes=PS,
        device_budget_bytes=device * PS,
        host_budget_bytes=host * PS,
        nvme_path=None if nvme_dir is None else str(nvme_dir),
        nvme_budget_bytes=None if nvme is None else nvme * PS,
        **kw,
    )


def tiers_of(pool: PagedBufferPool, tid: str) -> list[str | None]:
    return [p.tier for p in pool.describe(tid).pages]


def values(n: int, seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


# --- construction ---------------------------------------------------------------------
@pytest.mark.parametrize("size", [3 * PS, 32 << 10, 0, -PS, True, 2.0 * PS])
def test_page_size_must_be_a_power_of_two_of_at_least_64k(size):
    with pytest.raises(ValueError, match="page_size_bytes must be|must be an integer"):
        PagedBufferPool(page_size_bytes=size, host_budget_bytes=1 << 22)


def test_default_page_size_is_4_mib():
    with PagedBufferPool(host_budget_bytes=4 << 20) as pool:
        assert pool.page_size == 4194304
        assert pool.nvme_io_mode is None and pool.nvme_file is None


def test_host_budget_above_available_memory_is_refused_with_both_numbers():
    budget = psutil.virtual_memory().available + (1 << 30)
    with pytest.raises(ValueError) as info:
        PagedBufferPool(page_size_bytes=PS, host_budget_bytes=budget)
    message = str(info.value)
    assert f"host_budget_bytes={budget} exceeds the memory available" in message
    available = int(message.split("machine (")[1].split(" bytes")[0])
    assert 0 < available < budget


def test_nvme_budget_needs_a_path():
    with pytest.raises(ValueError, match="nvme_budget_bytes was given without nvme_path"):
        PagedBufferPool(page_size_bytes=PS, host_budget_bytes=PS, nvme_budget_bytes=PS)


def test_device_tier_is_labelled_a_stand_in_without_a_gpu(tmp_path):
    with make_pool(tmp_path, device=2) as pool:
        tier = pool.device_tier
        assert tier.is_standin is (not tf.config.list_physical_devices("GPU"))
        if tier.is_standin:
            assert tier.device_name == "/CPU:0"
            assert tier.description.startswith("device (CPU stand-in)")
        assert pool.usage()["device"].capacity_bytes == 2 * PS


# --- data -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.float64, np.uint8, np.bool_])
def test_multi_page_tensor_reads_back_with_shape_and_dtype_from_every_tier(tmp_path, dtype):
    shape = (3, PS // 8 + 5)  # ~ 3/8 page per row: spans pages unevenly
    rng = np.random.default_rng(1)
    data = (rng.standard_normal(shape) * 100).astype(dtype)
    with make_pool(tmp_path, device=4, host=4) as pool:
        pool.allocate("x", shape, dtype, kind="param", tier="device")
        info = pool.describe("x")
        assert info.nbytes == data.nbytes and len(info.pages) == -(-data.nbytes // PS)
        assert np.array_equal(pool.read("x"), np.zeros(shape, dtype))
        pool.write("x", data)
        for tier in ("device", "host", "nvme"):
            if tier != "device":
                pool.evict("x", tier)
            assert set(tiers_of(pool, "x")) == {tier}
            out = pool.read("x")
            assert out.shape == shape and out.dtype == np.dtype(dtype)
            assert np.array_equal(out, data)
        host = pool.acquire("x")
        assert np.array_equal(host, data) and host.dtype == np.dtype(dtype)
        pool.release("x")
        dev = pool.acquire("x", tier="device")
        assert isinstance(dev, tf.Tensor) and dev.shape == shape
        assert dev.dtype == tf.as_dtype(dtype)
        assert np.array_equal(dev.numpy(), data)
        pool.release("x")


def test_write_checks_shape_and_casts_like_numpy(tmp_path):
    with make_pool(tmp_path) as pool:
        pool.allocate("w", (4,), np.float32)
        with pytest.raises(ValueError, match=r"array shape \(3,\) != tensor shape \(4,\)"):
            pool.write("w", np.zeros(3))
        pool.write("w", [1, 2, 3, 4.5])
        assert pool.read("w").tolist() == [1.0, 2.0, 3.0, 4.5]


def test_acquire_is_read_only_unless_writable_and_writes_back_at_release(tmp_path):
    with make_pool(tmp_path) as pool:
        small = values(10, 0)
        big = values(2 * F32_PER_PAGE + 3, 1)  # 3 pages
        for tid, data in (("small", small), ("big", big)):
            pool.allocate(tid, data.shape, data.dtype)
            pool.write(tid, data)
            ro = pool.acquire(tid)
            with pytest.raises(ValueError, match="read-only"):
                ro[0] = 5.0
            pool.release(tid)
            rw = pool.acquire(tid, writable=True)
            rw[-1] = 42.0
            pool.release(tid)
            expected = data.copy()
            expected[-1] = 42.0
            assert np.array_equal(pool.read(tid), expected)
        with pytest.raises(ValueError, match="'big' is not acquired"):
            pool.release("big")


def test_free_releases_every_tier_and_refuses_pinned(tmp_path):
    with make_pool(tmp_path, device=1) as pool:
        pool.allocate("a", (F32_PER_PAGE * 3,), np.float32, tier="host")
        pool.evict("a", "nvme")
        pool.allocate("b", (8,), np.float32, tier="device")
        pool.pin("b")
        with pytest.raises(ValueError, match="'b' is pinned"):
            pool.free("b")
        pool.unpin("b")
        pool.free("a")
        pool.free("b")
        assert [u.used_bytes for u in pool.usage().values()] == [0, 0, 0]
        with pytest.raises(KeyError, match="'a' is not allocated"):
            pool.read("a")


def test_reservation_is_counted_and_pinned_on_the_device_but_holds_no_bytes(tmp_path):
    """A stage-3 device shard is a TensorFlow variable; the pool reserves its pages: they
    count on the device tier and in describe, are never moved (a budget below them is
    refused, another tensor goes down instead), and reads/writes are refused."""
    with make_pool(tmp_path, device=3, host=2) as pool:
        pool.reserve("shard", (F32_PER_PAGE + 1,), np.float32, "param")  # 2 pages
        assert tiers_of(pool, "shard") == ["device", "device"]
        assert pool.usage()["device"].used_bytes == 2 * PS
        assert pool.describe("shard").kind == "param"
        for call in (pool.read, pool.acquire, lambda t: pool.write(t, np.zeros(1))):
            with pytest.raises(ValueError, match="'shard': it is a reservation"):
                call("shard")
        pool.allocate("a", (F32_PER_PAGE,), np.float32, tier="device")
        pool.allocate("b", (F32_PER_PAGE,), np.float32, tier="device")  # a moves down
        assert tiers_of(pool, "a") == ["host"] and tiers_of(pool, "shard")[0] == "device"
        with pytest.raises(PoolOutOfMemoryError):
            pool.set_device_budget(PS)  # only b could move: the reservation stays
        pool.free("shard")  # its pin is the reservation's own
        assert pool.usage()["device"].used_bytes == PS
    with make_pool(tmp_path, device=0) as pool, pytest.raises(ValueError, match="device tier"):
        pool.reserve("x", (1,), np.float32, "param")


# --- eviction -------------------------------------------------------------------------
def test_full_tier_evicts_least_recently_used_first(tmp_path):
    with make_pool(tmp_path, host=3) as pool:
        for tid in "abc":
            pool.allocate(tid, (F32_PER_PAGE,), np.float32)
        pool.acquire("a")
        pool.release("a")  # a is now the most recent; b the least
        pool.allocate("d", (F32_PER_PAGE,), np.float32)
        assert {t: tiers_of(pool, t)[0] for t in "abcd"} == {
            "a": "host",
            "b": "nvme",
            "c": "host",
            "d": "host",
        }
        assert pool.step_boundary(0).evictions == 1


def test_access_order_evicts_by_reuse_distance(tmp_path):
    with make_pool(tmp_path, host=3) as pool:
        for tid in "abc":
            pool.allocate(tid, (F32_PER_PAGE,), np.float32)
        pool.set_access_order(["b", "a", "c"])  # c is needed last; LRU would pick a
        pool.allocate("d", (F32_PER_PAGE,), np.float32)
        assert tiers_of(pool, "c") == ["nvme"] and tiers_of(pool, "a") == ["host"]


def test_device_eviction_cascades_through_host_to_nvme(tmp_path):
    data = {t: values(F32_PER_PAGE, i) for i, t in enumerate("abc")}
    with make_pool(tmp_path, device=1, host=1) as pool:
        for tid, d in data.items():
            pool.allocate(tid, d.shape, d.dtype, tier="device")
            pool.write(tid, d)
        assert [tiers_of(pool, t)[0] for t in "abc"] == ["nvme", "host", "device"]
        c = pool.step_boundary(0)
        assert (c.d2h_pages, c.h2n_pages, c.evictions) == (2, 1, 3)
        for tid, d in data.items():
            assert np.array_equal(pool.read(tid), d)


def test_out_of_memory_is_a_resource_exhausted_error_with_a_snapshot(tmp_path):
    with make_pool(tmp_path, host=2, nvme=None) as pool:
        pool.allocate("a", (F32_PER_PAGE,), np.float32, kind="param")
        pool.allocate("b", (F32_PER_PAGE,), np.float32, kind="optimizer")
        pool.write("a", np.full(F32_PER_PAGE, 7, np.float32))
        with pytest.raises(tf.errors.ResourceExhaustedError) as info:
            pool.allocate("c", (10,), np.float32, kind="grad")
        err = info.value
        assert isinstance(err, PoolOutOfMemoryError)
        snap = err.snapshot
        assert (snap.request_tensor_id, snap.request_tier, snap.request_bytes) == ("c", "host", PS)
        assert snap.tiers["host"] == {"capacity_bytes": 2 * PS, "used_bytes": 2 * PS}
        assert snap.tiers["nvme"]["capacity_bytes"] == 0
        assert {(h.tensor_id, h.kind, h.bytes, h.pages) for h in snap.holders["host"]} == {
            ("a", "param", PS, 1),
            ("b", "optimizer", PS, 1),
        }
        assert "host tier is full (2 of 2 page slots); there is no NVMe tier" in err.message
        assert "c" not in pool.tensor_ids()
        assert np.all(pool.read("a") == 7)


def test_pinned_pages_never_move_and_oom_says_so(tmp_path):
    with make_pool(tmp_path, host=2) as pool:
        pool.allocate("a", (F32_PER_PAGE,), np.float32)
        pool.allocate("b", (F32_PER_PAGE,), np.float32)
        pool.pin("a")
        pool.acquire("b")
        with pytest.raises(PoolOutOfMemoryError, match="2 of them held by pinned or acquired"):
            pool.allocate("c", (1,), np.float32)
        with pytest.raises(ValueError, match="'a' is pinned or acquired"):
            pool.evict("a")
        pool.release("b")
        pool.allocate("c", (1,), np.float32)  # b can move now
        assert tiers_of(pool, "a") == ["host"] and tiers_of(pool, "b") == ["nvme"]


def test_tensor_larger_than_the_tier_fails_fast_without_moving_anything(tmp_path):
    with make_pool(tmp_path, host=2) as pool:
        pool.allocate("a", (F32_PER_PAGE,), np.float32)
        with pytest.raises(PoolOutOfMemoryError, match="needs 3 pages and the host tier has 2"):
            pool.allocate("big", (3 * F32_PER_PAGE,), np.float32)
        assert tiers_of(pool, "a") == ["host"]
        assert pool.step_boundary(0).h2n_pages == 0


# --- prefetch, acquire, counters ------------------------------------------------------
def test_prefetch_turns_acquire_misses_into_hits(tmp_path):
    with make_pool(tmp_path, host=4) as pool:
        for i, tid in enumerate("ab"):
            pool.allocate(tid, (2 * F32_PER_PAGE,), np.float32)  # 2 pages each
            pool.write(tid, values(2 * F32_PER_PAGE, i))
        pool.evict(["a", "b"], "nvme")
        pool.step_boundary(0)
        pool.acquire("a")  # not prefetched: both pages are misses
        pool.release("a")
        pool.prefetch(["b"])
        pool.synchronize()
        assert tiers_of(pool, "b") == ["host", "host"]
        got = pool.acquire("b")
        assert np.array_equal(got, values(2 * F32_PER_PAGE, 1))
        pool.release("b")
        c = pool.step_boundary(1)
        assert (c.prefetch_hits, c.prefetch_misses) == (2, 2)
        assert (c.n2h_pages, c.n2h_bytes) == (4, 4 * PS)
        assert c.stall_seconds > 0 and c.io_seconds > 0
        assert pool.step_boundary(2) == type(c)()  # counters restart at zero


def test_usage_reports_kinds_and_peak_since_the_last_step(tmp_path):
    with make_pool(tmp_path, host=4) as pool:
        pool.allocate("p", (F32_PER_PAGE + 1,), np.float32, kind="param")  # 2 pages
        pool.allocate("g", (10,), np.float32, kind="grad")
        pool.free("g")
        use = pool.usage()["host"]
        assert (use.used_bytes, use.peak_bytes, use.capacity_bytes) == (2 * PS, 3 * PS, 4 * PS)
        assert use.bytes_by_kind == {
            "param": 2 * PS,
            "grad": 0,
            "optimizer": 0,
            "activation": 0,
            "other": 0,
        }
        pool.step_boundary(0)
        assert pool.usage()["host"].peak_bytes == 2 * PS
        assert pool.usage()["nvme"].capacity_bytes == 8 * PS


def test_page_info_reports_state_and_checksum(tmp_path):
    with make_pool(tmp_path) as pool:
        pool.allocate("a", (10,), np.float32)
        pool.evict("a")
        page = pool.describe("a").pages[0]
        assert page.state is PageState.ON_NVME and page.payload == 40
        assert page.checksum == crc32c.crc32c(np.zeros(10, np.float32).tobytes())


def test_closed_pool_refuses_calls_and_removes_its_file(tmp_path):
    pool = make_pool(tmp_path)
    path = pool.nvme_file
    pool.allocate("a", (10,), np.float32)
    pool.evict("a")
    assert path is not None and (tmp_path / "nvme" / path.split("/")[-1]).exists()
    pool.close()
    pool.close()  # idempotent
    assert pool.closed and not list((tmp_path / "nvme").iterdir())
    with pytest.raises(PoolClosedError, match="closed"):
        pool.read("a")


def test_prefetch_never_evicts_pages_needed_sooner_than_what_it_brings(tmp_path):
    for order, expected in ((["a", "b", "c"], "nvme"), (None, "host")):
        with make_pool(tmp_path, host=2) as pool:
            for tid in "cab":  # c first: it goes to NVMe when b arrives
                pool.allocate(tid, (F32_PER_PAGE,), np.float32)
            assert tiers_of(pool, "c") == ["nvme"]
            pool.set_access_order(order)
            pool.prefetch("c")
            pool.synchronize()
            # With the order, a and b are needed before c: the prefetch gives up.
            # Without it, LRU lets the prefetch evict a.
            assert tiers_of(pool, "c") == [expected]
            assert tiers_of(pool, "b") == ["host"]


def test_a_prefetch_that_runs_after_its_tensor_was_used_leaves_it_where_it_is(tmp_path):
    """The NVMe optimizer's read-ahead, with the thread late (a loaded CPU): the request
    for a sub-group is queued, the sub-group is acquired, updated and written behind
    to NVMe, and only then does the thread reach the request. It must not read the
    sub-group back (stop 30's CI: 12 page-outs for 10, and a page left on host)."""
    with make_pool(tmp_path, host=4) as pool:
        pool.allocate("a", (F32_PER_PAGE,), np.float32)
        pool.write("a", values(F32_PER_PAGE, 3))
        pool.evict("a", "nvme")
        pool.step_boundary(0)
        core = pool._p  # the thread's own steps, run by hand at the late point
        with core.cond:
            late = core.prefetcher.request(("a",), "host")
        pool.acquire("a", writable=True)[:] += 1
        pool.release("a")
        pool.evict("a", "nvme")
        with core.cond:
            assert core.prefetcher.place(late)
        pool.synchronize()
        assert tiers_of(pool, "a") == ["nvme"]
        c = pool.step_boundary(1)
        assert (c.n2h_pages, c.h2n_pages) == (1, 1)  # the acquire's read, the write-behind
        with core.cond:  # a request queued after the use still brings the tensor
            assert core.prefetcher.place(core.prefetcher.request(("a",), "host"))
        pool.synchronize()
        assert tiers_of(pool, "a") == ["host"]
        assert np.array_equal(pool.read("a"), values(F32_PER_PAGE, 3) + 1)


def test_close_while_prefetching_finishes_io_and_removes_the_file(tmp_path):
    pool = make_pool(tmp_path, host=2, nvme=16)
    ids = [f"t{i}" for i in range(12)]
    for tid in ids:
        pool.allocate(tid, (F32_PER_PAGE,), np.float32)
    pool.evict(ids, "nvme")
    for tid in ids:
        pool.prefetch(tid)
    pool.close()
    assert pool.closed and not list((tmp_path / "nvme").iterdir())


def test_a_placement_that_keeps_losing_its_pages_fails_instead_of_waiting_forever(
    tmp_path, monkeypatch
):
    """A blocking placement is bounded by its own page moves (else two acquires can evict
    each other's pages and stall the step); the bound is lowered here so a
    two-hop NVMe -> host -> device move crosses it."""
    from zero_runtime.memory import placement

    data = values(F32_PER_PAGE, 3)
    with make_pool(tmp_path, device=1, host=1) as pool:
        for tid in "ab":
            pool.allocate(tid, data.shape, data.dtype, tier="host")
            pool.write(tid, data)
        assert tiers_of(pool, "a") == ["nvme"]
        monkeypatch.setattr(placement, "THRASH_HOPS_PER_PAGE", 0)
        monkeypatch.setattr(placement, "THRASH_SLACK_HOPS", 1)
        with pytest.raises(PoolOutOfMemoryError, match="placement thrashes: 2 page moves for 1"):
            pool.acquire("a", tier="device")
        monkeypatch.setattr(placement, "THRASH_SLACK_HOPS", 16)
        assert np.array_equal(pool.read("a"), data)  # nothing lost, pool still serves
        assert np.array_equal(pool.read("b"), data)
