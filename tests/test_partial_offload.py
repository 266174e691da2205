"""Partial optimizer offload (``offload_optimizer_ratio``, DeepSpeed's Twin-Flow ratio):
part of each shard's optimizer states on the device, the rest on the host, one step.

Parity: the same model, data and seed with ratio 0.5 give the same losses, weights and
optimizer moments as full offload (ratio 1.0) and as MirroredStrategy with Keras's
optimizer (stages 1 and 2; AdamW, so the decoupled weight decay is covered too).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers.mirrored import Mirrored

import zero_runtime
from zero_runtime.config import DeepSpeedKeyIgnoredWarning, ZeroConfig, ZeroConfigError
from zero_runtime.optim import partitioned
from zero_runtime.optim.split_state import SplitOptimizerState, device_elements

STEPS = 6
GLOBAL_BATCH = 16


class DenseGradAdamW(keras.optimizers.AdamW):
    """Keras's AdamW given dense gradients (the parity reference, see docs/parity.md)."""

    def apply(self, grads, trainable_variables=None):
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        return super().apply(grads, trainable_variables)


def _model() -> keras.Model:
    keras.utils.set_random_seed(3)
    frozen = keras.layers.Dense(16, name="frozen")
    frozen.trainable = False
    return keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(40, activation="relu", name="hidden"),
            keras.layers.LayerNormalization(name="norm"),
            frozen,
            keras.layers.Dense(4, name="head"),
        ]
    )


def _fit(strategy, optimizer):
    rng = np.random.RandomState(11)
    x = rng.standard_normal((STEPS * GLOBAL_BATCH, 10)).astype("float32")
    y = rng.randint(0, 4, size=(STEPS * GLOBAL_BATCH,)).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with strategy.scope():
        model = _model()
        model.compile(
            optimizer=optimizer(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    losses: list[float] = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"]))
    )
    model.fit(ds, epochs=1, verbose=0, callbacks=[record], shuffle=False)
    return losses, model


def _adamw() -> dict:
    return {"class_name": "adamw", "config": {"learning_rate": 0.01, "weight_decay": 0.05}}


@pytest.fixture(scope="module")
def reference(cpu_devices):
    return _fit(
        Mirrored(cpu_devices), lambda: DenseGradAdamW(learning_rate=0.01, weight_decay=0.05)
    )


@pytest.fixture(scope="module", params=[1, 2], ids=["stage1", "stage2"])
def runs(request, tmp_path_factory, cpu_devices):
    """(stage, {ratio: (losses, model, strategy)}) for ratio 0.5 and 1.0."""
    out = {}
    for ratio in (0.5, 1.0):
        config = ZeroConfig(
            stage=request.param, offload_optimizer="cpu", offload_optimizer_ratio=ratio
        )
        logdir = tmp_path_factory.mktemp(f"partial_s{request.param}_{ratio}")
        strategy = zero_runtime.ZeroInfinityStrategy(config, logdir=str(logdir))
        losses, model = _fit(strategy, _adamw)
        out[ratio] = (losses, model, strategy)
    yield request.param, out
    for _, _, strategy in out.values():
        strategy.close()


def test_partial_offload_matches_full_offload_and_mirrored(runs, reference):
    _, out = runs
    ref_losses, ref_model = reference
    half_losses, half_model, _ = out[0.5]
    full_losses, full_model, _ = out[1.0]
    assert len(half_losses) == STEPS and half_losses[-1] < half_losses[0]
    np.testing.assert_array_equal(half_losses, full_losses)
    np.testing.assert_allclose(half_losses, ref_losses, rtol=1e-6, atol=0)
    for h, f, r in zip(half_model.get_weights(), full_model.get_weights(), ref_model.get_weights()):
        np.testing.assert_array_equal(h, f)
        np.testing.assert_allclose(h, r, rtol=1e-6, atol=1e-7)


def test_states_are_split_between_device_and_host(runs):
    _, out = runs
    _, half_model, _ = out[0.5]
    _, full_model, _ = out[1.0]
    opt = half_model.optimizer
    assert isinstance(opt, partitioned.AdamW)
    store = opt.host_state
    assert isinstance(store, SplitOptimizerState)
    n = opt.flat_layout.shard_size
    k = store.device_size
    assert k == device_elements(n, 0.5) and abs(k - 0.5 * n) <= 8.5 and 0 < k < n
    usage = store.usage()
    # two slots (momentum, velocity), float32, two local replicas
    assert usage["device"] == (2 * 4 * k * 2, 0)
    assert usage["host"][0] == 2 * 4 * (n - k) * 2
    assert store.updates(0) == store.updates(1) == STEPS
    # The split moments, read back whole, equal full offload's.
    full = full_model.optimizer.host_state
    for slot in ("momentum", "velocity"):
        np.testing.assert_array_equal(store.slot_values(slot), full.slot_values(slot))
        assert np.any(store.read_shard(0, slot)[:k] != 0)  # the device part was updated


def test_runtime_accounts_both_tiers(runs):
    _, out = runs
    _, half_model, strategy = out[0.5]
    store = half_model.optimizer.host_state
    accounting = strategy.runtime.accounting
    assert accounting.state_bytes_on("device")[0] == store.device.state_bytes > 0
    assert accounting.state_bytes_on("host")[0] == store.host.state_bytes > 0
    rows = accounting.placement("cpu")["variables"]
    assert rows and all(r["optimizer_host_fraction"] == 0.5 for r in rows)


def test_split_store_write_then_read_is_exact(cpu_devices):
    from zero_runtime.optim.layout import FlatLayout

    layout = FlatLayout.from_variables([tf.zeros([7, 3]), tf.zeros([5])], 2, bucket_size=100)
    store = SplitOptimizerState(layout, ("momentum",), cpu_devices, ratio=0.25)
    values = np.arange(layout.shard_size, dtype=np.float32) + 0.5
    store.write_shard(1, "momentum", values)
    np.testing.assert_array_equal(store.read_shard(1, "momentum"), values)
    np.testing.assert_array_equal(store.read_shard(0, "momentum"), 0)
    with pytest.raises(ValueError, match=r"expects \(13,\)"):
        store.write_shard(0, "momentum", values[:-1])
    with pytest.raises(ValueError, match=r"ratio=1.0: expected a float in \(0, 1\)"):
        SplitOptimizerState(layout, ("momentum",), cpu_devices, ratio=1.0)


def test_host_part_runs_on_a_worker_while_the_caller_goes_on(cpu_devices):
    """start_update returns before the host part ends (the device part can run); finish
    waits for it and returns its value; its error surfaces at finish; inline runs it in
    the caller's thread; closed: refused."""
    import threading

    from zero_runtime.optim.layout import FlatLayout

    layout = FlatLayout.from_variables([tf.zeros([64])], 2, bucket_size=100)
    store = SplitOptimizerState(layout, ("momentum",), cpu_devices, ratio=0.5)
    assert store.device_size == 16  # 32 elements per shard, the cut aligned to 16
    release, ran_on = threading.Event(), []

    def host_part(x):
        ran_on.append(threading.current_thread().name)
        assert release.wait(30)
        return x * 2

    store.start_update(1, host_part, np.float32(3))
    assert not release.is_set()  # start returned while the host part is still waiting
    release.set()
    assert store.finish_update(1) == 6.0
    assert ran_on[0].startswith("zero-twin") and ran_on[0] != threading.current_thread().name
    with pytest.raises(RuntimeError, match="no host update of replica 1 in flight"):
        store.finish_update(1)

    def failing():
        raise ValueError("host kernel failed")

    store.start_update(0, failing)
    with pytest.raises(ValueError, match="host kernel failed"):
        store.finish_update(0)
    # inline (CPU devices): runs in the caller's thread, its error raised at once
    store.start_update(0, host_part, np.float32(4), inline=True)
    assert ran_on[-1] == threading.current_thread().name
    assert store.finish_update(0) == 8.0
    with pytest.raises(ValueError, match="host kernel failed"):
        store.start_update(0, failing, inline=True)
    store.close()
    with pytest.raises(RuntimeError, match="store is closed"):
        store.start_update(0, failing)


def test_device_cut_is_aligned_unless_a_part_would_be_empty():
    assert device_elements(1_052_805, 0.5) == 526_400  # exact cut 526_402.5 -> 526_402
    assert device_elements(1_052_805, 0.25) % 16 == 0
    assert device_elements(13, 0.25) == 10  # aligned (16) would empty the host part
    assert device_elements(13, 0.9) == 1  # aligned (0) would empty the device part
    assert device_elements(100, 0.999) == 0  # the exact cut is empty: stays so


def test_partial_offload_with_accumulation_matches_full_offload(cpu_devices):
    """Stage 2, two micro-steps per update: the split update runs inside tf.cond."""
    runs = []
    for ratio in (0.5, 1.0):
        config = ZeroConfig(
            stage=2,
            offload_optimizer="cpu",
            offload_optimizer_ratio=ratio,
            gradient_accumulation_steps=2,
        )
        strategy = zero_runtime.ZeroInfinityStrategy(config)
        try:
            losses, model = _fit(strategy, _adamw)
            runs.append((losses, model.get_weights()))
        finally:
            strategy.close()
    (half_losses, half_weights), (full_losses, full_weights) = runs
    np.testing.assert_array_equal(half_losses, full_losses)
    for h, f in zip(half_weights, full_weights):
        np.testing.assert_array_equal(h, f)


def test_accelerator_path_slices_on_the_device_and_matches(cpu_devices, monkeypatch):
    """Replicas not on a CPU take the other path (slices to the host call, the parts
    joined on the device); run here by declaring the CPU devices accelerators."""
    weights = {}
    for ratio in (0.5, 1.0):
        if ratio < 1.0:
            monkeypatch.setattr(SplitOptimizerState, "device_on_cpu", lambda self, r: False)
        strategy = zero_runtime.ZeroInfinityStrategy(
            ZeroConfig(stage=1, offload_optimizer="cpu", offload_optimizer_ratio=ratio)
        )
        try:
            _, model = _fit(strategy, _adamw)
            weights[ratio] = model.get_weights()
        finally:
            strategy.close()
            monkeypatch.undo()
    for h, f in zip(weights[0.5], weights[1.0]):
        np.testing.assert_array_equal(h, f)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"offload_optimizer_ratio": 0.0}, "expected a finite number in (0, 1]"),
        ({"offload_optimizer_ratio": 1.2}, "expected a finite number in (0, 1]"),
        (
            {"offload_optimizer_ratio": 0.5, "offload_optimizer": "none"},
            "needs offload_optimizer='cpu' at stage 1 or 2",
        ),
        ({"offload_optimizer_ratio": 0.5, "stage": 3}, "offload_optimizer='cpu' and stage=3"),
    ],
)
def test_bad_ratio_is_refused_naming_the_value(kw, message):
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig(**kw)
    assert message in str(info.value)
    assert "offload_optimizer_ratio" in str(info.value)


def test_deepspeed_ratio_maps_to_offload_optimizer_ratio():
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}
    assert ZeroConfig.from_deepspeed(ds).offload_optimizer_ratio == 0.3
    ds["zero_optimization"]["offload_optimizer"] = {"device": "none", "ratio": 0.3}
    with pytest.warns(DeepSpeedKeyIgnoredWarning, match="ratio applies to 'cpu'"):
        assert ZeroConfig.from_deepspeed(ds).offload_optimizer_ratio == 1.0


def test_estimator_splits_the_optimizer_states_by_the_ratio():
    from zero_runtime import estimator

    config = ZeroConfig(stage=2, offload_optimizer="cpu", offload_optimizer_ratio=0.25)
    split = estimator.estimate_for_config(1_000_000, 2, config, precision="fp32")
    full = estimator.estimate_for_config(
        1_000_000, 2, ZeroConfig(stage=2, offload_optimizer="cpu"), precision="fp32"
    )
    host = split.breakdown["optimizer_states"]
    device = split.breakdown["optimizer_states_device"]
    assert (host["tier"], device["tier"]) == ("host", "device")
    assert host["elements"] == 250_000 and device["elements"] == 750_000
    assert host["bytes"] + device["bytes"] == full.breakdown["optimizer_states"]["bytes"]
    assert split.device_bytes - full.device_bytes == device["bytes"] == 8 * 750_000 // 2
    with pytest.raises(ValueError, match=r"offload_ratio=0 is invalid"):
        estimator.estimate(10, 1, offload_optimizer="cpu", offload_ratio=0)
