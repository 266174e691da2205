"""Stage 3 with parameters and optimizer states on the device.

The shards are per-replica TensorFlow variables read by the all-gather and assigned by the
update inside the step; the step boundary (runtime clock, pool step, collective deadline)
is kept in Python around Keras's ``train_function``
(zero_runtime/stage3/step_clock.py). The step's graph is inspected: the device-tier step
has no host callback, the host-tier step of the same model has them (the inspection can
see one). Parity with MirroredStrategy: tests/test_stage3_any_model.py (tier 'none').
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import zero_runtime

HOST_CALL_OPS = {"PyFunc", "PyFuncStateless", "EagerPyFunc"}  # numpy_function, py_function
BASE = {"stage": 3, "page_size_bytes": 65536, "collective_timeout_seconds": 30}
DEVICE = {**BASE, "offload_param": "none", "offload_optimizer": "none"}
HOST = {**BASE, "offload_param": "cpu", "offload_optimizer": "cpu"}
STEPS, BATCH = 3, 8


def _residual() -> keras.Model:
    """A DAG (not a chain, so it runs by units): embedding, Dense, residual Add, LayerNorm."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((4,), dtype="int32")
    h = keras.layers.Flatten()(keras.layers.Embedding(11, 8)(tokens))  # (B, 32)
    h = keras.layers.Add()([h, keras.layers.Dense(32, activation="relu")(h)])
    h = keras.layers.LayerNormalization()(h)
    return keras.Model(tokens, keras.layers.Dense(5)(h))


def _data():
    rng = np.random.RandomState(1)
    x = rng.randint(0, 11, (STEPS * BATCH, 4)).astype("int32")
    return x, rng.randint(0, 5, (STEPS * BATCH,)).astype("int32")


def _trained(config: dict, steps_per_execution: int = 1):
    strategy = zero_runtime.ZeroInfinityStrategy(config)
    with strategy.scope():
        model = _residual()
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    return strategy, model


def _tf_functions(fn, seen: set | None = None) -> list:
    """The ``tf.function`` objects reachable from ``fn`` through closures and wrappers
    (Keras's train function is a Python function around a ``tf.function``)."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    found = [fn] if isinstance(fn, tf.types.experimental.PolymorphicFunction) else []
    inner = [getattr(fn, "__wrapped__", None)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for f in inner:
        if callable(f):
            found += _tf_functions(f, seen)
    return found


def _step_op_types(model: keras.Model) -> dict[str, int]:
    """Op type -> count over every traced graph of the train function (its own nodes and
    its function library: custom gradients, while/cond bodies)."""
    counts: dict[str, int] = {}
    functions = _tf_functions(model.train_function)
    assert functions, "no tf.function found behind model.train_function"
    for f in functions:
        for concrete in f._list_all_concrete_functions():  # noqa: SLF001
            graph = concrete.graph.as_graph_def()
            nodes = list(graph.node) + [n for lib in graph.library.function for n in lib.node_def]
            for node in nodes:
                counts[node.op] = counts.get(node.op, 0) + 1
    return counts


@pytest.mark.slow
def test_device_tier_step_has_no_host_callback_and_the_host_tier_step_has(cpu_devices):
    host_ops = {}
    for name, config in (("device", DEVICE), ("host", HOST)):
        strategy, model = _trained(config)
        try:
            ops = _step_op_types(model)
        finally:
            strategy.close()
        assert ops.get("CollectiveGatherV2", 0) > 0, ops  # the step graph was inspected
        host_ops[name] = {k: v for k, v in ops.items() if k in HOST_CALL_OPS}
    assert host_ops["device"] == {}
    assert sum(host_ops["host"].values()) > 0


@pytest.mark.slow
def test_device_tier_steps_are_recorded_and_the_pool_accounts_the_shards(cpu_devices):
    strategy, model = _trained(DEVICE)
    try:
        engine = strategy.runtime.accounting.stage3_engines[-1]
        assert engine.clock.traced_outside  # the step was traced without host calls
        steps = [s.step for s in strategy.runtime.recorder.last(10)]
        assert steps == list(range(STEPS))  # the Python clock reported every step
        assert engine.last_step.step == STEPS - 1 and len(engine.device_peaks) == STEPS
        pool = engine.pool
        page = pool.page_size
        reserved = 0
        for v in engine.variables:
            for r in engine.local_replicas:
                info = pool.describe(v.shard_id(r))
                assert [p.tier for p in info.pages] == ["device"] * len(info.pages)
                assert v.device_shard(r).device.endswith(f"CPU:{r}")
                reserved += len(info.pages) * page
        assert pool.usage()["device"].used_bytes >= reserved
        with pytest.raises(ValueError, match="reservation"):
            pool.read(engine.variables[0].shard_id(0))
        # Outside a step the variables read and assign like Keras variables.
        weights = model.get_weights()
        changed = [w + 1.0 for w in weights]
        model.set_weights(changed)
        for got, want in zip(model.get_weights(), changed):
            np.testing.assert_array_equal(got, want)
        v = engine.variables[0]
        np.testing.assert_array_equal(
            np.concatenate([v.read_shard(r) for r in range(v.num_shards)]),
            np.concatenate([v.device_shard(r).numpy() for r in range(v.num_shards)]),
        )
    finally:
        strategy.close()


@pytest.mark.slow
def test_several_steps_per_call_and_train_on_batch_are_each_recorded(cpu_devices):
    """``steps_per_execution=2``: 3 batches run in 2 calls (2 + 1 steps); each optimizer
    step is reported after its call, then one more by ``train_on_batch``."""
    strategy, model = _trained(DEVICE, steps_per_execution=2)
    try:
        engine = strategy.runtime.accounting.stage3_engines[-1]
        assert engine.clock.traced_outside
        assert [s.step for s in strategy.runtime.recorder.last(10)] == list(range(STEPS))
        x, y = _data()
        model.train_on_batch(x[:BATCH], y[:BATCH])
        assert [s.step for s in strategy.runtime.recorder.last(10)] == list(range(STEPS + 1))
        assert engine.last_step.step == STEPS
    finally:
        strategy.close()
