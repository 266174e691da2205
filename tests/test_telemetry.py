"""Telemetry that tells the truth: the Timeline's overlap arithmetic, exact page
counts and bytes of a step that pages to NVMe, and tier bytes equal to the pool's own
accounting (real training with Keras fit, a real NVMe slab file under tmp_path)."""

from __future__ import annotations

import math
import time

import keras
import numpy as np
import pytest

import zero_runtime
from zero_runtime.telemetry import BackgroundEmitter, Timeline, intersect, overlap, total, union
from zero_runtime.telemetry.collector import step_timing

# -- Timeline -----------------------------------------------------------------------------


def test_union_and_intersection_arithmetic():
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert union([(1, 1), (2, 1)]) == []  # empty and reversed intervals are dropped
    assert intersect([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]
    assert total([(0, 1), (0.5, 1.5)]) == pytest.approx(1.5)


def test_fully_overlapped_comm_gives_ratio_one():
    tl = Timeline()
    tl.add("compute", 0.0, 10.0)
    for s in range(0, 10, 2):
        tl.add("comm", s + 0.5, s + 1.5)  # every comm second under compute
    o = tl.overlap()
    assert o.comm_seconds == pytest.approx(5.0)
    assert o.overlap_ratio == pytest.approx(1.0)


def test_serialized_comm_gives_ratio_zero():
    comm = [(i + 0.5, i + 1.0) for i in range(5)]
    compute = [(i, i + 0.5) for i in range(5)]  # alternating, never concurrent
    o = overlap(comm, compute)
    assert o.overlap_ratio == pytest.approx(0.0)
    assert o.compute_seconds == pytest.approx(2.5)


def test_partial_overlap_and_no_comm():
    o = overlap([(0, 4)], [(3, 10)])
    assert o.overlap_seconds == pytest.approx(1.0)
    assert o.overlap_ratio == pytest.approx(0.25)
    assert math.isnan(overlap([], [(0, 1)]).overlap_ratio)  # no comm: not measured


def test_step_timing_from_collective_lanes_and_io():
    # Two replicas over a 10 s step. Replica A in collectives 2-4 and 6-7, replica B in
    # 3-5 and 6-8: both inside one (blocked) during 3-4 and 6-7; comm covers 2-5 and 6-8.
    lanes = [[(2, 4), (6, 7)], [(3, 5), (6, 8)]]
    t = step_timing((0, 10), lanes, io=[], host_compute=[])
    assert t["comm_seconds"] == pytest.approx(5.0)
    assert t["compute_seconds"] == pytest.approx(8.0)  # 10 - blocked (1 + 1)
    assert t["overlap_seconds"] == pytest.approx(3.0)  # 2-3, 4-5, 7-8
    assert t["overlap_ratio"] == pytest.approx(0.6)
    # NVMe I/O 8.5-9.5 runs while nothing is blocked; 0.5 s of page waits summed over the
    # 2 replicas: 0.25 s of one replica's I/O was exposed.
    t = step_timing((0, 10), lanes, io=[(8.5, 9.5)], host_compute=[], stall_seconds=0.5)
    assert t["comm_seconds"] == pytest.approx(6.0)
    assert t["overlap_seconds"] == pytest.approx(3.75)
    # One replica: its collectives are blocked time (a lower bound: no overlap seen), the
    # host update counts as compute; intervals outside the window are clipped.
    t = step_timing((0, 10), [[(-1, 1), (2, 4)]], io=[], host_compute=[(3, 3.5)])
    assert t["comm_seconds"] == pytest.approx(3.0)
    assert t["compute_seconds"] == pytest.approx(7.5)
    assert t["overlap_seconds"] == pytest.approx(0.5)
    t = step_timing((0, 10), [], io=[], host_compute=[])
    assert t["comm_seconds"] == 0 and math.isnan(t["overlap_ratio"])
    with pytest.raises(ValueError, match="window"):
        step_timing((5, 5), lanes, io=[], host_compute=[])


def test_timeline_drain_clears_and_rejects_unknown_kind():
    tl = Timeline()
    tl.add("comm", 0, 1)
    assert tl.drain()["comm"] == [(0.0, 1.0)]
    assert tl.drain() == {"comm": [], "compute": []}
    with pytest.raises(ValueError, match="kind"):
        tl.add("io", 0, 1)


# -- a real step that pages ---------------------------------------------------------------

PAGE = 1 << 16  # 64 KiB, the smallest page
SUB_GROUP = 200  # elements


def _nvme_run(tmp_path, steps: int):
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 1,
            "offload_optimizer": "nvme",
            "nvme_path": str(tmp_path / "nvme"),
            "page_size_bytes": PAGE,
            "sub_group_size": SUB_GROUP,
        },
        logdir=str(tmp_path / "run"),
    )
    (tmp_path / "nvme").mkdir(exist_ok=True)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(64), keras.layers.Dense(1)]
        )  # 8*64+64 + 64+1 = 641 parameters
        model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.random((16 * steps, 8), dtype=np.float32)
    y = rng.random((16 * steps, 1), dtype=np.float32)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    return strategy, model


def test_paging_step_records_exact_counts_and_bytes(tmp_path):
    strategy, model = _nvme_run(tmp_path, steps=3)
    runtime = strategy.runtime
    store = model.optimizer.zero_state.store
    layout = store.layout
    shard = layout.shard_size  # ceil(641 / 2) = 321 elements per replica
    assert shard == 321
    subgroups = -(-shard // SUB_GROUP)  # 2
    slots = 2  # Adam: momentum, velocity
    replicas = 2
    pages = (
        replicas
        * slots
        * sum(
            -(-4 * (min(shard, (j + 1) * SUB_GROUP) - j * SUB_GROUP) // PAGE)
            for j in range(subgroups)
        )
    )  # one page per tensor here
    payload = replicas * slots * 4 * shard  # bytes of every slot of every shard
    rec = runtime.recorder.last()
    assert [r.step for r in rec] == [0, 1, 2]
    assert pages == 8 and payload == 5136
    # The known number, per step: every page of every shard is written out (and, from
    # step 1 on, read in) exactly once by the update; moves seen independently through the
    # pool's I/O completions, split at each boundary's wall time.
    moves = runtime.page_moves.last()
    bounds = [0.0] + [r.wall_time for r in rec]
    for k, r in enumerate(rec):
        mine = [m for m in moves if bounds[k] < m["wall_time"] <= bounds[k + 1]]
        written = {(m["tensor"], m["page"]): m["bytes"] for m in mine if m["direction"] == "h2n"}
        read = {(m["tensor"], m["page"]): m["bytes"] for m in mine if m["direction"] == "n2h"}
        assert len(written) == pages and sum(written.values()) == payload
        assert r.pages["h2n_pages"] >= pages and r.pages["h2n_bytes"] >= payload
        if k:
            assert len(read) == pages and sum(read.values()) == payload
        assert r.pages["d2h_pages"] == 0 and r.pages["h2d_pages"] == 0
    # Exactly: the counters of all records plus the moves after the last boundary equal
    # every completed move. (A repeat is a stale read-ahead of the first sub-group landing
    # after its write-behind, the same page moved again; reported, not miscounted.)
    time.sleep(0.5)  # let any read-ahead still in flight complete
    tail = store.step_boundary(99)
    for d in ("h2n", "n2h"):
        seen = [m for m in runtime.page_moves.last() if m["direction"] == d]
        assert sum(r.pages[f"{d}_pages"] for r in rec) + getattr(tail, f"{d}_pages") == len(seen)
        assert sum(r.pages[f"{d}_bytes"] for r in rec) + getattr(tail, f"{d}_bytes") == sum(
            m["bytes"] for m in seen
        )
    for r in rec[1:]:
        # Runtime-driven intervals: NVMe I/O (comm) against the host update (compute).
        assert r.timing["comm_seconds"] > 0
        assert 0.0 <= r.timing["overlap_ratio"] <= 1.0
    # Tier bytes equal the pool's own accounting (whole pages).
    usage = store.pool.usage()
    last = rec[-1]
    assert last.tiers["nvme"].used_bytes == usage["nvme"].bytes_by_kind["optimizer"]
    assert last.tiers["nvme"].used_bytes == pages * PAGE
    assert last.tiers["host"].optimizer_bytes == usage["host"].bytes_by_kind.get("optimizer", 0)
    # Collective bytes from the flat buffers: all-reduce of the padded flat gradient and
    # all-gather of the shard, per replica.
    padded = sum(b.padded_size(2) for b in layout.buckets)
    assert last.collectives["all_reduce_bytes"] == 4 * padded * replicas
    assert last.collectives["all_gather_bytes"] == 4 * shard * replicas
    assert last.collectives["reduce_scatter_bytes"] == 0
    assert (last.stage, last.fallback_mirrored, last.config_version) == (1, False, 0)
    strategy.close()


def test_headline_scalars_sum_the_measured_directions_and_drop_nan():
    """Page-in = h2d + n2h, page-out = d2h + h2n (measured directions only), hit rate =
    hits / (hits + misses); not-measured figures are left out, not written as 0."""
    from tb_plugin import metadata

    nan = float("nan")
    got = metadata.headline_scalars(
        {"device": {"used_bytes": 3e6, "peak_bytes": 5e6}, "nvme": {"used_bytes": nan}},
        {
            "h2d_bytes": 4096.0,
            "n2h_bytes": 8192.0,
            "d2h_bytes": 1024.0,
            "h2n_bytes": nan,
            "prefetch_hits": 3.0,
            "prefetch_misses": 1.0,
            "stall_seconds": 0.25,
        },
        {"step_seconds": 0.5, "overlap_ratio": nan, "stall_seconds": 0.25},
    )
    assert got == {
        "zero/device/used_bytes": 3e6,
        "zero/device/peak_bytes": 5e6,
        "zero/pages/in_bytes": 12288.0,
        "zero/pages/out_bytes": 1024.0,
        "zero/pages/prefetch_hit_rate": 0.75,
        "zero/timing/stall_seconds": 0.25,
        "zero/timing/step_seconds": 0.5,
    }
    assert set(got) <= set(metadata.SCALAR_TAGS)
    none = metadata.headline_scalars({}, {"prefetch_hits": 0.0, "prefetch_misses": 0.0}, {})
    assert none == {}  # no prefetch at all: no hit rate


# -- BackgroundEmitter: batches off the step's path -----------------------------------------


def test_emitter_batches_without_waking_per_item_and_drain_writes_everything():
    """Items wait (no wake-up per submit) until ``max_delay`` or ``batch`` items; drain
    processes everything submitted before it, in order, then after_batch runs once per
    batch; close processes the rest."""
    seen: list[int] = []
    batches: list[int] = []
    emitter = BackgroundEmitter(
        seen.append, batch=1000, max_delay=30.0, after_batch=lambda: batches.append(len(seen))
    )
    for i in range(10):
        emitter.submit(i)
    time.sleep(0.2)
    assert seen == []  # not woken: fewer than `batch` items and well within max_delay
    emitter.drain()
    assert seen == list(range(10)) and batches == [10]
    for i in range(10, 13):
        emitter.submit(i)
    emitter.close()
    emitter.close()  # idempotent
    assert seen == list(range(13)) and batches == [10, 13]
    with pytest.raises(RuntimeError, match="closed"):
        emitter.submit(13)
    emitter.drain()  # a no-op after close


def test_emitter_wakes_at_batch_size_and_after_max_delay():
    seen: list[int] = []
    by_count = BackgroundEmitter(seen.append, batch=4, max_delay=30.0)
    for i in range(4):
        by_count.submit(i)
    deadline = time.monotonic() + 5.0
    while len(seen) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [0, 1, 2, 3]
    by_count.close()
    late: list[int] = []
    by_time = BackgroundEmitter(late.append, batch=1000, max_delay=0.1)
    by_time.submit(7)
    deadline = time.monotonic() + 5.0
    while not late and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late == [7]
    by_time.close()


def test_emitter_logs_a_failing_item_and_goes_on(caplog):
    def fn(item: int) -> None:
        if item == 1:
            raise ValueError("bad record")
        seen.append(item)

    seen: list[int] = []
    emitter = BackgroundEmitter(fn, batch=1, max_delay=1.0)
    for i in range(3):
        emitter.submit(i)
    emitter.close()
    assert seen == [0, 2]
    assert "writing a StepStats record failed" in caplog.text
    with pytest.raises(ValueError, match="batch=0"):
        BackgroundEmitter(fn, batch=0)
    with pytest.raises(ValueError, match="max_delay=0"):
        BackgroundEmitter(fn, max_delay=0)


# -- Accounting: per-step figures that change only with the optimizers --------------------


def test_accounting_recomputes_collectives_and_placement_rows_only_when_inputs_change():
    """The collective bytes and the stage 0-2 placement rows are cached between records and
    computed again when an input changes (a stage-2 group falling back to all-reduce, the
    offload ratio); callers get copies unless they ask for the shared rows."""
    from types import SimpleNamespace

    from zero_runtime.optim.layout import FlatLayout
    from zero_runtime.runtime.accounting import Accounting
    from zero_runtime.telemetry import collective_bytes

    n = 2
    layout = FlatLayout.from_variables(
        [SimpleNamespace(shape=(10,), path="a"), SimpleNamespace(shape=(3, 4), path="b")], n
    )
    group = SimpleNamespace(impl_used="all_to_all")
    zs = SimpleNamespace(
        layout=layout,
        stage=2,
        group=group,
        accumulation_steps=1,
        config=SimpleNamespace(offload_optimizer_ratio=1.0),
    )
    accounting = Accounting(SimpleNamespace(devices=["/cpu:0", "/cpu:1"]))
    accounting.add_optimizer(SimpleNamespace(zero_state=zs))
    first = accounting.collectives()
    assert first == collective_bytes(zs, n) and first["reduce_scatter_calls"] == float(n)
    first["reduce_scatter_calls"] = -1.0  # a caller's copy
    assert accounting.collectives()["reduce_scatter_calls"] == float(n)
    group.impl_used = "all_reduce"  # the fallback: all-reduce from now on
    moved = accounting.collectives()
    assert (moved["all_reduce_calls"], moved["reduce_scatter_calls"]) == (float(n), 0.0)

    rows = accounting.placement("cpu")["variables"]
    assert [r["name"] for r in rows] == ["a", "b"]
    assert rows[1]["shard_bytes_per_replica"] == 4 * 6 and rows[0]["optimizer_tier"] == "host"
    rows[0]["name"] = "changed by a caller"
    shared = accounting.placement("cpu", copy=False)["variables"]
    assert shared[0]["name"] == "a"
    assert accounting.placement("cpu", copy=False)["variables"][0] is shared[0]
    assert accounting.placement("nvme", copy=False)["variables"][0]["optimizer_tier"] == "nvme"
    zs.config.offload_optimizer_ratio = 0.5
    assert accounting.placement("cpu")["variables"][0]["optimizer_host_fraction"] == 0.5


def test_proc_readings_equal_psutils():
    """The step's RSS and the budget check's available host memory, read with one pread of
    a /proc file kept open, are psutil's figures (read back to back: equal up to what
    the process or the machine allocated in between, 64 MiB)."""
    import psutil

    from zero_runtime.telemetry import probes

    slack = 64 * 2**20
    assert abs(probes._rss_bytes() - psutil.Process().memory_info().rss) < slack
    assert abs(probes.host_available_bytes() - psutil.virtual_memory().available) < slack
    assert probes._proc_fd("/proc/no-such-file") is None
