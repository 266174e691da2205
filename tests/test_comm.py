"""zero_runtime.comm: reduce-scatter (all-to-all and all-reduce paths), raw collectives,
bucketed reduction and collective groups, on the session's 2 logical CPU devices."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf
from helpers.mirrored import Mirrored

from zero_runtime import comm
from zero_runtime.optim.layout import FlatLayout
from zero_runtime.runtime.accounting import Accounting
from zero_runtime.telemetry.comm import collective_bytes

SHARD = 5


@pytest.fixture(scope="module")
def strategy(cpu_devices):
    return Mirrored(cpu_devices)


def _inputs(n: int) -> np.ndarray:
    return np.arange(n * n * SHARD, dtype=np.float32).reshape(n, n * SHARD) * 0.5 + 1.0


def _run(strategy, fn):
    """Run ``fn(replica_flat)`` on each replica inside a tf.function; per-replica numpy."""
    n = strategy.num_replicas_in_sync
    data = _inputs(n)

    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            flat = tf.gather(tf.constant(data), ctx.replica_id_in_sync_group)
            return fn(flat)

        return strategy.run(replica_fn)

    out = step()
    return [np.asarray(t) for t in strategy.experimental_local_results(out)], data


def _run_outputs(strategy, fn, data: np.ndarray) -> list[list[np.ndarray]]:
    """Run ``fn(replica's row of data)`` (a sequence of tensors) on each replica inside a
    tf.function; ``[output][replica]`` numpy arrays."""

    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            return fn(tf.gather(tf.constant(data), ctx.replica_id_in_sync_group))

        return strategy.run(replica_fn)

    return [[np.asarray(t) for t in strategy.experimental_local_results(x)] for x in step()]


@pytest.mark.parametrize("impl", ["all_to_all", "all_reduce"])
def test_reduce_scatter_gives_each_replica_its_summed_shard(strategy, impl):
    group = comm.CollectiveGroup.create(strategy.extended.worker_devices, impl)
    results, data = _run(strategy, lambda f: comm.reduce_scatter_sum_flat(f, group))
    total = data.sum(axis=0)  # (n * SHARD,)
    for r, shard in enumerate(results):
        assert shard.shape == (SHARD,)
        np.testing.assert_array_equal(shard, total[r * SHARD : (r + 1) * SHARD])


def test_reduce_scatter_without_group_is_all_reduce_and_slice(strategy):
    results, data = _run(strategy, lambda f: comm.reduce_scatter_sum_flat(f, None))
    total = data.sum(axis=0)
    np.testing.assert_array_equal(np.concatenate(results), total)


def test_raw_all_reduce_and_all_gather_match_the_strategy_ones(strategy):
    group = comm.CollectiveGroup.create(strategy.extended.worker_devices)

    def fn(flat):
        return (
            comm.all_reduce_sum_flat(flat, group),
            comm.all_reduce_sum_flat(flat),
            comm.all_gather_flat(flat[:SHARD], group),
            comm.all_gather_flat(flat[:SHARD]),
        )

    n = strategy.num_replicas_in_sync
    data = _inputs(n)
    raw_sum, sum_, raw_gather, gather = _run_outputs(strategy, fn, data)
    for r in range(n):
        np.testing.assert_array_equal(raw_sum[r], data.sum(axis=0))
        np.testing.assert_array_equal(raw_sum[r], sum_[r])
        np.testing.assert_array_equal(raw_gather[r], data[:, :SHARD].reshape(-1))
        np.testing.assert_array_equal(raw_gather[r], gather[r])


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("scatter", [True, False])
def test_reduce_buckets(strategy, overlap, scatter):
    group = comm.CollectiveGroup.create(strategy.extended.worker_devices)
    n = strategy.num_replicas_in_sync

    def fn(flat):  # two buckets of n*2 and n*3 elements
        a, b = flat[: 2 * n], flat[2 * n : 5 * n]
        return comm.reduce_buckets(
            [a, b], scatter=scatter, group=group, overlap=overlap, wait_for=[a, b]
        )

    n_elems = 5 * n
    data = _inputs(n)[:, :n_elems]
    assert data.shape[1] == n_elems

    pieces = _run_outputs(strategy, fn, data)
    total = data.sum(axis=0)
    for r in range(n):
        np.testing.assert_array_equal(pieces[0][r], total[: 2 * n][r * 2 : (r + 1) * 2])
        np.testing.assert_array_equal(pieces[1][r], total[2 * n :][r * 3 : (r + 1) * 3])


def test_reduce_scatter_of_unknown_length_falls_back_to_all_reduce_once(strategy, caplog):
    """A buffer whose length is unknown at trace time cannot be viewed as [n, shard] for
    the all-to-all: it is all-reduced and sliced, the group names the implementation used,
    and one warning is logged (both replicas trace it, and two buckets need it)."""
    group = comm.CollectiveGroup.create(strategy.extended.worker_devices, "all_to_all")
    n = strategy.num_replicas_in_sync

    def fn(flat):
        unknown = tf.boolean_mask(flat, flat > -1.0)  # every element, length None
        assert unknown.shape[0] is None
        return comm.reduce_buckets(
            [unknown, unknown[: 2 * n]], scatter=True, group=group, overlap=True
        )

    data = _inputs(n)

    caplog.set_level("WARNING", logger="zero_runtime.comm.collectives")
    pieces = _run_outputs(strategy, fn, data)
    total = data.sum(axis=0)
    for r in range(n):
        np.testing.assert_array_equal(pieces[0][r], total[r * SHARD : (r + 1) * SHARD])
        np.testing.assert_array_equal(pieces[1][r], total[: 2 * n][r * 2 : (r + 1) * 2])
    assert (group.reduce_scatter_impl, group.fallback_impl) == ("all_to_all", "all_reduce")
    assert group.impl_used == "all_reduce"
    layout = FlatLayout.from_variables([SimpleNamespace(shape=(10,), path="v")], n)
    zs = SimpleNamespace(layout=layout, stage=2, group=group, accumulation_steps=1)
    moved = collective_bytes(zs, n)  # the telemetry names the implementation used
    assert (moved["all_reduce_calls"], moved["reduce_scatter_calls"]) == (n, 0)
    accounting = Accounting(SimpleNamespace(devices=strategy.extended.worker_devices))
    accounting.add_optimizer(SimpleNamespace(zero_state=zs))
    assert accounting.reduce_scatter_impl() == "all_reduce"  # what run_info names
    warnings = [r for r in caplog.records if "cannot serve" in r.getMessage()]
    assert len(warnings) == 1 and "'all_to_all'" in warnings[0].getMessage()


def test_group_keys_and_instance_keys():
    g1 = comm.CollectiveGroup.create(["/cpu:0", "/cpu:1"])
    g2 = comm.CollectiveGroup.create(["/cpu:0", "/cpu:1"])
    assert g1.group_key != g2.group_key
    assert g1.reduce_scatter_impl == "all_to_all" and g1.group_size == 2
    # Each replica counts its own calls: the i-th call of every replica gets key i.
    assert [g1.next_instance_key(0) for _ in range(3)] == [1, 2, 3]
    assert [g1.next_instance_key(1) for _ in range(2)] == [1, 2]


def test_group_validation():
    with pytest.raises(ValueError, match="needs GPU devices"):
        comm.CollectiveGroup.create(["/cpu:0"], "nccl")
    with pytest.raises(ValueError, match="must be one of"):
        comm.CollectiveGroup.create(["/cpu:0"], "ring")
    with pytest.raises(ValueError, match="at least one device"):
        comm.CollectiveGroup.create([])
    with pytest.raises(ValueError, match="timeout_seconds"):
        comm.CollectiveGroup.create(["/cpu:0"], timeout_seconds=0)


def test_collectives_need_replica_context(strategy):
    with strategy.scope(), pytest.raises(RuntimeError, match="replica context"):
        comm.all_gather_flat(tf.zeros([2]))


def _num_threads() -> int:
    """OS threads of this process (Linux: the ``Threads:`` line of /proc/self/status)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


@pytest.mark.parametrize("impl", ["all_to_all", "all_reduce"])
def test_raw_collectives_start_no_thread_and_arm_one_deadline_each(strategy, impl):
    """TensorFlow's per-op timeout starts a sleeping OS thread per op and per parameter
    resolution (+2 per collective per replica, alive for the timeout); the raw
    collectives' ops have none, and the process's one watchdog thread holds the deadline."""
    group = comm.CollectiveGroup.create(strategy.extended.worker_devices, impl)
    n = strategy.num_replicas_in_sync
    data = _inputs(n)

    @tf.function
    def step(scale):
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            flat = tf.gather(tf.constant(data), ctx.replica_id_in_sync_group) * scale
            shard = comm.reduce_scatter_sum_flat(flat, group)
            return comm.all_gather_flat(shard, group)  # 2 raw collectives when all_to_all

        return strategy.run(replica_fn)

    step(tf.constant(1.0))  # trace, warm the pools (and start the watchdog thread)
    started, before = comm.WATCHDOG.deadlines_started, _num_threads()
    runs = 60
    for i in range(runs):
        out = step(tf.constant(float(i)))
    grown = _num_threads() - before
    raw = 2 if impl == "all_to_all" else 1  # the all_reduce path reduces with the strategy
    assert comm.WATCHDOG.deadlines_started - started == runs * n * raw  # none folded away
    assert comm.WATCHDOG.armed == 0  # each disarmed when its collective completed
    assert comm.WATCHDOG.fired is None
    assert grown <= 2, f"{grown} threads more after {runs} steps"  # was 2 * raw * n * runs
    got = np.concatenate([np.asarray(t) for t in strategy.experimental_local_results(out)])
    np.testing.assert_allclose(got, np.tile(data.sum(axis=0) * (runs - 1), n), rtol=1e-6)


def test_one_deadline_spans_a_replicas_collectives_with_two_callbacks(strategy):
    """``comm.one_deadline``: the reduce-scatter and the all-gather of one replica's step
    share one deadline (armed once per replica per run, not once per collective), it is
    disarmed when the last one completed, and the collectives' results are unchanged."""
    group = comm.CollectiveGroup.create(strategy.extended.worker_devices, "all_to_all")
    n = strategy.num_replicas_in_sync
    data = _inputs(n)

    @tf.function
    def step(scale):
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            rid = tf.get_static_value(ctx.replica_id_in_sync_group)
            with comm.one_deadline(group.token_variable(rid)):
                flat = tf.gather(tf.constant(data), ctx.replica_id_in_sync_group) * scale
                shard = comm.reduce_scatter_sum_flat(flat, group)
                return comm.all_gather_flat(shard, group)

        return strategy.run(replica_fn)

    step(tf.constant(1.0))  # trace
    graph_def = step.get_concrete_function(tf.constant(1.0)).graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    callbacks = [node.op for node in nodes if node.op == "EagerPyFunc"]
    assert len(callbacks) == 2 * n  # arm + disarm per replica (was 2 per collective)
    started = comm.WATCHDOG.deadlines_started
    runs = 20
    for i in range(runs):
        out = step(tf.constant(float(i)))
    assert comm.WATCHDOG.deadlines_started - started == runs * n  # one per replica step
    assert comm.WATCHDOG.armed == 0 and comm.WATCHDOG.fired is None
    got = np.concatenate([np.asarray(t) for t in strategy.experimental_local_results(out)])
    np.testing.assert_allclose(got, np.tile(data.sum(axis=0) * (runs - 1), n), rtol=1e-6)


def test_guarded_collectives_hand_their_intervals_to_listeners_per_device(strategy):
    """Each guarded collective's arm -> disarm reaches the interval
    listeners as (replica device, start, end) inside the step's wall time; a listener
    that is a bound method is held weakly."""
    group = comm.CollectiveGroup.create(strategy.extended.worker_devices, "all_to_all")
    n = strategy.num_replicas_in_sync
    data = _inputs(n)

    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            flat = tf.gather(tf.constant(data), ctx.replica_id_in_sync_group)
            return comm.reduce_scatter_sum_flat(flat, group)  # 1 raw collective

        return strategy.run(replica_fn)

    class Sink:
        def __init__(self):
            self.seen = []

        def record(self, lane, start, end):
            self.seen.append((lane, start, end))

    step()  # trace
    builds = comm.WATCHDOG.traced_builds
    sink = Sink()
    comm.WATCHDOG.add_interval_listener(sink.record)
    t0 = time.time()
    step()
    t1 = time.time()
    assert comm.WATCHDOG.traced_builds == builds  # no retrace, no new guarded builds
    lanes = sorted(lane for lane, _, _ in sink.seen)
    assert lanes == sorted(strategy.extended.worker_devices), lanes  # one per replica
    assert all(t0 <= s <= e <= t1 for _, s, e in sink.seen)
    del sink  # weakly held: no longer called, nothing to remove
    step()
    comm.WATCHDOG.remove_interval_listener(lambda *a: None)  # unknown: ignored


def test_watchdog_aborts_once_when_a_deadline_passes():
    """The watchdog's own thread: one deadline due calls ``abort`` once with a message
    naming the collective and the timeout; disarmed and replaced deadlines never fire."""
    calls: list[tuple[float, str]] = []
    start = time.monotonic()
    dog = comm.CollectiveWatchdog(abort=lambda msg: calls.append((time.monotonic(), msg)))
    assert dog.state is comm.WatchdogState.IDLE
    dog.arm("a", 0.3, "all_to_all (group 7, instance 1, replica 0)")
    dog.arm("b", 0.2, "done in time")
    dog.disarm("b")
    dog.arm("a", 0.6, "all_to_all (group 7, instance 2, replica 0)")  # the call site again
    assert dog.state is comm.WatchdogState.WATCHING and dog.armed == 1
    with dog.deadline(5.0, "eager broadcast"):
        assert dog.armed == 2
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # nothing else is due
    assert len(calls) == 1, calls
    when, message = calls[0]
    assert 0.55 <= when - start < 5.0
    assert message.startswith("zero_runtime: collective all_to_all (group 7, instance 2,")
    assert "within 0.6 s (collective_timeout_seconds)" in message
    assert dog.state is comm.WatchdogState.FIRED and dog.fired == message and dog.armed == 0
    with pytest.raises(ValueError, match="> 0 seconds"):
        dog.arm("c", 0, "x")


def test_watchdog_drops_stale_traced_deadlines_instead_of_aborting():
    """A traced collective whose step failed never disarms: its deadline is dropped when a
    later collective on the same ordering token is armed, when it falls due while no
    tf.function runs, or when it falls due after a collective armed later (on another
    token: another test's model) completed; it aborts only while a function runs and no
    later collective completes."""
    calls: list[str] = []
    running = [False]
    dog = comm.CollectiveWatchdog(abort=calls.append, executing=lambda: running[0])
    dog.arm("k1", 0.2, "first", scope=1, traced=True)
    dog.arm("k2", 5.0, "later on the same token", scope=1, traced=True)
    assert dog.armed == 1  # k1 superseded
    dog.disarm("k2")
    dog.arm("k3", 0.2, "failed step", scope=2, traced=True)
    deadline = time.monotonic() + 10
    while dog.stale_dropped == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dog.stale_dropped == 1 and dog.armed == 0 and calls == []
    running[0] = True
    dog.arm("k5", 0.2, "a failed step's, due while another step runs", scope=3, traced=True)
    dog.arm("k6", 5.0, "the other step's", scope=4, traced=True)
    dog.disarm("k6")  # armed after k5, completed: collectives progress past k5
    while dog.stale_dropped == 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dog.stale_dropped == 2 and dog.armed == 0 and calls == []
    dog.arm("k4", 0.2, "stalled", scope=2, traced=True)
    while not calls and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(calls) == 1 and "collective stalled did not complete within 0.2 s" in calls[0]
    assert dog.state is comm.WatchdogState.FIRED


def test_step_deadline_waits_out_tracing_and_aborts_a_stalled_execution():
    """A stage-3 step run from Python (zero_runtime/stage3/step_clock.py) has one deadline
    over the call: restarted while no tf.function executes (tracing), enforced while one
    does; inside it collectives are traced without their host callbacks."""
    calls: list[str] = []
    running = [False]
    dog = comm.CollectiveWatchdog(abort=calls.append, executing=lambda: running[0])
    assert not dog.covers_traces
    with dog.step_deadline(0.2, "the collectives of a step"):
        assert dog.covers_traces and dog.armed == 1
        time.sleep(0.6)  # "tracing": due three times, restarted each time
        assert calls == [] and dog.armed == 1 and dog.stale_dropped == 0
        running[0] = True  # executing, and stalled
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not dog.covers_traces and dog.armed == 0
    assert len(calls) == 1 and "the collectives of a step did not complete within 0.2 s" in calls[0]
    with dog.step_deadline(0.2, "a call that traces its step"):
        dog.traced_builds += 1  # what guard() counts for each collective it builds
        time.sleep(0.6)  # executing (eager ops run while tracing), yet not held to it
        assert len(calls) == 1 and dog.armed == 1
    with dog.step_deadline(0, "no deadline"):  # 0: nothing armed, still unguarded
        assert dog.covers_traces and dog.armed == 0


def test_a_failed_step_leaves_no_deadline_that_aborts_later(strategy):
    """A step that fails while replica 0 waits in a guarded all-to-all (replica 1's input
    fails) leaves that deadline armed; it is dropped as stale, and the next collectives
    work after the deadline has passed."""
    group = comm.CollectiveGroup.create(
        strategy.extended.worker_devices, "all_to_all", timeout_seconds=0.5
    )
    n = strategy.num_replicas_in_sync
    data = _inputs(n)

    def check(fail, replica):
        if fail and replica == 1:
            time.sleep(0.2)  # replica 0 is in the collective by now
            raise ValueError("replica 1 fails")
        return np.float32(1.0)

    @tf.function
    def step(fail):
        def replica_fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            ok = tf.ensure_shape(tf.numpy_function(check, [fail, rid], tf.float32), [])
            return comm.reduce_scatter_sum_flat(tf.gather(tf.constant(data), rid) * ok, group)

        return strategy.run(replica_fn)

    step(tf.constant(False))
    dropped = comm.WATCHDOG.stale_dropped
    with pytest.raises(tf.errors.InvalidArgumentError, match="replica 1 fails"):
        step(tf.constant(True))
    assert comm.WATCHDOG.armed == 1  # replica 0's all-to-all never disarmed
    time.sleep(1.5)  # its deadline passes with no step running
    assert comm.WATCHDOG.stale_dropped == dropped + 1 and comm.WATCHDOG.fired is None
    out = strategy.experimental_local_results(step(tf.constant(False)))
    np.testing.assert_array_equal(np.asarray(out[0]), data.sum(axis=0)[:SHARD])
