"""Keras's model-weight EMA (``use_ema``) as a partitioned optimizer state at stages 1-3
(zero_runtime/optim/ema.py) against MirroredStrategy with Keras's own EMA.

One small model (a biased ``Dense``, ``BatchNormalization`` with its trainable gamma and
beta, a ``Dense`` head; in the tape loop also an ``aux`` head the loss does not read, so
its variables get no gradient and only their averages move), 2 replicas, a global batch of
16, :data:`STEPS` steps of ``keras.optimizers.Adam(use_ema=True, ema_momentum=0.8)`` with
``ema_overwrite_frequency`` :data:`FREQ` or None, trained by ``fit`` (which calls
``finalize_variable_values`` at its end) and by a user's tape loop (which calls it
itself). The reference is MirroredStrategy with Keras's Adam; with a frequency its
overwrite runs in replica context (:func:`_replica_overwrite`: Keras 3.15's TensorFlow
backend assigns the averages through ``extended.update`` inside ``ops.cond``, a
``merge_call`` MirroredStrategy refuses there, so stock Keras cannot train with an
overwrite frequency under MirroredStrategy at all; the assignment itself is Keras's).

Measured: every stage (1, 2, 3), tier ('none', 'cpu'; 'nvme' at stages 2 and 3) and
frequency gives losses and final weights **bitwise** equal to the reference, by fit and by
the tape loop. Gradient accumulation (2 micro-batches of 8) against Keras on batches of
16: 1.8e-7, within :data:`ACCUM_BOUND` (the micro-batch gradients are summed in another
order). A checkpoint saved mid-run (``strategy.save_checkpoint``) restores the averages, and the
restored run's steps repeat the uninterrupted ones bitwise; ``model.save`` writes them in
Keras's layout, which plain Keras loads.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers.fit_losses import fit_losses
from helpers.mirrored import Mirrored
from keras.src.optimizers.base_optimizer import BaseOptimizer

import zero_runtime
from zero_runtime import ZeroConfig, estimator
from zero_runtime.optim.device_state import DeviceOptimizerState
from zero_runtime.optim.ema import EMA_SLOT
from zero_runtime.optim.host_state import HostOptimizerState
from zero_runtime.optim.nvme_state import NvmeOptimizerState
from zero_runtime.sharded_variable import ShardedVariable

pytestmark = pytest.mark.slow  # trains models (about 3 min on 2 cores for the file)

STEPS = 6
BATCH = 16  # global batch per optimizer step
MOMENTUM = 0.8
FREQ = 2  # ema_overwrite_frequency of the cases that overwrite
LR = 0.02
#: ``max |dw| / max |w|``, 2 micro-batches vs Keras on the double batch (measured 1.8e-7).
ACCUM_BOUND = 1e-6
STORE = {"none": DeviceOptimizerState, "cpu": HostOptimizerState, "nvme": NvmeOptimizerState}
TIER = {"none": "device", "cpu": "host", "nvme": "nvme"}  # the placement table's names


def _replica_overwrite(cls: type) -> type:
    """``cls`` (a stock Keras optimizer) whose ``ema_overwrite_frequency`` assignment also
    works in replica context: Keras's base implementation (``var.assign(average)`` on each
    replica's copy) there, the TensorFlow backend's in cross-replica context
    (``finalize_variable_values`` after ``fit``)."""

    class ReplicaOverwrite(cls):
        def _overwrite_model_variables_with_average_value(self, trainable_variables):
            if tf.distribute.in_cross_replica_context():
                return super()._overwrite_model_variables_with_average_value(trainable_variables)
            return BaseOptimizer._overwrite_model_variables_with_average_value(
                self, trainable_variables
            )

    return ReplicaOverwrite


def _adam(freq: int | None, stock: bool = False) -> keras.optimizers.Optimizer:
    cls = _replica_overwrite(keras.optimizers.Adam) if stock else keras.optimizers.Adam
    return cls(LR, use_ema=True, ema_momentum=MOMENTUM, ema_overwrite_frequency=freq)


def _model(aux: bool = False, norm: bool = True) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="hidden")(inp)
    if norm:  # its statistics depend on the batch: not with micro-batches
        h = keras.layers.BatchNormalization(name="norm")(h)
    out = keras.layers.Dense(4, name="head")(h)
    if aux:  # no gradient: the loss reads only ``head``
        return keras.Model(inp, [out, keras.layers.Dense(2, name="aux")(h)])
    return keras.Model(inp, out)


@functools.cache
def _data(n: int = STEPS * BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(3)
    x = rng.standard_normal((n, 8)).astype("float32")
    return x, (np.argmax(x[:, :4], axis=1) % 4).astype("int32")


def _fit(strategy, freq, stock: bool = False, batch: int = BATCH, norm: bool = True):
    x, y = _data()
    with strategy.scope():
        model = _model(norm=norm)
        model.compile(
            optimizer=_adam(freq, stock),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return fit_losses(model, x, y, batch), model


class _Loop:
    """A user's tape loop (TensorFlow's custom-training tutorial) over the ``aux`` model."""

    def __init__(self, strategy, freq, stock: bool = False) -> None:
        self.strategy = strategy
        with strategy.scope():
            self.model = _model(aux=True)
            self.optimizer = _adam(freq, stock)
            self.optimizer.build(self.model.trainable_variables)
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        self.step = tf.function(self._step)

    def _train_step(self, x, y):
        model = self.model
        with tf.GradientTape() as tape:
            logits, _ = model(x, training=True)
            loss = tf.nn.compute_average_loss(self.loss(y, logits), global_batch_size=BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def _step(self, x, y):
        per_replica = self.strategy.run(self._train_step, args=(x, y))
        return self.strategy.reduce("SUM", per_replica, axis=None)

    def train(self, start: int, steps: int) -> list[float]:
        """Train batches ``[start, start + steps)``; returns their losses."""
        x, y = _data()
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).skip(start).take(steps)
        batches = self.strategy.experimental_distribute_dataset(ds)
        return [float(self.step(a, b)) for a, b in batches]

    def finalize(self) -> list[np.ndarray]:
        """``finalize_variable_values`` (the averages into the weights); the weights."""
        self.optimizer.finalize_variable_values(self.model.trainable_variables)
        return self.model.get_weights()


@pytest.fixture(scope="module")
def reference(cpu_devices):
    """``reference(form, freq) -> (losses, weights, averages)``: MirroredStrategy with
    Keras's Adam and EMA (``form`` 'fit' or 'loop'), each made once."""

    @functools.cache
    def get(form: str, freq: int | None):
        strategy = Mirrored(cpu_devices)
        if form == "fit":
            losses, model = _fit(strategy, freq, stock=True)
            opt, weights = model.optimizer, model.get_weights()
        else:
            loop = _Loop(strategy, freq, stock=True)
            losses = loop.train(0, STEPS)
            opt, weights = loop.optimizer, loop.finalize()
        assert opt.use_ema and not hasattr(opt, "zero_state")  # stock Keras
        averages = [a.numpy() for a in opt._model_variables_moving_average]  # noqa: SLF001
        return losses, weights, averages

    return get


def _strategy(stage: int, tier: str, tmp_path, **extra) -> zero_runtime.ZeroInfinityStrategy:
    if tier == "nvme":
        tmp_path.mkdir(parents=True, exist_ok=True)
        extra |= {"nvme_path": str(tmp_path), "sub_group_size": 64, "page_size_bytes": 65536}
    if stage == 3:
        extra.setdefault("offload_param", "cpu" if tier != "none" else "none")
    config = ZeroConfig(stage=stage, offload_optimizer=tier, mirrored_fallback_bytes=0, **extra)
    return zero_runtime.ZeroInfinityStrategy(config, num_cpu_replicas=2)


def _check_partitioned(opt, stage: int, tier: str) -> None:
    """The average is a partitioned slot of the store on ``tier``, not Keras's variable."""
    zs = opt.zero_state
    assert zs.stage == stage and not opt.fallback_mirrored
    assert isinstance(zs.store, STORE[tier]) and zs.store.slot_names[-1] == EMA_SLOT
    assert not hasattr(opt, "_model_variables_moving_average")
    if stage == 3:
        assert all(isinstance(v, ShardedVariable) for v in opt._trainable_variables)  # noqa: SLF001


def _assert_bitwise(losses, weights, ref_losses, ref_weights) -> None:
    np.testing.assert_array_equal(losses, ref_losses)
    assert len(weights) == len(ref_weights)
    for w, r in zip(weights, ref_weights):
        np.testing.assert_array_equal(w, r)


FIT_CASES = [(s, t, f) for s in (1, 2, 3) for t in ("none", "cpu") for f in (None, FREQ)] + [
    (2, "nvme", FREQ)
]


@pytest.mark.parametrize(
    ("stage", "tier", "freq"), FIT_CASES, ids=[f"s{s}-{t}-f{f}" for s, t, f in FIT_CASES]
)
def test_fit_is_bitwise_keras(stage, tier, freq, reference, tmp_path):
    strategy = _strategy(stage, tier, tmp_path)
    try:
        losses, model = _fit(strategy, freq)
        opt = model.optimizer
        _check_partitioned(opt, stage, tier)
        assert int(opt.iterations.numpy()) == STEPS
        rows = strategy.runtime.placement()["variables"]
        ema = [r for r in rows if r["name"].endswith(" (EMA average)")]
        assert len(ema) == len(opt._trainable_variables)  # noqa: SLF001
        assert {r["optimizer_tier"] for r in ema} == {TIER[tier]}
        weights = model.get_weights()
    finally:
        strategy.close()
    ref_losses, ref_weights, _ = reference("fit", freq)
    _assert_bitwise(losses, weights, ref_losses, ref_weights)


LOOP_CASES = [(1, "none", FREQ), (1, "cpu", None), (2, "none", None), (2, "cpu", FREQ)] + [
    (3, "none", FREQ),
    (3, "cpu", None),
    (3, "nvme", FREQ),
]


@pytest.mark.parametrize(
    ("stage", "tier", "freq"), LOOP_CASES, ids=[f"s{s}-{t}-f{f}" for s, t, f in LOOP_CASES]
)
def test_tape_loop_is_bitwise_keras(stage, tier, freq, reference, tmp_path):
    """A variable without a gradient (``aux``) keeps its value and its average moves
    toward it each step, as Keras's; ``finalize_variable_values`` writes the averages."""
    strategy = _strategy(stage, tier, tmp_path)
    try:
        loop = _Loop(strategy, freq)
        losses = loop.train(0, STEPS)
        _check_partitioned(loop.optimizer, stage, tier)
        weights = loop.finalize()
    finally:
        strategy.close()
    ref_losses, ref_weights, _ = reference("loop", freq)
    _assert_bitwise(losses, weights, ref_losses, ref_weights)


ACCUM_CASES = [(1, "cpu"), (2, "none"), (3, "cpu")]


@pytest.mark.parametrize(("stage", "tier"), ACCUM_CASES, ids=[f"s{s}-{t}" for s, t in ACCUM_CASES])
def test_gradient_accumulation_averages_once_per_optimizer_step(stage, tier, cpu_devices, tmp_path):
    """2 micro-batches of 8 per optimizer step: the average advances once per optimizer
    step (its momentum 0 on the first, the overwrite every FREQ optimizer steps), as
    Keras's on batches of 16 (the model without BatchNormalization, whose statistics
    depend on the batch)."""
    _, ref = _fit(Mirrored(cpu_devices), FREQ, stock=True, norm=False)
    strategy = _strategy(stage, tier, tmp_path, gradient_accumulation_steps=2)
    try:
        _, model = _fit(strategy, FREQ, batch=BATCH // 2, norm=False)
        assert int(model.optimizer.iterations.numpy()) == 2 * STEPS
        weights = model.get_weights()
    finally:
        strategy.close()
    worst = max(
        float(np.max(np.abs(w - r)) / np.max(np.abs(r))) for w, r in zip(weights, ref.get_weights())
    )
    print(f"stage {stage} {tier}: 2 micro-batches vs Keras, max |dw|/max |w| {worst:.3g}")
    assert worst <= ACCUM_BOUND


CKPT_CASES = [(1, "none", "sharded"), (3, "nvme", "sharded"), (3, "cpu", "tf.train.Checkpoint")]


@pytest.mark.parametrize(
    ("stage", "tier", "kind"), CKPT_CASES, ids=[f"s{s}-{t}-{k}" for s, t, k in CKPT_CASES]
)
def test_checkpoint_restores_the_averages(stage, tier, kind, reference, tmp_path):
    """Save after 3 steps of the tape loop (``strategy.save_checkpoint``, or TensorFlow's
    ``tf.train.Checkpoint(model=..., optimizer=...)``: the states gathered into Keras's
    layout), restore into a fresh model and optimizer: the last 3 steps and the finalized
    weights repeat the uninterrupted run bitwise (and so Keras's)."""
    half = STEPS // 2
    prefix = str(tmp_path / "tf" / "ckpt")
    strategy = _strategy(stage, tier, tmp_path / "a")
    try:
        loop = _Loop(strategy, FREQ)
        loop.train(0, half)
        if kind == "sharded":
            strategy.save_checkpoint(str(tmp_path / "ckpt"), loop.model)
        else:
            path = tf.train.Checkpoint(model=loop.model, optimizer=loop.optimizer).save(prefix)
        want = loop.train(half, STEPS - half), loop.finalize()
    finally:
        strategy.close()
    strategy = _strategy(stage, tier, tmp_path / "b")
    try:
        loop = _Loop(strategy, FREQ)
        if kind == "sharded":
            info = strategy.load_checkpoint(str(tmp_path / "ckpt"), loop.model)
            assert info.step == half
        else:
            ckpt = tf.train.Checkpoint(model=loop.model, optimizer=loop.optimizer)
            ckpt.restore(path).assert_existing_objects_matched()
        assert int(loop.optimizer.iterations.numpy()) == half
        got = loop.train(half, STEPS - half), loop.finalize()
    finally:
        strategy.close()
    _assert_bitwise(*got, *want)
    ref_losses, ref_weights, _ = reference("loop", FREQ)
    _assert_bitwise(*got, ref_losses[half:], ref_weights)


@pytest.mark.parametrize(("stage", "tier"), [(1, "cpu"), (3, "none")])
def test_model_save_writes_keras_averages(stage, tier, reference, tmp_path):
    """``model.save`` gathers the averages into Keras's layout: plain Keras loads them
    into its ``_model_variables_moving_average``, equal to MirroredStrategy's; loaded
    inside a ZeRO scope they are scattered back into the shards."""
    path = str(tmp_path / "m.keras")
    strategy = _strategy(stage, tier, tmp_path)
    try:
        _, model = _fit(strategy, None)
        model.save(path)
    finally:
        strategy.close()
    _, _, ref_averages = reference("fit", None)
    plain = keras.models.load_model(path)
    assert type(plain.optimizer) is keras.optimizers.Adam and plain.optimizer.use_ema
    averages = [a.numpy() for a in plain.optimizer._model_variables_moving_average]  # noqa: SLF001
    _assert_bitwise([], averages, [], ref_averages)
    strategy = _strategy(1, "cpu", tmp_path)
    try:
        with strategy.scope():
            loaded = keras.models.load_model(path)
        zs = loaded.optimizer.zero_state
        flat = zs.layout.unshard(
            [zs.store.read_shard(r, EMA_SLOT) for r in range(zs.layout.num_shards)]
        )
        np.testing.assert_array_equal(flat, np.concatenate([a.ravel() for a in ref_averages]))
    finally:
        strategy.close()


def test_estimator_counts_the_average():
    """The estimator's K of an optimizer with ``use_ema`` is 4 bytes more (the average)."""
    for opt, kind in [
        (keras.optimizers.Adam(use_ema=True), "adam_ema"),
        (keras.optimizers.SGD(use_ema=True), "sgd_ema"),
        (keras.optimizers.Adafactor(use_ema=True), "adafactor_ema"),
    ]:
        assert estimator.state_kind(opt) == kind
        assert estimator.optimizer_kind(opt) == kind
        base = estimator.OPTIMIZER_STATE_BYTES[kind.removesuffix("_ema")]
        for precision, k in estimator.OPTIMIZER_STATE_BYTES[kind].items():
            assert k == base[precision] + 4


def test_partial_offload_with_ema_is_refused(tmp_path):
    """Partial optimizer offload (the device/host split store) keeps no average: refused
    at build, naming the setting."""
    strategy = _strategy(1, "cpu", tmp_path, offload_optimizer_ratio=0.5)
    try:
        with strategy.scope():
            model = _model(norm=False)
            opt = _adam(None)
            with pytest.raises(NotImplementedError, match="offload_optimizer_ratio=1.0"):
                opt.build(model.trainable_variables)
    finally:
        strategy.close()


def test_row_paged_table_with_ema_is_refused(tmp_path):
    """At stage 3 a row-paged embedding table updates only the rows a step touches; with
    ``use_ema`` the build is refused naming the threshold to raise."""
    strategy = _strategy(3, "cpu", tmp_path, embedding_row_paging_threshold=64)
    try:
        with strategy.scope():
            inp = keras.Input((4,), dtype="int32")
            h = keras.layers.Flatten()(keras.layers.Embedding(100, 4, name="embed")(inp))
            model = keras.Model(inp, keras.layers.Dense(2)(h))
            model.compile(optimizer=_adam(None), loss="mse")
            with pytest.raises(NotImplementedError, match="embedding_row_paging_threshold"):
                model.optimizer.build(model.trainable_variables)
    finally:
        strategy.close()
