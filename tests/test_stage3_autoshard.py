"""``ZeroConfig(stage=3)`` is enough: plain compile/fit shards the model.

A model created and compiled inside ``strategy.scope()`` is sharded by its first
``fit``/``train_on_batch``/``evaluate`` (zero_runtime/stage3/autoshard.py), and the
user's own object trains at stage 3: same losses and weights as the explicit
``strategy.shard_model`` and, within docs/parity.md's stage-3 bound, as MirroredStrategy
with Keras's Adam. A model stage 3 cannot run is refused before its first step, naming
the layer, with nothing changed; a custom ``tf.GradientTape`` loop gets a message naming
the supported form; frozen weights are counted on the device tier they sit on.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers.mirrored import Mirrored

import zero_runtime
import zero_runtime.optim
from zero_runtime.sharded_variable import ShardedVariable

BATCH = 8  # global batch
STEPS = 4
CONFIG = {
    "stage": 3,
    "offload_param": "cpu",
    "offload_optimizer": "cpu",
    "page_size_bytes": 65536,
    "persistence_threshold": 20,  # the 4-element bias persistent, the rest gathered
    "collective_timeout_seconds": 20,
}


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    x = rng.standard_normal((STEPS * BATCH, 8)).astype("float32")  # [32, 8]
    return x, (x[:, :4] * 2.0 - x[:, 4:]).astype("float32")  # [32, 4]


def _sequential() -> keras.Model:
    """Dense chain with a frozen middle layer (its 16x16 kernel + bias stay replicated)."""
    keras.utils.set_random_seed(1)
    frozen = keras.layers.Dense(16, activation="tanh", name="frozen")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="d0"),
            frozen,
            keras.layers.Dense(4, name="head"),
        ]
    )
    frozen.trainable = False
    return model


def _functional() -> keras.Model:
    keras.utils.set_random_seed(2)
    i = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="d0")(i)
    h = keras.layers.Dense(16, activation="relu", name="d1")(h)
    return keras.Model(i, keras.layers.Dense(4, name="head")(h))


def _fit(strategy, make_model, explicit: bool = False):
    with strategy.scope():
        model = make_model()
        trained = strategy.shard_model(model) if explicit else model
        trained.compile(optimizer="adam", loss="mse")
    x, y = _data()
    history = trained.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    return model, history.history["loss"]


def _rel(w: np.ndarray, r: np.ndarray) -> float:
    return float(np.max(np.abs(w - r)) / max(float(np.max(np.abs(r))), 1e-12))


@pytest.mark.parametrize("make_model", [_sequential, _functional], ids=["sequential", "functional"])
def test_plain_fit_at_stage3_runs_stage3_like_shard_model(make_model, cpu_devices):
    mirrored = Mirrored(cpu_devices)
    with mirrored.scope():
        ref = make_model()
        ref.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    x, y = _data()
    ref.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)

    explicit_strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    explicit, explicit_losses = _fit(explicit_strategy, make_model, explicit=True)
    explicit_weights = explicit.get_weights()
    explicit_strategy.close()

    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    model, losses = _fit(strategy, make_model)  # no shard_model: plain compile/fit
    try:
        # The user's own object was sharded in place and trained at stage 3.
        assert model.trainable_variables
        assert all(isinstance(v, ShardedVariable) for v in model.trainable_variables)
        assert model.optimizer.zero_state.stage == 3
        assert int(model.optimizer.iterations.numpy()) == STEPS
        rows = strategy.runtime.placement()["variables"]
        sharded = [r for r in rows if "(ZeRO-3)" in r["partitioning"]]
        assert len(sharded) == len(model.trainable_variables)
        assert not [r for r in rows if "ZeRO-1" in r["partitioning"]]
        assert not [r for r in rows if "ZeRO-2" in r["partitioning"]]
        last = strategy.runtime.recorder.last(1)[0]
        assert last.stage == 3 and not last.fallback_mirrored
        # evaluate/predict on the same object run the sharded forward.
        assert np.isfinite(model.evaluate(x, y, batch_size=BATCH, verbose=0))
        assert model.predict(x[:BATCH], batch_size=BATCH, verbose=0).shape == (BATCH, 4)
        weights = model.get_weights()
    finally:
        strategy.close()
    np.testing.assert_allclose(losses, explicit_losses, rtol=1e-6, atol=0)
    for w, e in zip(weights, explicit_weights):
        np.testing.assert_allclose(w, e, rtol=1e-6, atol=1e-7)
    worst = max(_rel(w, r) for w, r in zip(weights, ref.get_weights()))
    print(f"{make_model.__name__}: max |dw| / max |w| vs Mirrored {worst:.3g}")
    assert worst <= 1e-4  # docs/parity.md, stage 3


def test_frozen_weights_are_in_the_stage3_tier_record(cpu_devices):
    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    model, _ = _fit(strategy, _sequential)
    try:
        frozen = model.get_layer("frozen")
        frozen_bytes = 4 * (16 * 16 + 16)  # kernel + bias, float32, per replica
        rows = {r["name"]: r for r in strategy.runtime.placement()["variables"]}
        for v in frozen.weights:
            row = rows[v.path]
            assert row["partitioning"].startswith("frozen, replicated")
            assert row["param_tier"] == "device" and row["grad_tier"] == "none"
            assert row["shard_bytes_per_replica"] == row["bytes"] == 4 * int(np.prod(v.shape))
        engine_rec = strategy.runtime.accounting.stage3_engines[0].last_step
        device = strategy.runtime.recorder.last(1)[0].tiers["device"]
        pool_param = engine_rec.usage["device"].bytes_by_kind.get("param", 0)
        assert device.param_bytes == pool_param + frozen_bytes * len(cpu_devices)
    finally:
        strategy.close()


def _phases(strategy) -> tuple[list, list[np.ndarray]]:
    """The transfer-learning guide's phases: fit, freeze ``d0`` and recompile with a new
    optimizer, fit, unfreeze and recompile, fit. Returns (losses, weights)."""
    x, y = _data()
    losses = []
    with strategy.scope():
        model = _functional()
    for lr, frozen in ((1e-2, False), (1e-3, True), (1e-4, False)):
        with strategy.scope():
            model.get_layer("d0").trainable = not frozen
            model.compile(optimizer=keras.optimizers.Adam(lr), loss="mse")
        history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        losses += history.history["loss"]
    return losses, model.get_weights()


def test_freezing_and_unfreezing_between_phases_trains_like_mirrored(cpu_devices):
    """A layer frozen after stage-3 training (and unfrozen again), each phase recompiled
    with a new optimizer: the optimizer is planned over the trainable weights and the
    frozen layer keeps its weights, as under MirroredStrategy."""
    ref_losses, ref_weights = _phases(Mirrored(cpu_devices))
    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    try:
        losses, weights = _phases(strategy)
    finally:
        strategy.close()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max(_rel(w, r) for w, r in zip(weights, ref_weights)) <= 1e-4  # docs/parity.md


def test_unfreezing_a_layer_frozen_when_sharded_is_refused_naming_the_fix():
    """A layer frozen when the model was sharded stays replicated; unfrozen later, the
    next fit is refused before its first step, naming shard_model before freezing."""
    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    x, y = _data()
    try:
        with strategy.scope():
            model = _sequential()  # "frozen" frozen at the first fit
            model.compile(optimizer="adam", loss="mse")
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        before = model.get_weights()
        with strategy.scope():
            model.get_layer("frozen").trainable = True
            model.compile(optimizer="adam", loss="mse")
        with pytest.raises(
            ValueError,
            match=r"frozen \(first: '[\w/]*frozen/kernel'\).*"
            r"strategy\.shard_model\(model\)",
        ):
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        for w, b in zip(model.get_weights(), before):
            np.testing.assert_array_equal(w, b)
    finally:
        strategy.close()


class NoisyDense(keras.layers.Layer):
    """Owns a kernel and draws dropout masks inside its own call (a unit stage 3 refuses:
    its recomputed forward in backward would draw other masks)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.drop = keras.layers.Dropout(0.5)

    def build(self, shape) -> None:
        self.kernel = self.add_weight(shape=(shape[-1], 4), name="kernel")

    def call(self, x, training=None):
        return self.drop(keras.ops.matmul(x, self.kernel), training=training)


def _noisy() -> keras.Model:
    i = keras.Input((8,))
    h = keras.layers.Dense(8, name="d0")(i)
    h = keras.layers.Add(name="residual_add")([i, h])  # a DAG: run by units
    return keras.Model(i, NoisyDense(name="noisy")(h))


def _gru_dropout() -> keras.Model:
    """A GRU with recurrent dropout in a DAG: its cell (the unit) draws masks in its call."""
    i = keras.Input((8,))
    h = keras.layers.GRU(4, recurrent_dropout=0.2, name="gru")(keras.layers.Reshape((2, 4))(i))
    return keras.Model(i, keras.layers.Add(name="residual_add")([h, keras.layers.Dense(4)(i)]))


def _float64() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, name="d0", dtype="float64"),
            keras.layers.Dense(4, name="head"),
        ]
    )


@pytest.mark.parametrize(
    ("make_model", "error", "match"),
    [
        (_noisy, NotImplementedError, "layer 'noisy' owns weights and draws random numbers"),
        (_gru_dropout, NotImplementedError, "layer 'gru_cell' owns weights and draws random"),
        (_float64, ValueError, r"float32 weights; '[\w/]*d0/kernel' of layer 'd0' is float64"),
    ],
    ids=["dropout_in_unit", "rnn_dropout", "float64"],
)
def test_unsupported_model_is_refused_before_the_first_step(make_model, error, match):
    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    try:
        with strategy.scope():
            model = make_model()
            model.compile(optimizer="adam", loss="mse")
        before = model.get_weights()
        x, y = _data()
        for _ in range(2):  # and again: never falls back to another stage
            with pytest.raises(error, match=match):
                model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        assert not any(isinstance(v, ShardedVariable) for v in model.weights)
        for w, b in zip(model.get_weights(), before):
            np.testing.assert_array_equal(w, b)
        assert int(model.optimizer.iterations.numpy()) == 0
        assert len(strategy.runtime.recorder) == 0  # no step ran
    finally:
        strategy.close()


def test_custom_loop_build_shards_the_model_and_both_loop_forms_train():
    """A custom loop's optimizer.build over the unsharded model shards that model (found
    from the calling frame); its own tf.GradientTape step and strategy.run(model.train_step)
    both train it at stage 3 (tests/test_custom_loop.py has the parity)."""
    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    x, y = _data()
    batch = (x[:BATCH], y[:BATCH])
    try:
        with strategy.scope():
            model = _functional()
            opt = keras.optimizers.Adam(1e-3)
            opt.build(model.trainable_variables)
        assert all(isinstance(v, ShardedVariable) for v in model.trainable_variables)
        model.compile(optimizer=opt, loss="mse")

        @tf.function
        def tape_step(x, y):
            def replica_fn(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(x, training=True) - y)) / 2
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            return strategy.run(replica_fn, args=(x, y))

        tape_step(*batch)
        assert int(opt.iterations.numpy()) == 1

        @tf.function
        def train_step_form(data):
            return strategy.run(model.train_step, args=(data,))

        logs = train_step_form(batch)
        assert np.isfinite(float(strategy.reduce("MEAN", logs["loss"], axis=None)))
        assert int(opt.iterations.numpy()) == 2
    finally:
        strategy.close()


def test_keras_optimizer_instance_at_stage3_is_partitioned():
    """keras.optimizers.Adam() built in the scope (as Keras-Hub's tasks compile
    themselves) becomes the partitioned Adam: fit trains at stage 3."""
    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    try:
        with strategy.scope():
            model = _functional()
            model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
        assert isinstance(model.optimizer, zero_runtime.optim.Adam)
        before = model.get_weights()
        x, y = _data()
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        assert all(isinstance(v, ShardedVariable) for v in model.trainable_variables)
        assert int(model.optimizer.iterations.numpy()) == len(x) // BATCH
        assert any(not np.array_equal(w, b) for w, b in zip(model.get_weights(), before))
    finally:
        strategy.close()
