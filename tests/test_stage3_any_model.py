"""Stage 3 on models that are not chains, through plain compile/fit.

``ZeroConfig(stage=3)`` alone, a model built and compiled inside ``strategy.scope()``,
``model.fit``: the runtime shards it and runs every layer that owns weights as a *unit*
(zero_runtime/stage3/units.py, gather.py). Each case trains one epoch and is compared
with plain ``MirroredStrategy`` (same model, data and seed) per variable, as
``max |Δw| / max |w|`` (docs/parity.md, stage 3: within 1e-4):

- ``gpt``: a GPT-style functional transformer (embedding, causal self-attention, MLP,
  residual ``Add``s, LayerNormalization) whose output head reads the embedding table
  (tied weights: gathered once per use, both uses' gradients summed); SGD (Adam: the
  matrix, where its attention key bias needs its own bound).
- ``dag_bn``: a functional DAG with two inputs, two outputs, residual connections, a
  BatchNormalization (moving statistics replicated and updated in the forward) and a
  frozen ``Dense`` (replicated, in the placement table as frozen); Adam.
- ``tied``: one ``Dense`` called twice, and a layer reading another layer's kernel (the
  kernel is sharded once, gathered per use, the uses' gradients summed); Adam.
- ``subclassed``: a subclassed ``keras.Model`` whose ``call`` adds a branch; Adam.
- ``holder``: a residual DAG whose layer owns a weight (a scale) and holds a ``Dense`` it
  calls: a unit holding another unit runs its own call, each read of its own weight a
  one-variable use (``Unit.hooked``); hooked, its use's ``tf.custom_gradient`` dropped the
  inner ``Dense``'s gradient (found on the demo GPT's ``TokenAndPositionEmbedding``); Adam.
- ``rnn``: a ``GRU`` (its cell, the unit, runs inside Keras's ``tf.while_loop`` over the
  time steps: gathered before the loop) beside a residual ``Dense``; Adam.
- ``embed_add``: an ``Embedding`` whose output feeds both a ``Dense`` and a residual
  ``Add``, fed 20 samples in batches of 8 (a partial last batch: unknown batch dimension,
  so the loss traces Keras's shape ``Assert``); SGD with host optimizer states. Chained
  after the first replica's host update, the ``Assert`` of the second replica would hang
  the first step until the collective timeout; two mechanisms keep it apart, either alone
  enough: the units path's trace-time replica barrier and
  ``zero_runtime.lifecycle.host_function``'s per-replica ordering resource. Also run
  fast, on its own, comparing the loss, with Adam
  (:func:`test_partial_batch_embedding_residual_trains_like_mirrored`).

``keras.applications.MobileNetV3Small``, the same GPT with Adam and a 3-D ``Dense`` model
with a smaller last batch are trained at every stage and tier in
``tests/test_parity_matrix.py``.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import any_models as am
from helpers.mirrored import Mirrored
from helpers.reference_optimizers import DenseGradAdam

import zero_runtime
from zero_runtime.sharded_variable import ShardedVariable

BATCH = am.BATCH
CONFIG = am.STAGE3_HOST_CONFIG
# Parameters and optimizer states on the device: shards are per-replica variables, the
# step has no host call (zero_runtime/stage3/step_clock.py).
DEVICE_CONFIG = {**CONFIG, "offload_param": "none", "offload_optimizer": "none"}
BOUND = 1e-4  # docs/parity.md, stage 3
_rel = am.rel


def _dag_bn() -> keras.Model:
    keras.utils.set_random_seed(1)
    a = keras.Input((8,), name="a")
    b = keras.Input((4,), name="b")
    h = keras.layers.Dense(16, name="da")(a)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Add()([h, keras.layers.Dense(16, name="db")(b)])
    frozen = keras.layers.Dense(16, activation="tanh", name="frozen")
    h = keras.layers.Add()([h, frozen(h)])  # residual through a frozen layer
    frozen.trainable = False
    h = keras.layers.Add()([h, keras.layers.Dense(16, activation="tanh", name="res")(h)])
    return keras.Model(
        [a, b], [keras.layers.Dense(4, name="y1")(h), keras.layers.Dense(1, name="y2")(h)]
    )


def _dag_bn_data():
    rng = np.random.RandomState(3)
    a = rng.standard_normal((4 * BATCH, 8)).astype("float32")
    b = rng.standard_normal((4 * BATCH, 4)).astype("float32")
    y1 = (a[:, :4] - 2.0 * b).astype("float32")
    y2 = a.sum(axis=1, keepdims=True).astype("float32")
    return [a, b], [y1, y2]


class Tied(keras.layers.Layer):
    """``h @ src.kernel^T``: reads another layer's kernel (a weight used by two layers)."""

    def __init__(self, src: keras.layers.Dense, **kwargs) -> None:
        super().__init__(**kwargs)
        self.src = src

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.src.kernel))


def _tied() -> keras.Model:
    keras.utils.set_random_seed(4)
    i = keras.Input((6,))
    d0 = keras.layers.Dense(8, name="d0")
    shared = keras.layers.Dense(8, activation="tanh", name="shared")
    h = shared(shared(d0(i)))  # one layer, two uses
    return keras.Model(i, Tied(d0, name="tied")(h))  # (B, 6)


def _tied_data():
    rng = np.random.RandomState(5)
    x = rng.standard_normal((4 * BATCH, 6)).astype("float32")
    return x, np.tanh(x[:, ::-1]).astype("float32")


class Sub(keras.Model):
    """A subclassed model: a residual branch in its own ``call``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.d0 = keras.layers.Dense(16, activation="relu", name="d0")
        self.d1 = keras.layers.Dense(16, activation="tanh", name="d1")
        self.out = keras.layers.Dense(4, name="out")

    def call(self, x):
        h = self.d0(x)
        return self.out(h + self.d1(h))


def _subclassed() -> keras.Model:
    keras.utils.set_random_seed(6)
    model = Sub(name="sub")
    model(np.zeros((1, 8), "float32"))  # creates the weights (build() does not)
    return model


def _subclassed_data():
    rng = np.random.RandomState(7)
    x = rng.standard_normal((4 * BATCH, 8)).astype("float32")
    return x, (x[:, :4] * 2.0 - x[:, 4:]).astype("float32")


class Holder(keras.layers.Layer):
    """``scale * inner(h)``: owns ``scale`` (8,) and holds the ``Dense`` it calls."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(8, activation="tanh", name="inner")

    def build(self, shape) -> None:
        self.inner.build(shape)
        self.scale = self.add_weight(shape=(8,), initializer="ones", name="scale")

    def call(self, h):
        return self.scale * self.inner(h)


class Nested(keras.layers.Layer):
    """A layer that owns a weight and reads another layer's kernel in its call, through a
    function (so the other layer is not one of its sublayers)."""

    def __init__(self, src: keras.layers.Dense, **kwargs) -> None:
        super().__init__(**kwargs)
        self.src = lambda: src  # not tracked: src is not a sublayer

    def build(self, shape) -> None:
        self.bias = self.add_weight(shape=(6,), initializer="zeros", name="bias")

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.src().kernel)) + self.bias


def _holder() -> keras.Model:
    keras.utils.set_random_seed(17)
    i = keras.Input((6,))
    h = keras.layers.Dense(8, name="d0")(i)
    h = keras.layers.Add()([h, Holder(name="holder")(h)])
    return keras.Model(i, keras.layers.Dense(6, name="out")(h))


def _rnn() -> keras.Model:
    """A GRU (its cell runs inside Keras's ``tf.while_loop`` over time steps; the cell
    owns a seed generator but no dropout) beside a residual ``Dense``, then pooling."""
    keras.utils.set_random_seed(15)
    i = keras.Input((None, 4))  # (B, T, 4), T unknown
    h = keras.layers.GRU(8, return_sequences=True, name="gru")(i)
    h = keras.layers.Add()([h, keras.layers.Dense(8, name="skip")(i)])
    pooled = keras.layers.GlobalAveragePooling1D()(h)  # (B, 8)
    return keras.Model(i, keras.layers.Dense(3, name="out")(pooled))


def _rnn_data():
    rng = np.random.RandomState(16)
    x = rng.standard_normal((4 * BATCH, 6, 4)).astype("float32")
    return x, np.tanh(x.sum(axis=1)[:, :3]).astype("float32")


class Branchy(keras.Model):
    """A subclassed model with control flow around its units: a ``keras.ops.fori_loop``
    applying ``c`` twice (a ``tf.while_loop``), then ``keras.ops.cond`` on the batch's
    mean, which differs between replicas within one step: one branch uses ``a``, the
    other ``b`` and ``a`` again."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.d0 = keras.layers.Dense(16, activation="relu", name="d0")
        self.c = keras.layers.Dense(16, activation="tanh", name="c")
        self.a = keras.layers.Dense(4, name="a")
        self.b = keras.layers.Dense(4, name="b")

    def build(self, shape) -> None:
        self.d0.build(shape)
        for layer in (self.c, self.a, self.b):
            layer.build((*shape[:-1], 16))

    def call(self, x):
        h = keras.ops.fori_loop(0, 2, lambda i, t: self.c(t), self.d0(x))
        return keras.ops.cond(
            keras.ops.mean(x) > 0.0, lambda: self.a(h), lambda: self.b(h) + 0.5 * self.a(h)
        )


def _branchy() -> keras.Model:
    keras.utils.set_random_seed(12)
    model = Branchy(name="branchy")
    model.build((None, 8))
    return model


def _branchy_data():
    """Rows shifted by +-0.3 so that the replicas' batch means (4 rows each) differ in
    sign within a step: 1, 0 | 1, 1 | 0, 1 | 0, 0 (mean > 0) over the 4 steps."""
    rng = np.random.RandomState(7)
    x = rng.standard_normal((4 * BATCH, 8)).astype("float32")
    x += 0.3 * rng.choice([-1.0, 1.0], (4 * BATCH, 1)).astype("float32")
    return x, (x[:, :4] * 2.0 - x[:, 4:]).astype("float32")


MODELS = {
    # name: (build, data, optimizer, loss)
    "gpt": (am.gpt, am.gpt_data, "sgd", "scce"),
    "dag_bn": (_dag_bn, _dag_bn_data, "adam", "mse"),
    "tied": (_tied, _tied_data, "adam", "mse"),
    "holder": (_holder, _tied_data, "adam", "mse"),
    "subclassed": (_subclassed, _subclassed_data, "adam", "mse"),
    "embed_add": (am.embed_add, am.embed_add_data, "sgd", "scce"),
    "branchy": (_branchy, _branchy_data, "adam", "mse"),
    "rnn": (_rnn, _rnn_data, "adam", "mse"),
}


def _loss(kind: str):
    if kind == "scce":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return "mse"


def _fit(
    strategy, name: str, before: list | None = None, losses: list | None = None, optimizer=None
) -> keras.Model:
    """Build, compile and train ``name`` for one epoch under ``strategy``; the initial
    weights are appended to ``before`` and the epoch's loss to ``losses`` if given;
    ``optimizer`` (a factory of an optimizer or its name) replaces the one in :data:`MODELS`."""
    build, data, opt, loss = MODELS[name]
    with strategy.scope():
        model = build()
        opt = keras.optimizers.get(optimizer() if optimizer is not None else opt)
        model.compile(optimizer=opt, loss=_loss(loss))
    if before is not None:
        before.extend(model.get_weights())
    x, y = data()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    if losses is not None:
        losses.extend(history.history["loss"])
    return model


@pytest.fixture(scope="module")
def reference(cpu_devices):
    """``{name: weights}`` after one epoch under plain MirroredStrategy (Keras optimizers)."""

    @functools.cache
    def get(name: str) -> list[np.ndarray]:
        initial: list[np.ndarray] = []
        model = _fit(Mirrored(cpu_devices), name, initial)
        assert not any(isinstance(v, ShardedVariable) for v in model.weights)
        assert initial and len(initial) == len(model.weights)
        assert max(_rel(w, i) for w, i in zip(model.get_weights(), initial)) > 1e-3  # trained
        return model.get_weights()

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "tier"),
    [(name, "cpu") for name in MODELS if name != "branchy"]  # branchy: its own test
    + [(name, "none") for name in ("gpt", "dag_bn", "tied", "embed_add", "rnn", "holder")],
)
def test_any_model_trains_at_stage3_like_mirrored(name, tier, reference):
    """``tier``: 'cpu' (parameters and states in the host pool) or 'none' (both on the
    device: shard variables, no host call in the step)."""
    strategy = zero_runtime.ZeroInfinityStrategy(DEVICE_CONFIG if tier == "none" else CONFIG)
    try:
        model = _fit(strategy, name)
        assert model.trainable_variables
        assert all(isinstance(v, ShardedVariable) for v in model.trainable_variables)
        assert model.optimizer.zero_state.stage == 3
        am.check_stage3_placement(strategy, model)  # ZeRO-3, frozen rows and bytes
        rows = strategy.runtime.placement()["variables"]
        last = strategy.runtime.recorder.last(1)[0]
        assert last.stage == 3 and not last.fallback_mirrored
        assert last.step == int(model.optimizer.iterations.numpy()) - 1  # every step recorded
        if tier == "none":  # the pool accounts the shard variables on the device tier
            tiers = {r["param_tier"] for r in rows if "(ZeRO-3)" in r["partitioning"]}
            assert tiers == {"device"}
        weights = model.get_weights()
        names = [v.path for v in model.weights]
    finally:
        strategy.close()
    worst = {n: _rel(w, r) for n, w, r in zip(names, weights, reference(name))}
    print(f"{name}: max |dw| / max |w| vs Mirrored {max(worst.values()):.3g}")
    assert max(worst.values()) <= BOUND, sorted(worst.items(), key=lambda kv: -kv[1])[:4]


def test_partial_batch_embedding_residual_trains_like_mirrored(cpu_devices):
    """An Embedding used twice (Dense and residual Add), a partial last batch, host Adam
    states (a first step that can hang until the collective timeout): it trains, and
    its loss and weights match MirroredStrategy's (whose Adam is given the densified
    embedding gradient: docs/parity.md, "Keras's Adam on a sparse gradient")."""
    ref_losses: list[float] = []
    mirrored = _fit(Mirrored(cpu_devices), "embed_add", losses=ref_losses, optimizer=DenseGradAdam)
    ref = mirrored.get_weights()
    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    losses: list[float] = []
    try:
        model = _fit(strategy, "embed_add", losses=losses, optimizer=lambda: "adam")
        assert all(isinstance(v, ShardedVariable) for v in model.trainable_variables)
        assert strategy.runtime.recorder.last(1)[0].stage == 3
        weights = model.get_weights()
    finally:
        strategy.close()
    assert len(losses) == len(ref_losses) == 1
    assert losses[0] == pytest.approx(ref_losses[0], rel=1e-5)
    assert max(_rel(w, r) for w, r in zip(weights, ref)) <= BOUND


def test_a_weight_read_inside_another_units_call_is_refused(cpu_devices):
    """A layer owning a weight whose call reads the kernel of a unit it does not hold as
    a sublayer would nest that read's use inside its own ``tf.custom_gradient`` (which
    drops the inner gradient): refused while the step is traced, naming both."""
    strategy = zero_runtime.ZeroInfinityStrategy(DEVICE_CONFIG)
    x, y = _tied_data()
    try:
        with strategy.scope():
            keras.utils.set_random_seed(4)
            i = keras.Input((6,))
            d0 = keras.layers.Dense(8, name="d0")
            model = keras.Model(i, Nested(d0, name="nested")(d0(i)))
            model.compile(optimizer="adam", loss="mse")
        with pytest.raises(NotImplementedError, match=r"'d0/kernel'.*'nested'"):
            model.train_on_batch(x[:BATCH], y[:BATCH])
    finally:
        strategy.close()


def test_custom_tape_over_a_units_model_gets_the_reduced_shards(cpu_devices):
    """A user's own tf.GradientTape over a model run by units (after fit sharded it):
    tape.gradient returns each variable's shard of the reduced gradient, float32
    [shard_elements] (the tied table's summed over its two uses), apply_gradients
    updates, and strategy.run(model.train_step) still trains it (tests/test_custom_loop.py
    has the parity with MirroredStrategy)."""
    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    x, y = _tied_data()
    batch = (x[:BATCH], y[:BATCH])
    try:
        with strategy.scope():
            model = _tied()
            model.compile(optimizer="adam", loss="mse")
        model.train_on_batch(*batch)  # sharded here
        assert all(isinstance(v, ShardedVariable) for v in model.trainable_variables)
        opt = model.optimizer

        @tf.function
        def tape_step(x, y):
            def replica_fn(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(x, training=True) - y)) / 2
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return [tf.reduce_sum(tf.abs(g)) for g in grads], [tf.size(g) for g in grads]

            return strategy.run(replica_fn, args=(x, y))

        norms, sizes = tape_step(*batch)
        local = strategy.experimental_local_results
        for v, n, k in zip(model.trainable_variables, norms, sizes):
            assert all(int(s) == v.shard_elements for s in local(k)), v.path
            assert all(np.isfinite(float(t)) for t in local(n)), v.path
        table = model.trainable_variables[0]  # the tied embedding table: read twice
        assert any(float(t) > 0 for t in local(norms[0])), table.path
        assert int(opt.iterations.numpy()) == 2

        @tf.function
        def train_step_form(data):
            return strategy.run(model.train_step, args=(data,))

        logs = train_step_form(batch)
        assert np.isfinite(float(strategy.reduce("MEAN", logs["loss"], axis=None)))
        assert int(opt.iterations.numpy()) == 3
    finally:
        strategy.close()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", ["dag_bn", "tied"])
def test_any_model_trains_at_stages_1_2_bitwise(name, stage, reference):
    """The same models at stages 1 and 2 (optimizer states on the host): bitwise."""
    strategy = zero_runtime.ZeroInfinityStrategy(
        {"stage": stage, "offload_optimizer": "cpu", "collective_timeout_seconds": 30}
    )
    try:
        model = _fit(strategy, name)
        assert model.optimizer.zero_state.stage == stage
        weights = model.get_weights()
    finally:
        strategy.close()
    for w, r in zip(weights, reference(name)):
        np.testing.assert_array_equal(w, r)


@pytest.mark.parametrize(
    "config",
    [CONFIG, DEVICE_CONFIG, {**CONFIG, "tile_size": 64}],
    ids=["host", "device", "tiled"],
)
def test_units_inside_tf_cond_and_a_loop_train_like_mirrored(config, reference):
    """Units used inside ``keras.ops.cond`` branches whose predicate differs between the
    replicas of a step, and inside a ``keras.ops.fori_loop``: gathered before the control
    flow, reduce-scattered after it; bitwise equal to MirroredStrategy (docs/parity.md),
    every unit trained; evaluate and predict run the same forward. Shards in host pages,
    in device variables, and with ``tile_size`` 64 (``d0``'s 8x16 kernel runs as tiles
    outside the control flow; the 16x16 ``c`` inside the loop runs untiled)."""
    x, y = _branchy_data()
    means = x.reshape(4, 2, BATCH // 2, 8).mean(axis=(2, 3))  # (step, replica)
    assert np.any((means[:, 0] > 0) != (means[:, 1] > 0))  # the replicas disagree
    strategy = zero_runtime.ZeroInfinityStrategy(config)
    try:
        model = _fit(strategy, "branchy")
        assert all(isinstance(v, ShardedVariable) for v in model.trainable_variables)
        assert strategy.runtime.recorder.last(1)[0].stage == 3
        if "tile_size" in config:
            (engine,) = strategy.runtime.accounting.stage3_engines
            tiled = {p.kernel.path for p in engine.tile_plans.values()}
            assert {"branchy/d0/kernel", "branchy/c/kernel"} <= tiled, tiled
        loss = model.evaluate(x, y, batch_size=BATCH, verbose=0)
        assert np.isfinite(loss)
        assert model.predict(x[:BATCH], batch_size=BATCH, verbose=0).shape == (BATCH, 4)
        weights = model.get_weights()
        paths = [v.path for v in model.weights]
    finally:
        strategy.close()
    initial = _branchy().get_weights()
    for path, w, r, i in zip(paths, weights, reference("branchy"), initial):
        np.testing.assert_array_equal(w, r, err_msg=path)
        assert np.max(np.abs(w - i)) > 1e-4, path  # every unit trained, b and c included


@pytest.mark.slow
def test_a_dag_built_inside_zero_init_trains_like_mirrored(reference):
    """The DAG with BatchNormalization built inside ``strategy.zero_init()`` (variables
    created deferred, straight into their shards) and compiled after it trains by units
    like MirroredStrategy."""
    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    try:
        with strategy.zero_init():
            model = _dag_bn()
        with strategy.scope():
            model.compile(optimizer=keras.optimizers.get("adam"), loss="mse")
        x, y = _dag_bn_data()
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        assert strategy.runtime.accounting.stage3_engines[0].runner is not None  # units
        weights = model.get_weights()
    finally:
        strategy.close()
    assert max(_rel(w, r) for w, r in zip(weights, reference("dag_bn"))) <= BOUND
