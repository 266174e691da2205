"""Softmax and sigmoid heads trained with Keras's crossentropy, at stages 1-3 as under
MirroredStrategy.

Keras computes the crossentropy of a softmax (or sigmoid) output from its logits: its
activations keep them on the output tensor (``_keras_logits``, set by
``keras/src/activations/activations.py``), and ``_get_logits`` in
``keras/src/backend/tensorflow/nn.py`` reads them there, or from the output's op when it
is the ``Softmax``/``Sigmoid`` itself; otherwise it falls back to the probabilities
clipped to ``[1e-7, 1 - 1e-7]``, whose loss and gradient differ once a probability
saturates (a clipped one has no gradient at all). At stage 3 a unit's output is the
``IdentityN`` of its use's ``tf.custom_gradient`` (:mod:`zero_runtime.stage3.gather`),
which had neither: ``keras.applications.MobileNetV2``, whose head is a ``Dense`` with a
softmax, trained differently from Mirrored (its second step's loss already differed).
A use now returns the logits as outputs too and sets ``_keras_logits`` on its outputs
again (:func:`zero_runtime.stage3.gather.keras_logits_positions`).

- :func:`test_heads_train_like_mirrored`: a ``Dense`` softmax head with
  ``sparse_categorical_crossentropy`` and a ``Dense`` sigmoid head with
  ``binary_crossentropy``, 20 samples in batches of 8, 8 and 4, SGD; inputs scaled
  (``helpers.applications.INPUT_SCALE``) so that some probabilities saturate. Stages 1
  and 2: bitwise equal to Mirrored; stage 3: within :data:`REL` (bitwise equal,
  measured). With the clipped
  fallback, stage 3's first loss was 12.4 against Mirrored's 20.4 (softmax) and 6.29
  against 6.66 (sigmoid), and its weights 1.41 and 0.64 apart in the relative measure
  below.
- :func:`test_applications_train_like_mirrored`: ``keras.applications`` families at stage
  3 (``weights=None``, 32x32 inputs, 10 classes, the default softmax head, a ``Dense``
  with a softmax; ``helpers.applications``), the same 12 images each (batches of 8 and
  4): ``MobileNetV2`` (alpha 0.35, 0.41M parameters), and ResNet, EfficientNet and
  ConvNeXt through the builders behind Keras's ``ResNet50``, ``EfficientNetB0`` and
  ``ConvNeXtTiny`` in small configurations with the same kinds of layers:
  ``resnet_small`` (24k: the stem, a bottleneck block with a convolution shortcut and an
  identity one), ``efficientnet_small`` (0.21M: Rescaling, Normalization with its
  non-trainable statistics, squeeze-and-excite, drop-connect Dropouts of rate 0.08-0.16
  and the head's Dropout(0.2), drawing their masks as under Mirrored) and
  ``convnext_small`` (0.23M: LayerScale, LayerNormalization, 7x7 depthwise convolutions,
  the downsampling Sequentials). Within :data:`REL` (bitwise equal, measured); with the
  clipped fallback MobileNetV2's second loss was 3.01 against 3.20 and its weights up to
  5.9 apart, EfficientNetB0's 6.53 against 7.03 and up to 4.4 apart. Each family's time
  is mostly its two traces (a step after the first takes < 1 s); measured on 2 cores
  shared at load ~4: MobileNetV2 141 s (36-44 s at load ~1), resnet_small 21 s,
  efficientnet_small 81 s, convnext_small 65-71 s. The families at full size
  (MobileNetV2, MobileNetV3Small, EfficientNetB0, ResNet50 at 23.6M parameters,
  ConvNeXtTiny at 27.8M), 20 steps, in ``fit`` and in a user's tape loop:
  ``bench/bench_applications_parity.py``, bitwise equal to Mirrored
  (``bench/results/applications_parity.json``; 2-7 min per comparison there).
- :func:`test_heads_train_like_mirrored_on_other_stage3_paths`: the other stage-3 forms
  whose outputs are ``tf.custom_gradient`` outputs, which keep the logits the same way:
  an int ``device_budget_bytes`` (the device plan; evaluate and predict of the softmax
  head too), an activation-checkpointed block (the softmax and sigmoid heads inside one
  layer) and a tiled ``Dense`` (a 4-column sigmoid head, ``tile_size`` 32; a softmax
  never tiles). Within :data:`REL` of Mirrored (bitwise equal, measured; tiled 1.3e-7
  apart), and the softmax head's evaluate and predict within :data:`REL` of stock Keras
  with the trained weights. Without the logits, the first loss was 12.4 against 20.4
  (softmax) and 6.29 against 6.66 (sigmoid) checkpointed, 4.66 against 5.02 tiled.

Measure: per-step losses (Keras's running mean, after each batch) within :data:`REL`
relative; per variable ``max |w - r| / max |r|`` (``helpers.any_models.rel``) within
:data:`REL`, or ``max |w - r|`` within :data:`NO_GRAD_ABS` for a variable Mirrored moved
by at most that much (a weight without gradient: only rounding noise moves it).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import keras
import numpy as np
import pytest
from helpers import applications as apps
from helpers.mirrored import Mirrored

import zero_runtime
from zero_runtime.sharded_variable import ShardedVariable

BATCH = 8  # global: 4 per replica on the tests' 2 replicas
SAMPLES = 20  # the small models': batches of 8, 8 and 4 (a smaller last batch)
IMAGES = 12  # the applications': batches of 8 and 4
LEARNING_RATE = 0.05
CONFIGS = {
    1: {"stage": 1, "offload_optimizer": "none"},
    2: {"stage": 2, "offload_optimizer": "cpu"},
    3: {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"},
}
#: stage 3: losses and weights, relative; a weight Mirrored does not move, absolute
REL, NO_GRAD_ABS = apps.REL, apps.NO_GRAD_ABS


class TrackedSoftmax(keras.layers.Layer):
    """A softmax head that owns its kernel and a moving mean of its logits (state the
    call updates, as BatchNormalization's): one unit whose use returns the probabilities,
    their logits and the state update. ``(B, D) -> (B, units)`` probabilities."""

    def __init__(self, units: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.units = units

    def build(self, shape) -> None:
        self.kernel = self.add_weight(shape=(shape[-1], self.units), name="kernel")
        self.mean = self.add_weight(
            shape=(self.units,), initializer="zeros", trainable=False, name="mean"
        )

    def call(self, x, training=False):
        logits = keras.ops.matmul(x, self.kernel)
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * keras.ops.mean(logits, axis=0))
        return keras.activations.softmax(logits)


def _tracked_head() -> keras.Model:
    """``(B, 6) -> Dense(16, relu) -> TrackedSoftmax(5)`` probabilities."""
    keras.utils.set_random_seed(23)
    x = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    return keras.Model(x, TrackedSoftmax(5, name="head")(h))


class HeadBlock(keras.layers.Layer):
    """``Dense(16, relu) -> Dense(units, activation)`` in one layer: the block
    ``activation_checkpointing`` recomputes (it holds the units; a ``Dense`` alone is a
    unit, no block). ``(B, 6) -> (B, units)`` probabilities."""

    def __init__(self, activation: str, units: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
        self.head = keras.layers.Dense(units, activation=activation, name="head")

    def call(self, x):
        return self.head(self.hidden(x))


def _block_head(activation: str, units: int) -> keras.Model:
    """``(B, 6) -> HeadBlock(activation, units)`` probabilities."""
    keras.utils.set_random_seed(21)
    x = keras.Input((6,))
    return keras.Model(x, HeadBlock(activation, units, name="block")(x))


def _multilabel_data() -> tuple[np.ndarray, np.ndarray]:
    """:data:`SAMPLES` inputs ``float32 (n, 6)``, labels ``float32 (n, 4)`` in {0, 1}."""
    x, _ = _head_data(None)
    return x, np.random.RandomState(24).randint(0, 2, (SAMPLES, 4)).astype("float32")


def _head_data(classes: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``helpers.applications.head_data``'s :data:`SAMPLES` inputs and labels."""
    return apps.head_data(SAMPLES, classes)


#: The families :func:`test_applications_train_like_mirrored` trains (module docstring;
#: ``helpers.applications.FAMILIES``).
APPLICATIONS = ("mobilenet_v2", "resnet_small", "efficientnet_small", "convnext_small")
SPARSE_CE, BINARY_CE = "sparse_categorical_crossentropy", "binary_crossentropy"
#: name: (build, data, loss)
MODELS = {
    "softmax": (functools.partial(apps.dense_head, "softmax", 5), lambda: _head_data(5), SPARSE_CE),
    "sigmoid": (
        functools.partial(apps.dense_head, "sigmoid", 1),
        lambda: _head_data(None),
        BINARY_CE,
    ),
    "tracked_softmax": (_tracked_head, lambda: _head_data(5), SPARSE_CE),
    # multi-label: 4 sigmoid columns, so that a tile_size can tile the head's kernel
    "sigmoid4": (functools.partial(apps.dense_head, "sigmoid", 4), _multilabel_data, BINARY_CE),
    "block_softmax": (
        functools.partial(_block_head, "softmax", 5),
        lambda: _head_data(5),
        SPARSE_CE,
    ),
    "block_sigmoid": (
        functools.partial(_block_head, "sigmoid", 1),
        lambda: _head_data(None),
        BINARY_CE,
    ),
    **{
        name: (
            functools.partial(apps.application, name),
            functools.partial(apps.image_data, IMAGES),
            SPARSE_CE,
        )
        for name in APPLICATIONS
    },
}


@dataclasses.dataclass
class Run:
    """One model trained for one epoch: its variables' paths, their values before and
    after (float32 arrays in ``model.weights`` order) and, after each batch, the loss and
    the same crossentropy as a metric (Keras computes both from the logits)."""

    paths: list
    initial: list
    weights: list
    losses: list
    #: the stage-3 engine's path, checkpointed blocks and tiled kernels (:func:`_zero_run`)
    engine: tuple = ()
    #: ``model.evaluate``'s ``[loss, crossentropy]`` and ``model.predict``'s
    #: probabilities after the fit, on the same data (:func:`_zero_run`, ``forward``)
    forward: tuple = ()


def _fit(strategy, name: str) -> tuple[keras.Model, Run]:
    """Build, compile (Keras's SGD, which a ZeroInfinityStrategy's scope partitions) and
    fit ``name`` for one epoch in batches of :data:`BATCH`, unshuffled."""
    build, data, loss = MODELS[name]
    with strategy.scope():
        model = build()
        initial = model.get_weights()
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate=LEARNING_RATE), loss=loss, metrics=[loss]
        )
    losses = []  # per batch: the loss, then the same crossentropy as a metric
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda _, logs: losses.extend([float(logs["loss"]), float(logs[loss])])
    )
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    return model, Run([v.path for v in model.weights], initial, model.get_weights(), losses)


@pytest.fixture(scope="module")
def reference(cpu_devices):
    """``reference(name) -> Run`` under plain MirroredStrategy, trained once per model."""

    @functools.cache
    def get(name: str) -> Run:
        model, run = _fit(Mirrored(cpu_devices), name)
        assert not any(isinstance(v, ShardedVariable) for v in model.weights)
        return run

    return get


def _zero_run(name: str, stage: int, extra: dict | None = None, forward: bool = False) -> Run:
    """Train ``name`` at ``stage`` (:data:`CONFIGS`, updated with ``extra``); check the
    stage it ran. At stage 3 ``run.engine`` is ``(checkpointed block names, tiled kernel
    paths)``; with ``forward`` the trained model's evaluate and predict on the
    fit's data are ``run.forward``."""
    strategy = zero_runtime.ZeroInfinityStrategy({**CONFIGS[stage], **(extra or {})})
    try:
        model, run = _fit(strategy, name)
        last = strategy.runtime.recorder.last(1)[0]
        assert last.stage == stage and not last.fallback_mirrored
        assert model.optimizer.zero_state.stage == stage
        if stage == 3:
            assert all(isinstance(v, ShardedVariable) for v in model.trainable_variables)
            (engine,) = strategy.runtime.accounting.stage3_engines
            blocks = [b.layer.name for b in engine.units.blocks]
            tiled = sorted(p.kernel.path for p in engine.tile_plans.values())
            run.engine = (blocks, tiled)
        if forward:
            x, y = MODELS[name][1]()
            run.forward = (
                model.evaluate(x, y, batch_size=BATCH, verbose=0),
                model.predict(x, batch_size=BATCH, verbose=0),
            )
        return run
    finally:
        strategy.close()


def _assert_close(run: Run, ref: Run) -> float:
    """Assert stage 3's tolerances (module docstring; ``helpers.applications.compare``);
    return the worst relative weight difference."""
    assert len(run.losses) == len(ref.losses) >= 2
    diff = apps.compare(run, ref)
    assert diff.within_bounds(), diff
    return diff.weight_rel


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", ["softmax", "sigmoid", "tracked_softmax"])
def test_heads_train_like_mirrored(name, stage, reference):
    ref = reference(name)
    run = _zero_run(name, stage)
    if stage < 3:
        apps.assert_bitwise(run, ref)
        return
    print(f"{name}: losses {run.losses}, worst weight {_assert_close(run, ref):.3g}")


@pytest.mark.slow
@pytest.mark.parametrize("name", APPLICATIONS)
def test_applications_train_like_mirrored(name, reference):
    """A ``keras.applications`` family at stage 3, the Mirrored reference included in
    the time (module docstring)."""
    start = time.perf_counter()
    ref = reference(name)
    run = _zero_run(name, 3)
    worst = _assert_close(run, ref)
    print(
        f"{name}: losses {run.losses} vs {ref.losses}, worst weight {worst:.3g}, "
        f"{time.perf_counter() - start:.0f} s"
    )


def _stock_forward(name: str, weights: list) -> tuple:
    """Stock Keras (no strategy) ``name`` with ``weights``: ``(evaluate's [loss,
    crossentropy], predict's probabilities)`` on its fit data, in batches of
    :data:`BATCH`; the crossentropy from the logits."""
    build, data, loss = MODELS[name]
    model = build()
    model.set_weights(weights)
    model.compile(loss=loss, metrics=[loss])
    x, y = data()
    return (
        model.evaluate(x, y, batch_size=BATCH, verbose=0),
        model.predict(x, batch_size=BATCH, verbose=0),
    )


#: The other stage-3 forms a softmax/sigmoid head runs in: name -> (config keys, models,
#: the expected ``Run.engine``). An int ``device_budget_bytes`` (the device plan);
#: activation checkpointing (a block holding both ``Dense`` units); tiling (``tile_size``
#: 32 elements: the head's 16x4 kernel runs as two tiles of 2 columns, the hidden 6x16
#: one as four; a softmax never tiles, the softmax mixing the columns).
PATHS = {
    "budget": ({"device_budget_bytes": 8 << 20}, ("softmax",), ([], [])),
    "checkpointed": (
        {"activation_checkpointing": True},
        ("block_softmax", "block_sigmoid"),
        (["block"], []),
    ),
    "tiled": ({"tile_size": 32}, ("sigmoid4",), ([], ["head/kernel", "hidden/kernel"])),
}
#: A model whose Mirrored reference is another's: the same layers and initial weights
#: (the same seed and build order), in one block.
SAME_AS = {"block_softmax": "softmax", "block_sigmoid": "sigmoid"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "name"), [(path, name) for path, (_, names, _) in PATHS.items() for name in names]
)
def test_heads_train_like_mirrored_on_other_stage3_paths(path, name, reference):
    """Stage 3 under an int device budget, with activation checkpointing and tiled:
    within :data:`REL` of Mirrored; the softmax head under the budget also evaluate (loss
    and crossentropy metric) and predict within :data:`REL` of stock Keras with the same
    weights (module docstring)."""
    extra, _, engine = PATHS[path]
    forward = (path, name) == ("budget", "softmax")
    run = _zero_run(name, 3, extra, forward=forward)
    assert run.engine == engine
    ref = reference(SAME_AS.get(name, name))
    for w, r in zip(run.initial, ref.initial):
        np.testing.assert_array_equal(w, r)
    worst = _assert_close(run, ref)
    print(f"{path} {name}: losses {run.losses}, worst weight {worst:.3g}")
    if forward:
        (evaluated, predicted), (want_eval, want_pred) = (
            run.forward,
            _stock_forward(name, run.weights),
        )
        print(f"  evaluate {evaluated} vs stock Keras {want_eval}")
        np.testing.assert_allclose(evaluated, want_eval, rtol=REL, atol=0.0)
        np.testing.assert_allclose(predicted, want_pred, rtol=REL, atol=1e-7)
