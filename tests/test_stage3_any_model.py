"""Stage 3 on models that are not chains, through plain compile/fit (issue #15, item 2).

``ZeroConfig(stage=3)`` alone, a model built and compiled inside ``strategy.scope()``,
``model.fit``: the runtime shards it and runs every layer that owns weights as a *unit*
(zero_runtime/stage3/units.py, gather.py). Each case trains one epoch and is compared
with plain ``MirroredStrategy`` (same model, data and seed) per variable, as
``max |Δw| / max |w|`` (docs/parity.md, stage 3: within 1e-4):

- ``gpt``: a GPT-style functional transformer (embedding, causal self-attention, MLP,
  residual ``Add``s, LayerNormalization) whose output head reads the embedding table
  (tied weights: gathered once per use, both uses' gradients summed); SGD.
- ``dag_bn``: a functional DAG with two inputs, two outputs, residual connections, a
  BatchNormalization (moving statistics replicated and updated in the forward) and a
  frozen ``Dense`` (replicated, in the placement table as frozen); Adam.
- ``tied``: one ``Dense`` called twice, and a layer reading another layer's kernel (the
  kernel is sharded once, gathered per use, the uses' gradients summed); Adam.
- ``subclassed``: a subclassed ``keras.Model`` whose ``call`` adds a branch; Adam.
- ``dense3d``: ``Dense`` on 3-D input, fed 20 samples in batches of 8 (the last one
  smaller: the batch dimension is unknown when the step is traced); Adam.
- ``embed_add``: an ``Embedding`` whose output feeds both a ``Dense`` and a residual
  ``Add``, fed 20 samples in batches of 8 (a partial last batch: unknown batch dimension,
  so the loss traces Keras's shape ``Assert``); SGD with host optimizer states. It hung
  in its first step until the collective timeout (issue #15): the ``Assert`` of the
  second replica was chained after the first replica's host update (fixed twice: the units
  path's trace-time replica barrier, and ``zero_runtime.lifecycle.host_function``'s
  per-replica ordering resource; either alone suffices). Also run fast, on its own, comparing the
  loss, with Adam (:func:`test_partial_batch_embedding_residual_trains_like_mirrored`).
- ``mobilenet``: ``keras.applications.MobileNetV3Small`` (``weights=None``, 32x32 input,
  4 classes, no dropout): convolutions, depthwise convolutions, squeeze-and-excitation
  ``Multiply`` branches, BatchNormalization everywhere; SGD.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers.mirrored import Mirrored
from helpers.reference_optimizers import DenseGradAdam

import zero_runtime
from zero_runtime.sharded_variable import ShardedVariable

VOCAB, WIDTH = 13, 16
BATCH = 8
CONFIG = {
    "stage": 3,
    "offload_param": "cpu",
    "offload_optimizer": "cpu",
    "page_size_bytes": 65536,
    "collective_timeout_seconds": 30,
}
# Parameters and optimizer states on the device: shards are per-replica variables, the
# step has no host call (zero_runtime/stage3/step_clock.py).
DEVICE_CONFIG = {**CONFIG, "offload_param": "none", "offload_optimizer": "none"}
BOUND = 1e-4  # docs/parity.md, stage 3
FLOOR = 1e-3  # smallest denominator of the relative difference (see _rel)


class TiedHead(keras.layers.Layer):
    """Logits from the embedding table: ``x @ E^T`` (the GPT-2 tied output head)."""

    def __init__(self, embedding: keras.layers.Embedding, **kwargs) -> None:
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))  # (B, T, V)


def _gpt() -> keras.Model:
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32")  # (B, T), T unknown
    emb = keras.layers.Embedding(VOCAB, WIDTH, name="tok")
    x = emb(tokens)  # (B, T, WIDTH)
    h = keras.layers.LayerNormalization(name="ln_a")(x)
    h = keras.layers.MultiHeadAttention(2, 8, name="attn")(h, h, use_causal_mask=True)
    x = keras.layers.Add()([x, h])
    h = keras.layers.LayerNormalization(name="ln_b")(x)
    h = keras.layers.Dense(2 * WIDTH, activation="gelu", name="mlp_a")(h)
    x = keras.layers.Add()([x, keras.layers.Dense(WIDTH, name="mlp_b")(h)])
    x = keras.layers.LayerNormalization(name="ln_f")(x)
    return keras.Model(tokens, TiedHead(emb, name="head")(x))


def _gpt_data():
    rng = np.random.RandomState(2)
    x = rng.randint(0, VOCAB, (4 * BATCH, 7)).astype("int32")
    return x[:, :-1], x[:, 1:]


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


def _dense3d() -> keras.Model:
    keras.utils.set_random_seed(8)
    inp = keras.Input((None, 8))
    h = keras.layers.Dense(16, activation="relu", name="hidden")(inp)
    return keras.Model(inp, keras.layers.Dense(4, name="head")(h))


def _dense3d_data():
    rng = np.random.RandomState(9)
    x = rng.standard_normal((20, 5, 8)).astype("float32")  # batches of 8, 8, 4
    return x, rng.randint(0, 4, (20, 5)).astype("int32")


def _embed_add() -> keras.Model:
    keras.utils.set_random_seed(13)
    tokens = keras.Input((8,), dtype="int32")  # (B, 8), B unknown
    x = keras.layers.Embedding(50, WIDTH, name="emb")(tokens)  # used twice below
    h = keras.layers.Dense(WIDTH, activation="relu", name="hidden")(x)
    x = keras.layers.Add()([x, h])
    return keras.Model(tokens, keras.layers.Dense(50, name="head")(x))


def _embed_add_data():
    rng = np.random.RandomState(14)
    x = rng.randint(0, 50, (20, 8)).astype("int32")  # batches of 8, 8, 4
    return x, rng.randint(0, 50, (20, 8)).astype("int32")


def _mobilenet() -> keras.Model:
    keras.utils.set_random_seed(10)
    return keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=4, dropout_rate=0.0
    )


def _image_data():
    rng = np.random.RandomState(11)
    x = rng.uniform(0.0, 255.0, (4 * BATCH, 32, 32, 3)).astype("float32")
    return x, rng.randint(0, 4, (4 * BATCH,)).astype("int32")


class Branchy(keras.Model):
    """A subclassed model whose call picks a head with ``keras.ops.cond`` on a replicated
    flag: the units path refuses a unit used inside a control-flow branch."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.d0 = keras.layers.Dense(16, activation="relu", name="d0")
        self.a = keras.layers.Dense(4, name="a")
        self.b = keras.layers.Dense(4, name="b")
        self.use_a = keras.Variable(1.0, trainable=False, name="use_a")

    def call(self, x):
        h = self.d0(x)
        return keras.ops.cond(self.use_a > 0.5, lambda: self.a(h), lambda: self.b(h))


def _branchy() -> keras.Model:
    keras.utils.set_random_seed(12)
    model = Branchy(name="branchy")
    model(np.zeros((1, 8), "float32"))  # creates the weights
    return model


MODELS = {
    # name: (build, data, optimizer, loss)
    "gpt": (_gpt, _gpt_data, "sgd", "scce"),
    "dag_bn": (_dag_bn, _dag_bn_data, "adam", "mse"),
    "tied": (_tied, _tied_data, "adam", "mse"),
    "subclassed": (_subclassed, _subclassed_data, "adam", "mse"),
    "dense3d": (_dense3d, _dense3d_data, "adam", "scce"),
    "embed_add": (_embed_add, _embed_add_data, "sgd", "scce"),
    "mobilenet": (_mobilenet, _image_data, "sgd", "scce_probs"),
}


def _loss(kind: str):
    if kind == "scce":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if kind == "scce_probs":  # keras.applications' heads end in a softmax
        return keras.losses.SparseCategoricalCrossentropy()
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


def _rel(w: np.ndarray, r: np.ndarray) -> float:
    """``max |w - r| / max |r|``; the denominator at least ``FLOOR`` (an attention key
    bias has no gradient, softmax being shift-invariant: it stays at rounding noise,
    |r| ~ 1e-9, where a ratio says nothing)."""
    return float(np.max(np.abs(w - r)) / max(float(np.max(np.abs(r))), FLOOR))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "tier"),
    [(name, "cpu") for name in MODELS]
    + [(name, "none") for name in ("gpt", "dag_bn", "tied", "embed_add")],
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
        rows = strategy.runtime.placement()["variables"]
        sharded = {r["name"] for r in rows if "(ZeRO-3)" in r["partitioning"]}
        assert sharded == {v.path for v in model.trainable_variables}
        frozen = {r["name"] for r in rows if r["partitioning"].startswith("frozen")}
        assert frozen == {v.path for v in model.weights if not v.trainable}
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
    """Issue #15: an Embedding used twice (Dense and residual Add), a partial last batch,
    host Adam states: the first step hung until the collective timeout. It trains, and
    its loss and weights match MirroredStrategy's (whose Adam is given the densified
    embedding gradient: docs/parity.md, a Keras defect the reference works around)."""
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


def test_custom_tape_over_a_units_model_names_the_supported_form(cpu_devices):
    """A user's own tf.GradientTape over a model run by units is refused while the step is
    traced, before any gather, naming strategy.run(model.train_step); that form trains."""
    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    x, y = _tied_data()
    batch = (x[:BATCH], y[:BATCH])
    try:
        with strategy.scope():
            model = _tied()
            model.compile(optimizer="adam", loss="mse")
        model.train_on_batch(*batch)  # sharded here
        assert all(isinstance(v, ShardedVariable) for v in model.trainable_variables)

        @tf.function
        def tape_step(x, y):
            def replica_fn(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
                return tape.gradient(loss, model.trainable_variables)

            return strategy.run(replica_fn, args=(x, y))

        with pytest.raises(RuntimeError, match=r"strategy\.run\(model\.train_step"):
            tape_step(*batch)

        @tf.function
        def supported_step(data):  # the documented form (docs/zero_stages.md)
            return strategy.run(model.train_step, args=(data,))

        logs = supported_step(batch)
        assert np.isfinite(float(strategy.reduce("MEAN", logs["loss"], axis=None)))
        assert int(model.optimizer.iterations.numpy()) == 2
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


def test_a_unit_inside_tf_cond_is_refused_before_the_first_step(cpu_devices):
    """A unit called in a ``keras.ops.cond`` branch: NotImplementedError naming it, raised
    while the step is traced; no step runs."""
    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    x, y = _subclassed_data()
    try:
        with strategy.scope():
            model = _branchy()
            model.compile(optimizer="adam", loss="mse")
        with pytest.raises(NotImplementedError, match=r"'a' is used inside a tf\.cond"):
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 0
        assert len(strategy.runtime.recorder) == 0
    finally:
        strategy.close()


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
