"""What-if before apply: the access trace and its replay.

- A pool's recorded steps, replayed through the same core with the configuration
  unchanged, reproduce the measured page moves, evictions, prefetch hits and misses,
  used and peak bytes exactly where the pool's moves are synchronous (device + host),
  also after a round trip through the trace's JSON form. With an NVMe tier the device
  moves and peak are exact and the NVMe moves within 25% (the prefetch thread races).
- The trace is bounded: a ring of ``TRACE_STEPS`` steps, events cut at ``max_events``.
- Replayed with a smaller device budget, the prediction equals a real pool run at that
  budget; a budget below what one step pins at once is predicted to run out of memory.
- A real stage-3 job writes its trace into the run directory; predicting its own budget
  from it is exact, and predicting a lower budget from a run at a high one matches a
  second real run at the lower budget.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from zero_runtime.memory import PagedBufferPool
from zero_runtime.memory.simulate import Proposal, ReplayError, _derive_request, predict, replay
from zero_runtime.memory.trace import TRACE_DIR, TRACE_STEPS, AccessTrace, StepTrace, read_steps

PAGE = 65536  # bytes per page
MOVES = ("d2h_pages", "h2d_pages", "h2n_pages", "n2h_pages", "evictions")
HITS = ("prefetch_hits", "prefetch_misses")


def _workload(
    pool: PagedBufferPool,
    steps: int,
    nvme: bool,
    prefetch_steps: int | None = None,
    settled_steps: int = 0,
) -> list:
    """Six 2-page shards; per step, six 3-page gathered buffers on the device, half of them
    kept to a second use (backward) while the others are freed at once; prefetch with NVMe.

    ``prefetch_steps``: only the first n steps ask for prefetch (None: all).
    ``settled_steps``: in the first n steps each prefetch request is waited for
    (``synchronize``) before the next operation, so the pages where those steps leave
    them do not depend on when the prefetch thread ran.
    """
    for i in range(6):
        pool.allocate(f"p{i}", (PAGE // 2,), np.float32, "param", "nvme" if nvme else "host")
    pool.set_access_order([f"p{i}" for i in range(6)])
    counters = []
    for s in range(steps):
        for i in range(6):
            if nvme and i + 1 < 6 and (prefetch_steps is None or s < prefetch_steps):
                pool.prefetch([f"p{i + 1}"])
                if s < settled_steps:
                    pool.synchronize()
            pool.allocate(f"g{i}", (3 * PAGE // 4,), np.float32, "param", "device")
            pool.write(f"g{i}", np.full(3 * PAGE // 4, s, np.float32))
            pool.acquire(f"p{i}", "host")
            pool.release(f"p{i}")
            if i % 2:
                pool.free(f"g{i}")
        for i in range(0, 6, 2):
            pool.acquire(f"g{i}", "device")
            pool.release(f"g{i}")
            pool.free(f"g{i}")
        pool.synchronize()
        counters.append(pool.step_boundary(s))
    return counters


def _run(device_pages: int, nvme_dir=None, steps: int = 5, **workload):
    """The workload traced in a pool of ``device_pages`` device pages (8 host pages and
    NVMe in ``nvme_dir``, or 30 host pages); ``workload``: :func:`_workload`'s options.
    Returns its per-step counters and its recorded steps (through their JSON form)."""
    host = 8 if nvme_dir else 30
    with PagedBufferPool(
        host_budget_bytes=host * PAGE,
        page_size_bytes=PAGE,
        device_budget_bytes=device_pages * PAGE,
        nvme_path=str(nvme_dir) if nvme_dir else None,
    ) as pool:
        pool.set_tracing(True)
        counters = _workload(pool, steps, nvme_dir is not None, **workload)
        trace = [StepTrace.from_json(json.loads(json.dumps(s.to_json()))) for s in pool.trace_steps]
    return counters, trace


@pytest.mark.parametrize("nvme", [False, True])
def test_replay_unchanged_reproduces_the_recorded_moves_exactly(tmp_path, nvme):
    counters, trace = _run(10, tmp_path if nvme else None)
    assert [s.step for s in trace] == [0, 1, 2, 3, 4]
    result = replay(trace[1:])  # from the state at the start of step 1
    assert result.oom is None and len(result.steps) == 4
    # With NVMe the prefetch thread races the acquires: whether a page-in it started is
    # done before the acquire, and so how often a page goes out and in again, is timing.
    exact = ("d2h_pages", "h2d_pages") if nvme else (*MOVES, *HITS)
    for figures, recorded, measured in zip(result.steps, trace[1:], counters[1:]):
        for field in exact:
            assert figures.counters[field] == getattr(measured, field), (figures.step, field)
        assert sum(figures.counters[f] for f in HITS) == sum(getattr(measured, f) for f in HITS)
        if not nvme:
            assert figures.used_bytes == recorded.measured["used_bytes"]
        # A page in flight holds a slot on both tiers until its I/O ends: host and NVMe
        # peaks depend on when that is.
        tiers = ("device",) if nvme else ("device", "host", "nvme")
        for tier in tiers:
            assert figures.peak_bytes[tier] == recorded.measured["peak_bytes"][tier]
    for field in ("h2n_pages", "n2h_pages"):
        replayed = sum(f.counters[field] for f in result.steps)
        assert replayed == pytest.approx(sum(getattr(m, field) for m in counters[1:]), rel=0.25)
    # The workload pages: gathered buffers spill to the host and come back, every step;
    # with NVMe the shards page in and out too.
    assert counters[-1].d2h_pages > 0 and counters[-1].h2d_pages > 0
    assert (counters[-1].n2h_pages > 0) == nvme


def test_a_smaller_budget_is_predicted_as_a_real_run_at_that_budget():
    _, trace = _run(10)
    real, _ = _run(6)
    predicted = replay(trace[1:], Proposal(device_slots=6))
    assert predicted.oom is None
    # Steady steps (after the first, whose shrink moves the excess down at apply).
    for figures, measured in zip(predicted.steps[1:], real[2:]):
        for field in MOVES:
            assert figures.counters[field] == getattr(measured, field), field
        assert figures.peak_bytes["device"] == 6 * PAGE
    assert predicted.steps[1].counters["d2h_pages"] > trace[2].measured["d2h_pages"]
    # Two gathered buffers of 3 pages are held at once at least: 5 pages cannot serve it.
    tight = replay(trace[1:], Proposal(device_slots=2))
    assert tight.oom is not None and tight.oom["op"] == "A" and "device" in tight.oom["message"]


def test_a_prefetch_request_is_rederived_for_a_new_size():
    # Two replicas' shards interleave in the access order: a request of replica 0 names
    # every other id; 1000 elements (4000 bytes of float32) each.
    order = [f"b{b}v{v}r{r}" for b in range(4) for v in range(2) for r in range(2)]
    sizes = dict.fromkeys(order, 4000)
    itemsize = dict.fromkeys(order, 4)
    request = ("b1v0r0", "b1v1r0")  # positions 4 and 6: stride 2
    grow = _derive_request(request, order, itemsize, sizes, 4000, 1)
    assert grow == ("b1v0r0", "b1v1r0", "b2v0r0", "b2v1r0")
    assert _derive_request(request, order, itemsize, sizes, 1999, 1) == ("b1v0r0",)
    assert _derive_request(request, order, itemsize, sizes, 0, 1) == ()
    assert _derive_request(request, order, itemsize, sizes, 10**9, 1)[-1] == "b3v1r0"
    # One id: the step's usual stride is used.
    assert _derive_request(("b2v0r1",), order, itemsize, sizes, 2000, 2) == ("b2v0r1", "b2v1r1")


def test_prefetch_off_is_predicted_as_a_run_without_prefetch(tmp_path):
    """With NVMe shards, dropping the recorded prefetch requests turns the pages they
    brought in early into misses, as the same run with prefetch turned off has.

    The prediction starts from the recorded state at step 1, so the real run turns
    prefetch off at step 1 from that same state: step 0 (prefetch on) waits for each
    prefetch in both runs. Left to the prefetch thread's timing, step 0 leaves different
    shards on the host from run to run (besides p0 and p1: p4, p5, both or neither),
    and from each of those states the run without prefetch reads a different number of
    pages from NVMe in steps 1-4 (32, 24, 22, 28): under load the prediction was 22
    against a real run from scratch's 32.
    """
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, trace = _run(10, tmp_path / "a", settled_steps=1)
    _, real_trace = _run(10, tmp_path / "b", prefetch_steps=1, settled_steps=1)
    real = [s.measured for s in real_trace]
    assert real_trace[1].start == trace[1].start
    assert not any(code == "P" for s in real_trace[1:] for code, *_ in s.events)
    predicted = replay(trace[1:], Proposal(prefetch_elements=(PAGE // 4, 0)))
    kept = replay(trace[1:])

    def total(steps, field):
        return sum(f.counters[field] if hasattr(f, "counters") else f[field] for f in steps)

    assert total(predicted.steps, "prefetch_misses") > total(kept.steps, "prefetch_misses")
    # Without prefetch the real run's moves do not depend on its I/O threads' timing.
    for figures, measured in zip(predicted.steps, real[1:], strict=True):
        for field in (*MOVES, *HITS):
            assert figures.counters[field] == measured[field], (figures.step, field)
    assert total(predicted.steps, "n2h_pages") > 0


def test_a_pool_records_only_when_asked():
    with PagedBufferPool(host_budget_bytes=4 * PAGE, page_size_bytes=PAGE) as pool:
        pool.allocate("t", (PAGE // 4,), np.float32)
        pool.step_boundary(0)
        assert pool.trace_steps == [] and pool.take_trace_steps() == []
        pool.set_tracing(True)  # between steps: the snapshot is step 1's start
        pool.write("t", np.ones(PAGE // 4, np.float32))
        pool.step_boundary(1)
        [step] = pool.take_trace_steps()
        assert step.step == 1 and step.events == [("W", "t")]
        assert step.start["tensors"][0][:5] == ["t", PAGE, 4, "other", "h"]


def test_the_trace_is_a_bounded_ring():
    trace = AccessTrace(PAGE, False, steps=3, max_events=5)
    start = {"tensors": [], "tick": 0, "order": [], "cursor": 0, "slots": {}}
    trace.begin(start)
    for step in range(5):
        for i in range(7):
            trace.add("W", f"t{i}")
        trace.close(step, {}, start)
    assert [s.step for s in trace.closed] == [2, 3, 4]
    assert all(len(s.events) == 5 and s.truncated for s in trace.closed)
    assert [s.step for s in trace.take_unwritten()] == [2, 3, 4]
    assert trace.take_unwritten() == []
    with pytest.raises(ReplayError, match="truncated"):
        replay(list(trace.closed))


def test_replay_refuses_what_it_cannot_replay():
    _, trace = _run(10, steps=3)
    with pytest.raises(ReplayError, match="no recorded steps"):
        replay([])
    with pytest.raises(ReplayError, match="not consecutive"):
        replay([trace[0], trace[2]])
    with pytest.raises(ReplayError, match="below one page"):
        predict([s.to_json({"config": {}}) for s in trace], {}, {"device_budget_bytes": 100})
    with pytest.raises(ReplayError, match="no access trace"):
        predict([], {}, {"device_budget_bytes": 4 * PAGE})


def test_replayed_stall_uses_the_recorded_stall_per_miss_and_notes_explain(tmp_path):
    """The unchanged replay's stall is its misses x the recorded stall per miss
    (as every prediction's), not the simulator's own waits, so it is comparable with the
    recorded stall; prefetch off and a budget below a gather's need are explained."""
    _, trace = _run(10, tmp_path)
    records = [s.to_json({"config": {"prefetch_bucket_size": 10**6}}) for s in trace]
    answer = predict(records, {"prefetch_bucket_size": 10**6}, {"prefetch_bucket_size": 0})
    per_miss = answer["stall_seconds_per_miss"]
    assert per_miss is not None and per_miss > 0
    replayed = answer["replayed"]
    assert replayed["stall_seconds"] == pytest.approx(replayed["prefetch_misses"] * per_miss)
    assert answer["recorded"]["stall_seconds"] == pytest.approx(
        answer["recorded"]["prefetch_misses"] * per_miss
    )
    assert any(n.startswith("prefetch off still leaves prefetch hits") for n in answer["notes"])
    odd = predict(records, {}, {"device_budget_bytes": 4 * PAGE + 7})
    assert f"is used as {4 * PAGE} bytes" in " ".join(odd["notes"])
    assert any("the smallest budget this run can take" in n for n in odd["notes"])


# --- a real stage-3 job -------------------------------------------------------------------
STEPS = 8
#: The stage-3 job's device budgets: HIGH caches every row page of its table on the
#: device tier; LOW leaves room for about 11 of its 40, so rows page in and out.
HIGH, LOW = 4 << 20, 1 << 20
VOCAB, SEQ = 40_000, 16  # the row-paged table (40 row pages of 64 KiB) and ids per sample


def _stage3_job(run: str, budget: int) -> None:
    """A stage-3 job whose pool pages on the device tier: a row-paged 40 000 x 16
    embedding table and a Dense head, parameters on the device, ``budget`` the device
    budget (the pool's row cache is what it bounds: zero_runtime/stage3/device_plan.py)."""
    import keras
    import tensorflow as tf

    import zero_runtime

    config = {
        "stage": 3,
        "offload_param": "none",
        "offload_optimizer": "cpu",
        "page_size_bytes": PAGE,
        "device_budget_bytes": budget,
        "embedding_row_paging_threshold": 100_000,
        "collective_timeout_seconds": 30,
    }
    strategy = zero_runtime.ZeroInfinityStrategy(config, logdir=run)
    keras.utils.set_random_seed(2)
    with strategy.scope():
        model = strategy.shard_model(
            keras.Sequential(
                [
                    keras.Input((SEQ,), dtype="int32"),
                    keras.layers.Embedding(VOCAB, 16),
                    keras.layers.GlobalAveragePooling1D(),
                    keras.layers.Dense(10),
                ]
            )
        )
        model.compile(
            optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(STEPS * 16, SEQ)).astype("int32")  # [N, SEQ]
    y = rng.integers(0, 10, size=(STEPS * 16,)).astype("int32")  # [N]
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, verbose=0)
    model.close()
    strategy.close()


@pytest.mark.slow
def test_a_stage3_job_writes_its_trace_and_a_lower_budget_is_predicted(tmp_path):
    high_run, low_run = str(tmp_path / "high"), str(tmp_path / "low")
    _stage3_job(high_run, HIGH)
    _stage3_job(low_run, LOW)
    high = read_steps(f"{high_run}/{TRACE_DIR}")
    low = read_steps(f"{low_run}/{TRACE_DIR}")
    assert [r["step"] for r in high] == list(range(STEPS - TRACE_STEPS, STEPS))
    assert high[-1]["config"]["device_budget_bytes"] == HIGH
    same = predict(high, high[-1]["config"], {"device_budget_bytes": HIGH})
    assert same["replay_exact"] is True
    assert same["replayed"]["moves_per_step"] == same["recorded"]["moves_per_step"]
    assert same["predicted"]["steady"]["moves_per_step"] == same["recorded"]["moves_per_step"]
    lowered = predict(high, high[-1]["config"], {"device_budget_bytes": LOW})
    measured = predict(low, low[-1]["config"], {})["recorded"]
    predicted = lowered["predicted"]["steady"]
    print("predicted", predicted["moves_per_step"], "measured", measured["moves_per_step"])
    assert measured["moves_per_step"]["h2d"] > 0
    for d in ("d2h", "h2d"):
        assert predicted["moves_per_step"][d] == pytest.approx(
            measured["moves_per_step"][d], rel=0.2
        )
    assert predicted["peak_bytes"]["device"] <= LOW
    assert predicted["peak_bytes"]["device"] == measured["peak_bytes"]["device"]


def test_a_fork_is_recorded_and_replayed_with_the_same_moves(tmp_path):
    """``fork`` is traced (``K``: source id, new id; ids survive the JSON round trip)
    and the replay makes the same page moves: the source's read from NVMe and its
    clean hand-over, no write."""
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir(exist_ok=True)
    with PagedBufferPool(
        host_budget_bytes=4 * PAGE, page_size_bytes=PAGE, nvme_path=str(nvme_dir)
    ) as pool:
        pool.allocate("old", (PAGE // 2,), np.float32, kind="optimizer")  # 2 pages
        pool.write("old", np.ones(PAGE // 2, np.float32))
        pool.evict(["old"], "nvme")
        pool.step_boundary(0)
        pool.set_tracing(True)
        pool.step_boundary(1)
        assert pool.fork("old", "new")
        pool.write("new", np.zeros(PAGE // 2, np.float32))
        measured = pool.step_boundary(2)
        steps = [StepTrace.from_json(json.loads(json.dumps(s.to_json()))) for s in pool.trace_steps]
    [step] = [s for s in steps if s.step == 2]
    assert step.events[0] == ("K", "old", "new")
    [figures] = replay([step]).steps
    assert (measured.n2h_pages, measured.h2n_pages, measured.h2n_clean_pages) == (2, 0, 2)
    for field in ("n2h_pages", "h2n_pages", "h2n_clean_pages"):
        assert figures.counters[field] == getattr(measured, field), field
