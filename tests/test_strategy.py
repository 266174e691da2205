"""ZeroInfinityStrategy stage 1: parity with MirroredStrategy, custom loops, telemetry.

Parity is the proof of correct sharding: the same model, data and seed under ZeRO stage 1
give the same losses and weights as plain data parallelism with the stock Keras optimizer.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers.mirrored import Mirrored
from helpers.reference_optimizers import DenseGradAdam, DenseGradSGD

import zero_runtime
from tb_plugin import metadata
from zero_runtime.optim import partitioned

STEPS = 20
GLOBAL_BATCH = 16


def _model(seed: int) -> keras.Model:
    """Embedding, dense, layer norm and a frozen layer; 2 outputs classes."""
    keras.utils.set_random_seed(seed)
    frozen = keras.layers.Dense(12, name="frozen")
    frozen.trainable = False
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(50, 8, name="embed"),  # (B, 6, 8)
            keras.layers.Flatten(),  # (B, 48)
            keras.layers.Dense(24, activation="relu", name="hidden"),
            keras.layers.LayerNormalization(name="norm"),
            frozen,
            keras.layers.Dense(3, name="head"),
        ]
    )


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(7)
    x = rng.randint(0, 50, size=(STEPS * GLOBAL_BATCH, 6)).astype("int32")
    y = (x.sum(axis=1) % 3).astype("int32")
    return x, y


def _fit(strategy: tf.distribute.Strategy, make_optimizer):
    """Fit ``_model(0)`` for STEPS steps; the optimizer is made inside the scope."""
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with strategy.scope():
        model = _model(0)
        model.compile(
            optimizer=make_optimizer(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    losses: list[float] = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"]))
    )
    model.fit(ds, epochs=1, verbose=0, callbacks=[record], shuffle=False)
    return losses, model, model.get_weights()


@pytest.fixture(scope="module")
def mirrored_run(cpu_devices):
    strategy = Mirrored(cpu_devices)
    return _fit(strategy, lambda: DenseGradAdam(learning_rate=0.01))


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory, cpu_devices):
    logdir = tmp_path_factory.mktemp("zero_logs") / "stage1"
    strategy = zero_runtime.ZeroInfinityStrategy(logdir=str(logdir))
    # The user's Keras identifier, resolved inside the scope to the partitioned Adam.
    losses, model, weights = _fit(
        strategy, lambda: {"class_name": "adam", "config": {"learning_rate": 0.01}}
    )
    strategy.close()
    return strategy, losses, model, weights, logdir


def _max_rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def test_stage1_matches_mirrored_losses_and_weights(zero_run, mirrored_run):
    _, zero_losses, _, zero_weights, _ = zero_run
    ref_losses, _, ref_weights = mirrored_run
    assert len(zero_losses) == len(ref_losses) == STEPS
    np.testing.assert_allclose(zero_losses, ref_losses, rtol=1e-6, atol=0)
    assert ref_losses[-1] < ref_losses[0]  # the model really trained
    assert len(zero_weights) == len(ref_weights)
    for z, r in zip(zero_weights, ref_weights):
        assert z.shape == r.shape
        np.testing.assert_allclose(z, r, rtol=1e-6, atol=1e-7)


def test_optimizer_state_lives_on_host_sharded(zero_run):
    strategy, _, model, _, _ = zero_run
    opt = model.optimizer
    assert isinstance(opt, partitioned.Adam)
    # No per-variable slot variables on the device: only Keras's counters.
    slot_like = [v for v in opt.variables if "momentum" in v.path or "velocity" in v.path]
    assert slot_like == []
    layout = opt.flat_layout
    n_params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert layout.total == n_params
    assert layout.num_shards == strategy.num_replicas_in_sync == 2
    assert layout.shard_size == math.ceil(n_params / 2)
    # Two float32 slots per shard, both local replicas' shards on this host.
    assert opt.host_state.state_bytes == 2 * 2 * 4 * layout.shard_size
    assert opt.host_state.shard(0).updates == STEPS


def test_host_moments_equal_keras_adam_slots(cpu_devices):
    """After training, the host shards hold exactly the moments Keras's Adam holds."""
    x, y = _data()
    strategy = zero_runtime.ZeroInfinityStrategy()
    ref = Mirrored(cpu_devices)
    results = []
    for strat, make_opt in ((strategy, lambda: "adam"), (ref, DenseGradAdam)):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).take(5)
        with strat.scope():
            model = _model(1)
            model.compile(
                optimizer=make_opt(), loss=keras.losses.SparseCategoricalCrossentropy(True)
            )
        model.fit(ds, verbose=0, shuffle=False)
        results.append(model)
    strategy.close()
    zero_opt, keras_opt = results[0].optimizer, results[1].optimizer
    momentum = np.concatenate(
        [
            np.reshape(keras_opt._momentums[i].numpy(), [-1])
            for i in range(len(keras_opt._momentums))
        ]
    )
    np.testing.assert_allclose(zero_opt.host_state.slot_values("momentum"), momentum, rtol=1e-6)


def test_custom_training_loop_through_strategy_run(cpu_devices):
    """strategy.run with a partitioned optimizer equals the same loop under Mirrored."""
    x, y = _data()
    outcomes = []
    for make in (
        lambda: (zero_runtime.ZeroInfinityStrategy(), lambda: keras.optimizers.get("sgd")),
        lambda: (
            Mirrored(cpu_devices),
            lambda: DenseGradSGD(),
        ),
    ):
        strategy, make_opt = make()
        with strategy.scope():
            model = _model(2)
            opt = make_opt()
            opt.learning_rate = 0.1
            opt.momentum = 0.9
            opt.build(model.trainable_variables)  # outside tf.function, as Keras requires
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        ds = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).take(8)
        )

        @tf.function
        def train_step(batch, model=model, opt=opt, strategy=strategy, loss_fn=loss_fn):
            def replica_fn(xb, yb):
                with tf.GradientTape() as tape:
                    loss = loss_fn(yb, model(xb, training=True)) / GLOBAL_BATCH
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            per_replica = strategy.run(replica_fn, args=batch)
            return strategy.reduce("SUM", per_replica, axis=None)

        losses = [float(train_step(b)) for b in ds]
        outcomes.append((type(opt), losses, model.get_weights()))
        if isinstance(strategy, zero_runtime.ZeroInfinityStrategy):
            strategy.close()
    (zero_cls, zero_losses, zero_w), (_, ref_losses, ref_w) = outcomes
    assert zero_cls is partitioned.SGD
    np.testing.assert_allclose(zero_losses, ref_losses, rtol=1e-6)
    for a, b in zip(zero_w, ref_w):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_telemetry_events_every_step(zero_run):
    """Each step wrote the tier matrix with non-zero device and host bytes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    strategy, _, model, _, logdir = zero_run
    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["tensors"])
    for tag in (
        metadata.TAG_TIERS,
        metadata.TAG_READINGS,
        metadata.TAG_TIMING,
        metadata.TAG_RUN_INFO,
    ):
        assert tag in tags
    events = acc.Tensors(metadata.TAG_TIERS)
    assert [e.step for e in events] == list(range(STEPS))
    rows = {name: i for i, name in enumerate(metadata.TIERS)}
    cols = {name: i for i, name in enumerate(metadata.TIER_COLUMNS)}
    last = tensor_util.make_ndarray(events[-1].tensor_proto)
    assert last.shape == (3, len(metadata.TIER_COLUMNS))
    param_bytes = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    # Device: parameters of both local replicas are counted; the framework reading covers them.
    assert last[rows["device"], cols["param_bytes"]] == 2 * param_bytes
    assert last[rows["device"], cols["used_bytes"]] >= 2 * param_bytes
    # Host: exactly the optimizer-state shards (Adam: 2 slots) of both replicas.
    opt = model.optimizer
    assert last[rows["host"], cols["optimizer_bytes"]] == opt.host_state.state_bytes
    assert last[rows["host"], cols["used_bytes"]] == opt.host_state.nbytes
    info = acc.Tensors(metadata.TAG_RUN_INFO)[0]
    import json

    run_info = json.loads(tensor_util.make_ndarray(info.tensor_proto).item())
    assert run_info["stage"] == 1
    assert run_info["device_is_standin"] is True
    assert run_info["num_replicas"] == strategy.num_replicas_in_sync
    # Written again once the host store chose its kernels: the backend in use.
    from zero_runtime.optim import fused

    last_info = acc.Tensors(metadata.TAG_RUN_INFO)[-1]
    last_info = json.loads(tensor_util.make_ndarray(last_info.tensor_proto).item())
    assert last_info["host_optimizer"] == fused.backend_info()


def test_keras_sparse_adam_is_not_dense_adam():
    """Why the reference densifies: Keras's Adam on duplicate-index IndexedSlices differs."""
    grad = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([0, 0]), [3, 2])
    sparse_var, dense_var = (
        keras.Variable(np.ones((3, 2), "float32")),
        keras.Variable(np.ones((3, 2), "float32")),
    )
    sparse_opt, dense_opt = keras.optimizers.Adam(0.1), DenseGradAdam(0.1)
    for step in range(3):
        sparse_opt.apply([grad], [sparse_var])
        dense_opt.apply([grad], [dense_var])
        if step == 0:  # v = (1 - beta_2) g^2 after one step; g = the row's slices summed
            m_sparse, m_dense = (o._momentums[0].numpy()[0] for o in (sparse_opt, dense_opt))
            v_sparse, v_dense = (o._velocities[0].numpy()[0] for o in (sparse_opt, dense_opt))
            np.testing.assert_allclose(m_sparse, m_dense)  # first moment: the sum, both
            np.testing.assert_allclose(v_dense, 1e-3 * np.array([16.0, 36.0]), rtol=1e-6)
            # Keras squares each slice, then sums: 1^2 + 3^2, 2^2 + 4^2 (docs/parity.md)
            np.testing.assert_allclose(v_sparse, 1e-3 * np.array([10.0, 20.0]), rtol=1e-6)
    # Dense Adam moves row 0 by ~lr per step (3 steps: 1 - 0.3); Keras's sparse path overshoots.
    np.testing.assert_allclose(dense_var.numpy()[0], [0.7, 0.7], atol=1e-5)
    assert np.all(sparse_var.numpy()[0] < 0.69)


def test_every_stage_and_optimizer_tier_is_implemented():
    # stage 3 with device / NVMe optimizer states too (parity: tests/test_stage3.py)
    from zero_runtime.strategy import IMPLEMENTED

    tiers = ("none", "cpu", "nvme")
    assert IMPLEMENTED == {(0, "none")} | {(s, o) for s in (1, 2, 3) for o in tiers}
    strategy = zero_runtime.ZeroInfinityStrategy({"stage": 3, "offload_optimizer": "none"})
    assert strategy.config.offload_optimizer == "none"
    strategy.close()


def test_estimate_event_matches_what_the_runtime_holds(zero_run):
    """The estimator's host prediction equals the optimizer-state bytes actually allocated.

    ZeRO stage 1, fp32 Adam, offload to cpu: K = 8 bytes per parameter of optimizer state,
    divided over N_d = 2 replicas (SC20 section 5.1), on the host; parameters (4 bytes) and
    gradients (4 bytes) stay on the device, replicated.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    strategy, _, model, _, logdir = zero_run
    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    event = acc.Tensors(metadata.TAG_ESTIMATE)[0]
    import json

    estimate = json.loads(tensor_util.make_ndarray(event.tensor_proto).item())
    psi = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    per_replica = estimate["per_replica"]
    assert estimate["num_params"] == psi
    assert per_replica["device_bytes"] == 4 * psi + 4 * psi
    assert per_replica["host_bytes"] == 8 * math.ceil(psi / 2)  # each replica's padded shard
    # Measured: the host shards of both local replicas, allocated by the runtime.
    assert estimate["per_process"]["host_bytes"] == 2 * per_replica["host_bytes"]
    assert model.optimizer.host_state.state_bytes == estimate["per_process"]["host_bytes"]
    # Measured on the device: the replicas' parameters, as the runtime accounts them.
    assert strategy.runtime.model_param_bytes() * 2 == 2 * 4 * psi
    # The predicted in-step peak: stage 1 already counts the full fp32 gradient, so the
    # peak equals the boundary figure, for both local replicas.
    assert estimate["per_process_peak"] == {
        "device_bytes": 2 * per_replica["device_bytes"],
        "host_bytes": 2 * per_replica["host_bytes"],
        "nvme_bytes": 0,
    }
