"""``keras.applications`` families, softmax/sigmoid heads with probability losses, a
user's ``tf.GradientTape`` loop and the stage-3 parity measure over them.

Shared by ``tests/test_stage3_prob_heads.py`` (``fit``), ``tests/test_custom_loop_heads.py``
(the tape loop) and ``bench/bench_applications_parity.py`` (every family, both loops):

- :func:`application`: a family of :data:`FAMILIES`, untrained (``weights=None``),
  ``(B, 32, 32, 3)`` images in [0, 255) -> :data:`CLASSES` class probabilities (the
  family's default softmax head, a ``Dense`` with a softmax), seeded;
  :func:`image_data` its data.
- :func:`dense_head`: ``(B, 6) -> Dense(16, relu) -> Dense(units, activation)``
  probabilities; :func:`head_data` its data, scaled so that some probabilities saturate.
- :func:`tape_loop`: TensorFlow's custom-training-loop tutorial
  (https://www.tensorflow.org/tutorials/distribute/custom_training) with a probability
  loss (``from_logits=False``, Keras's default) on the model's softmax/sigmoid output.
- :func:`compare`: docs/parity.md's measure of a stage-3 run against MirroredStrategy's.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf
from keras.src.applications import convnext, efficientnet, resnet

from helpers import any_models as am

SIZE = 32  # images SIZE x SIZE x 3: the smallest ResNet, EfficientNet and ConvNeXt accept
CLASSES = 10
INPUT_SCALE = 20.0  # dense heads' inputs: logits reach tens, some probabilities saturate
REL = 1e-5  # stage 3: losses and weights, relative (docs/parity.md)
NO_GRAD_ABS = 1e-6  # stage 3: a weight Mirrored does not move, absolute


def _mobilenet_v2(shape: tuple) -> keras.Model:
    return keras.applications.MobileNetV2(
        weights=None, alpha=0.35, input_shape=shape, classes=CLASSES
    )


def _mobilenet_v3_small(shape: tuple) -> keras.Model:
    # not minimalistic: squeeze-and-excite, hard-swish, 5x5 depthwise; its Rescaling
    # preprocessing and the head's Dropout(0.2) as the defaults have them
    return keras.applications.MobileNetV3Small(
        weights=None, alpha=0.75, input_shape=shape, classes=CLASSES
    )


def _resnet50(shape: tuple) -> keras.Model:
    return keras.applications.ResNet50(weights=None, input_shape=shape, classes=CLASSES)


def _efficientnet_b0(shape: tuple) -> keras.Model:
    # Rescaling and Normalization (non-trainable mean/variance), squeeze-and-excite,
    # Dropout(0.2) on the head and drop-connect Dropouts (rates up to 0.2) in the blocks
    return keras.applications.EfficientNetB0(weights=None, input_shape=shape, classes=CLASSES)


def _convnext_tiny(shape: tuple) -> keras.Model:
    # LayerScale (a layer of its own owning gamma), LayerNormalization, 7x7 depthwise
    return keras.applications.ConvNeXtTiny(weights=None, input_shape=shape, classes=CLASSES)


def _resnet_small(shape: tuple) -> keras.Model:
    # ResNet50's code (keras.src.applications.resnet.ResNet: stem, bottleneck blocks with
    # a convolution shortcut and identity ones) with one stack of two blocks of 16 filters
    def stack(x):
        return resnet.stack_residual_blocks_v1(x, 16, 2, stride1=1, name="conv2")

    return resnet.ResNet(
        stack, False, True, weights=None, input_shape=shape, classes=CLASSES, name="resnet"
    )


def _efficientnet_small(shape: tuple) -> keras.Model:
    # EfficientNetB0's code (keras.src.applications.efficientnet.EfficientNet) at width
    # 0.25 and depth 0.5: every stage one block but stages 4-6 two, whose second ones
    # have the identity skip and its drop-connect Dropout (rates 0.08-0.16)
    return efficientnet.EfficientNet(
        0.25, 0.5, 224, weights=None, input_shape=shape, classes=CLASSES, name="efficientnet"
    )


def _convnext_small(shape: tuple) -> keras.Model:
    # ConvNeXtTiny's code (keras.src.applications.convnext.ConvNeXt) with one block per
    # stage, 16-128 channels; drop_path_rate 0 as in every exported ConvNeXt (a rate > 0
    # adds StochasticDepth layers, whose unseeded draw creates Keras's global seed
    # generator inside the traced step: refused by TensorFlow under MirroredStrategy too)
    return convnext.ConvNeXt(
        depths=[1, 1, 1, 1],
        projection_dims=[16, 32, 64, 128],
        weights=None,
        input_shape=shape,
        classes=CLASSES,
        name="convnext",
    )


#: name -> builder of ``(input shape) -> model``; parameters at 32x32, 10 classes. The
#: ``*_small`` ones are the family's own code (Keras's builder behind the exported
#: constructors) in a smaller configuration with the same kinds of layers: what a test
#: can afford on 2 cores (ResNet50 and ConvNeXtTiny take ~2-3 min per comparison there).
FAMILIES: dict[str, Callable[[tuple], keras.Model]] = {
    "mobilenet_v2": _mobilenet_v2,  # alpha 0.35: 0.41M
    "mobilenet_v3_small": _mobilenet_v3_small,  # alpha 0.75: 1.03M
    "efficientnet_b0": _efficientnet_b0,  # 4.0M
    "resnet50": _resnet50,  # 23.6M
    "convnext_tiny": _convnext_tiny,  # 27.8M
    "resnet_small": _resnet_small,
    "efficientnet_small": _efficientnet_small,
    "convnext_small": _convnext_small,
}


def application(name: str, seed: int = 5) -> keras.Model:
    """The family ``name`` of :data:`FAMILIES`, built after ``keras.utils.set_random_seed
    (seed)``: input ``float32 (B, 32, 32, 3)``, output ``float32 (B, 10)`` softmax
    probabilities.

    Raises:
        KeyError: ``name`` is not in :data:`FAMILIES`.
    """
    build = FAMILIES[name]
    keras.utils.set_random_seed(seed)
    return build((SIZE, SIZE, 3))


def image_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images ``float32 (n, 32, 32, 3)`` uniform in [0, 255) and labels ``int32
    (n,)`` in ``[0, 10)``, from ``np.random.RandomState(seed)``."""
    rng = np.random.RandomState(seed)
    x = rng.uniform(0.0, 255.0, (n, SIZE, SIZE, 3)).astype("float32")
    return x, rng.randint(0, CLASSES, (n,)).astype("int32")


def dense_head(activation: str, units: int) -> keras.Model:
    """``(B, 6) -> Dense(16, relu) -> Dense(units, activation)`` probabilities, built
    after ``keras.utils.set_random_seed(21)``."""
    keras.utils.set_random_seed(21)
    x = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    return keras.Model(x, keras.layers.Dense(units, activation=activation, name="head")(h))


def head_data(n: int, classes: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``n`` inputs ``float32 (n, 6)``, standard normal times :data:`INPUT_SCALE`; labels
    ``int32 (n,)`` in ``[0, classes)``, or ``float32 (n, 1)`` in {0, 1} with ``classes``
    None. From ``np.random.RandomState(22)``."""
    rng = np.random.RandomState(22)
    x = (INPUT_SCALE * rng.standard_normal((n, 6))).astype("float32")
    if classes is None:
        return x, rng.randint(0, 2, (n, 1)).astype("float32")
    return x, rng.randint(0, classes, (n,)).astype("int32")


@dataclasses.dataclass
class Run:
    """One training run: the variables' paths, their values before and after (float32
    arrays in ``model.weights`` order) and the loss of each step."""

    paths: list
    initial: list
    weights: list
    losses: list


def tape_loop(
    strategy: tf.distribute.Strategy,
    build: Callable[[], keras.Model],
    data: tuple[np.ndarray, np.ndarray],
    loss_object: keras.losses.Loss,
    batch: int = 8,
    learning_rate: float = 0.05,
) -> tuple[keras.Model, Run]:
    """The tutorial's loop under ``strategy``, one epoch over ``data`` in global batches
    of ``batch``, unshuffled: the model and ``keras.optimizers.SGD(learning_rate)`` built
    in ``strategy.scope()``, ``optimizer.build(model.trainable_variables)``, a
    ``tf.function`` running ``strategy.run(train_step)`` and summing the replicas' losses,
    ``train_step`` taking ``tape.gradient`` of ``tf.nn.compute_average_loss`` of
    ``loss_object`` (``reduction="none"``: per example) and applying it.

    Returns:
        The trained model and its :class:`Run` (``losses``: the global batch's mean loss).
    """
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(data).batch(batch)
    )
    with strategy.scope():
        model = build()
        initial = model.get_weights()
        optimizer = keras.optimizers.SGD(learning_rate)
        optimizer.build(model.trainable_variables)

    def train_step(inputs):
        x, y = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                loss_object(y, model(x, training=True)), global_batch_size=batch
            )
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def step(inputs):
        losses = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    losses = [float(step(inputs)) for inputs in dist]
    run = Run([v.path for v in model.weights], initial, model.get_weights(), losses)
    return model, run


@dataclasses.dataclass(frozen=True)
class Difference:
    """A run against its reference (:func:`compare`): the worst per-variable relative
    weight difference (``helpers.any_models.rel``) over the variables the reference moved
    by more than :data:`NO_GRAD_ABS`, and which variable; the worst absolute difference
    over the others (no gradient: rounding noise only); the worst relative loss
    difference over the steps."""

    weight_rel: float
    weight_rel_path: str | None
    no_grad_abs: float
    loss_rel: float

    def within_bounds(self) -> bool:
        """Stage 3's bounds of docs/parity.md: :data:`REL` and :data:`NO_GRAD_ABS`."""
        return self.weight_rel <= REL and self.no_grad_abs <= NO_GRAD_ABS and self.loss_rel <= REL


def assert_bitwise(run: Run, ref: Run) -> None:
    """Stages 1-2's parity: the same variables, losses and weights, bit for bit.

    Raises:
        AssertionError: naming the first variable that differs.
    """
    assert run.paths == ref.paths
    assert run.losses == ref.losses
    for path, w, r in zip(run.paths, run.weights, ref.weights):
        np.testing.assert_array_equal(w, r, err_msg=path)


def _weight_name(path: str) -> str:
    """The variable's own name in ``path``, without the counter Keras appends to a name
    it makes unique in the process (ConvNeXt's unnamed LayerScale weight is
    ``variable_4`` in a second model). The layers' names are left out: EfficientNet's
    ``normalization`` is ``normalization_1`` in a second model, and a reference may be
    the same layers in another container (``block/hidden`` for ``hidden``)."""
    return re.sub(r"_\d+$", "", path.rsplit("/", 1)[-1])


def compare(run: Run, ref: Run) -> Difference:
    """Measure ``run`` against ``ref`` (MirroredStrategy's, the same model and loop).

    Raises:
        AssertionError: the two runs do not hold the same variables (names, without
            Keras's counters, and shapes, in order) or not the same number of losses.
    """
    assert [_weight_name(p) for p in run.paths] == [_weight_name(p) for p in ref.paths]
    assert [w.shape for w in run.weights] == [r.shape for r in ref.weights]
    assert len(run.losses) == len(ref.losses) >= 1
    worst, worst_path, no_grad = 0.0, None, 0.0
    for path, w, r, r0 in zip(run.paths, run.weights, ref.weights, ref.initial):
        if np.max(np.abs(r - r0), initial=0.0) <= NO_GRAD_ABS:
            no_grad = max(no_grad, float(np.max(np.abs(w - r), initial=0.0)))
            continue
        d = am.rel(w, r)
        if d > worst or worst_path is None:
            worst, worst_path = d, path
    got, want = np.asarray(run.losses), np.asarray(ref.losses)
    loss_rel = float(np.max(np.abs(got - want) / np.abs(want)))
    return Difference(worst, worst_path, no_grad, loss_rel)


def fit_run(
    strategy: tf.distribute.Strategy,
    build: Callable[[], keras.Model],
    data: tuple[np.ndarray, np.ndarray],
    loss: str = "sparse_categorical_crossentropy",
    batch: int = 8,
    learning_rate: float = 0.05,
) -> tuple[keras.Model, Run]:
    """``model.fit`` under ``strategy``, one epoch over ``data`` in batches of ``batch``,
    unshuffled: the model built and compiled (``keras.optimizers.SGD(learning_rate)``,
    ``loss``) in ``strategy.scope()``.

    Returns:
        The trained model and its :class:`Run` (``losses``: Keras's running mean of the
        loss after each batch, as ``fit`` logs it).
    """
    with strategy.scope():
        model = build()
        initial = model.get_weights()
        model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss=loss)
    losses = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda _, logs: losses.append(float(logs["loss"]))
    )
    x, y = data
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    return model, Run([v.path for v in model.weights], initial, model.get_weights(), losses)
