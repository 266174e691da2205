"""Stage 3: the optimizer update in backward (zero_runtime/optim/backward_update.py).

With optimizer states on the host or NVMe, each unit's parameter shards are updated as
soon as the unit's gradient shard is reduced (an original read by one use; the others,
such as a tied table, after the backward). Values: exactly (bitwise) the end-of-step
update's, which the parity tests of tests/test_stage3.py tie
to MirroredStrategy; the end-of-step path is forced with ``clipvalue=1e9`` (clipping
needs every shard first and changes no value at that bound). Covered: Adam with a
learning-rate schedule, AdamW (decoupled weight decay), SGD with momentum; host and NVMe
states; a chain and a tied DAG. Memory: one step's allocator peak,
measured in a fresh process, drops by at least the gradient shards' bytes (4 bytes x
parameters over the replicas) that the end-of-step update keeps on the device until the
step's end.
"""

from __future__ import annotations

import functools
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import any_models as am
from helpers.jobs import run_json_jobs

import zero_runtime
from demo.model import GPTConfig, build_gpt
from zero_runtime.optim import backward_update
from zero_runtime.sharded_variable import ShardState

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=32)
STEPS, BATCH = 6, 8
JOB = os.path.join(os.path.dirname(__file__), "helpers", "step_peak_job.py")


@functools.cache
def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(11)
    tokens = rng.randint(0, CFG.vocab_size, size=(STEPS * BATCH, CFG.seq_len + 1))
    return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")


def _optimizer(kind: str, **extra):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=2, decay_rate=0.8)
    if kind == "adam":
        return zero_runtime.optim.Adam(learning_rate=schedule, **extra)
    if kind == "adamw":
        return zero_runtime.optim.AdamW(learning_rate=schedule, weight_decay=0.05, **extra)
    return zero_runtime.optim.SGD(learning_rate=schedule, momentum=0.9, **extra)


def _train(offload: str, kind: str, end_of_step: bool, tmp_path, peak: bool = False):
    """(losses, weights, update_in_backward, store updates of replica 0, iterations).
    ``peak``: also check the update queues' peak of queued gradient bytes, the largest
    block's shard per replica (a queue that admits one block at a time)."""
    tmp_path.mkdir()
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 3,
            "offload_param": "cpu",
            "offload_optimizer": offload,
            "nvme_path": str(tmp_path),
            "page_size_bytes": 65536,
            "sub_group_size": 1000,  # several NVMe sub-groups, crossing units
        }
    )
    with strategy.scope():
        model = build_gpt(CFG, seed=4)
        sharded = strategy.shard_model(model)
        extra = {"clipvalue": 1e9} if end_of_step else {}
        sharded.compile(
            optimizer=_optimizer(kind, **extra),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    x, y = _data()
    losses: list[float] = []
    cb = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"]))
    )
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    sharded.fit(ds, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    result = (
        losses,
        model.get_weights(),
        sharded.update_in_backward,
        sharded.optimizer.zero_state.store.updates(0),
        int(sharded.optimizer.iterations.numpy()),
    )
    if peak:
        largest = sharded.engine.max_block_shard_elements
        assert backward_update.peak_queued_bytes(sharded.optimizer) == 2 * 4 * largest
    sharded.close()
    strategy.close()
    return result


@pytest.mark.parametrize(("offload", "kind"), [("cpu", "adamw"), ("nvme", "adam"), ("cpu", "sgd")])
def test_update_in_backward_equals_the_end_of_step_update(offload, kind, tmp_path, cpu_devices):
    """Bitwise equal losses and weights, the same iteration count and one counted store
    update per step, whichever path updates."""
    losses, weights, in_bwd, updates, iters = _train(offload, kind, False, tmp_path / "a")
    ref_losses, ref_weights, ref_in_bwd, ref_updates, ref_iters = _train(
        offload, kind, True, tmp_path / "b"
    )
    assert in_bwd is True and ref_in_bwd is False
    assert updates == ref_updates == iters == ref_iters == STEPS
    assert len(losses) == STEPS and losses[-1] != losses[0]
    assert losses == ref_losses
    assert len(weights) == len(ref_weights)
    for w, r in zip(weights, ref_weights):
        np.testing.assert_array_equal(w, r)


def test_supported_only_where_every_shard_is_not_needed_first(tmp_path, cpu_devices):
    """Device optimizer states, accumulation and clipping take the end-of-step path."""

    def built(offload: str, **extra) -> bool:
        config = {"stage": 3, "offload_param": "cpu", "offload_optimizer": offload}
        config.update({k: v for k, v in extra.items() if k == "gradient_accumulation_steps"})
        strategy = zero_runtime.ZeroInfinityStrategy(config)
        clip = {k: v for k, v in extra.items() if k != "gradient_accumulation_steps"}
        with strategy.scope():
            model = build_gpt(CFG, seed=4)
            sharded = strategy.shard_model(model)
            opt = zero_runtime.optim.Adam(1e-3, **clip)
            opt.build(sharded.trainable_variables)
        out = backward_update.supported(opt)
        sharded.close()
        strategy.close()
        return out

    assert built("cpu") is True
    assert built("none") is False
    assert built("cpu", gradient_accumulation_steps=2) is False
    assert built("cpu", global_clipnorm=1.0) is False
    with pytest.raises(ValueError, match="offload_optimizer 'cpu' or 'nvme'"):
        backward_update.BackwardShardUpdate(zero_runtime.optim.Adam(1e-3), 0)


def _peaks(modes: tuple[str, ...], tmp_path) -> list[dict]:
    """Each mode's record, the jobs run side by side in fresh processes."""
    return run_json_jobs(
        [([JOB, str(tmp_path / f"{m}.json"), m], tmp_path / f"{m}.json") for m in modes],
        timeout=300,
    )


def test_gradient_shards_are_freed_during_backward(tmp_path):
    """The step's allocator peak with the update in backward is lower than with the
    end-of-step update by at least the gradient shards' bytes (4 x parameters, both
    replicas), with identical losses."""
    bwd, end = _peaks(("backward", "end"), tmp_path)
    print(f"step peak: update in backward {bwd['peak']} B, at the step's end {end['peak']} B")
    assert bwd["update_in_backward"] is True and end["update_in_backward"] is False
    assert bwd["params"] == end["params"] == 2_449_408
    assert bwd["losses"] == end["losses"] and len(bwd["losses"]) == 1
    assert 0 < bwd["peak"] <= end["peak"] - 4 * bwd["params"]


class _FailsInBackward(keras.layers.Layer):
    """Identity forward; its backward raises InvalidArgumentError (a real TF runtime
    error) when an input element's magnitude is >= 100 (normal data gives < 10), after
    the blocks above it have queued their updates."""

    def call(self, x):
        @tf.custom_gradient
        def ident(h):
            def grad(dy):
                ok = tf.reduce_all(tf.abs(h) < 100.0)
                with tf.control_dependencies([tf.debugging.Assert(ok, ["poisoned batch"])]):
                    return tf.identity(dy)

            return tf.identity(h), grad

        return ident(x)


def _chain() -> keras.Model:
    keras.utils.set_random_seed(2)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, name="d0"),  # linear: a huge input stays huge
            _FailsInBackward(name="fails"),
            keras.layers.Dense(16, activation="tanh", name="d1"),
            keras.layers.Dense(3, name="d2"),
        ]
    )


def test_a_step_that_fails_in_backward_leaves_the_model_usable(tmp_path, cpu_devices):
    """A step raising in backward (after d1 and d2 queued their updates): train_on_batch
    raises the TF error; recover (run by train_on_batch) waits for the queued updates
    and resets every shard, so the weights are stable, a checkpoint restores in the same
    process and training from it equals training from it in a fresh model."""
    rng = np.random.RandomState(0)
    x = rng.standard_normal((6, 8, 6)).astype("float32")
    y = rng.standard_normal((6, 8, 3)).astype("float32")
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 3,
            "offload_param": "cpu",
            "offload_optimizer": "cpu",
            "page_size_bytes": 65536,
        }
    )

    def build():
        with strategy.scope():
            sharded = strategy.shard_model(_chain())
            sharded.compile(optimizer=zero_runtime.optim.Adam(0.01), loss="mse")
        return sharded

    sharded = build()
    for i in range(2):
        sharded.train_on_batch(x[i], y[i])
    assert sharded.update_in_backward is True
    ckpt = str(tmp_path / "ckpt")
    strategy.save_checkpoint(ckpt, sharded)
    poisoned = x[2].copy()
    poisoned[:, :] = 1e4
    with pytest.raises(tf.errors.InvalidArgumentError, match="poisoned batch"):
        sharded.train_on_batch(poisoned, y[2])
    states = {v.state(r) for v in sharded.engine.variables for r in range(2)}
    assert states <= {ShardState.SHARDED, ShardState.RELEASED}
    assert sharded.recover() == {"updates_waited": 0, "gathering": 0, "gathered": 0}
    first = sharded.inner.get_weights()
    np.testing.assert_array_equal(
        np.concatenate([w.ravel() for w in first]),
        np.concatenate([w.ravel() for w in sharded.inner.get_weights()]),
    )
    strategy.load_checkpoint(ckpt, sharded)
    losses = [float(sharded.train_on_batch(x[i], y[i])) for i in (2, 3)]

    fresh = build()
    strategy.load_checkpoint(ckpt, fresh)
    ref = [float(fresh.train_on_batch(x[i], y[i])) for i in (2, 3)]
    assert losses == ref
    for w, r in zip(sharded.inner.get_weights(), fresh.inner.get_weights()):
        np.testing.assert_array_equal(w, r)
    sharded.close()
    fresh.close()
    strategy.close()


def test_gradient_bytes_accounting_is_one_block_shard(tmp_path, cpu_devices):
    """The runtime's device gradient bytes with the update in backward: the largest
    unit's shard per replica, not every shard."""
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 3,
            "offload_param": "cpu",
            "offload_optimizer": "cpu",
            "page_size_bytes": 65536,
        }
    )
    with strategy.scope():
        sharded = strategy.shard_model(build_gpt(CFG, seed=4))
        sharded.compile(optimizer=zero_runtime.optim.Adam(1e-3), loss="mse")
    x, _ = _data()
    y = np.zeros((BATCH, CFG.seq_len, CFG.vocab_size), np.float32)
    sharded.train_on_batch(x[:BATCH], y)
    engine = sharded.engine
    total = sum(v.shard_elements for v in engine.variables)
    largest = engine.max_block_shard_elements
    assert 0 < largest < total
    assert strategy.runtime.grad_bytes() == 4 * largest * 2
    sharded.close()
    strategy.close()


def _train_units(end_of_step: bool) -> tuple:
    """The tied GPT DAG (run by units) at stage 3, host parameters and Adam states:
    ``(losses, weights, update_in_backward, iterations, early, late)``."""
    strategy = zero_runtime.ZeroInfinityStrategy(
        {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu", "page_size_bytes": 65536}
    )
    try:
        with strategy.scope():
            model = am.gpt()
            extra = {"clipvalue": 1e9} if end_of_step else {}
            model.compile(
                optimizer=_optimizer("adam", **extra),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        x, y = am.gpt_data()
        hist = model.fit(x, y, batch_size=am.BATCH, epochs=2, verbose=0, shuffle=False)
        (engine,) = strategy.runtime.accounting.stage3_engines
        return (
            hist.history["loss"],
            model.get_weights(),
            engine.update_in_backward,
            int(model.optimizer.iterations.numpy()),
        )
    finally:
        strategy.close()


def test_units_path_updates_in_backward_like_the_end_of_step_update(cpu_devices):
    """A model run by units updates each original read by one use during backward and the
    tied embedding table (read by the embedding and the head) after it: bitwise the
    end-of-step update's losses and weights (which tests/test_stage3_any_model.py ties to
    MirroredStrategy)."""
    losses, weights, in_bwd, iters = _train_units(False)
    ref_losses, ref_weights, ref_in_bwd, ref_iters = _train_units(True)
    assert in_bwd is True and ref_in_bwd is False
    assert iters == ref_iters > 0
    assert losses == ref_losses and losses[-1] != losses[0]
    for w, r in zip(weights, ref_weights):
        np.testing.assert_array_equal(w, r)


def test_update_queue_waits_for_room_before_copying_a_gradient():
    """A replica's queue admits gradient copies up to its byte limit; the next host call
    waits until an update ends and gives its bytes back; a block larger than the limit
    goes alone once the queue is empty."""
    import threading

    queue = backward_update._UpdateQueue(0, limit=100)
    release = threading.Event()
    try:
        queue.admit(80)
        queue.submit(release.wait, nbytes=80)
        admitted = threading.Event()
        waiter = threading.Thread(target=lambda: (queue.admit(30), admitted.set()))
        waiter.start()
        assert not admitted.wait(0.3)  # 80 + 30 > 100: waits for the first update
        assert queue.queued_bytes == 80
        release.set()
        assert admitted.wait(10)
        waiter.join()
        assert queue.queued_bytes == 30 and queue.peak_bytes == 80
        queue.done(30)
        queue.admit(500)  # larger than the limit, admitted alone on an empty queue
        assert queue.queued_bytes == 500 and queue.peak_bytes == 500
        queue.done(500)
        assert queue.wait() is None and queue.queued_bytes == 0
    finally:
        release.set()
        queue.shutdown()


def test_bounded_update_queue_gives_the_same_weights(tmp_path, cpu_devices, monkeypatch):
    """With the queue bounded to one block at a time (the host calls wait for every
    update), the update in backward still equals the end-of-step update bitwise, and the
    queued gradient bytes peak at the largest block's shard per replica."""
    monkeypatch.setattr(backward_update, "MAX_QUEUED_BYTES", 1)
    losses, weights, in_bwd, _, iters = _train("nvme", "adam", False, tmp_path / "a", peak=True)
    ref_losses, ref_weights, _, _, ref_iters = _train("nvme", "adam", True, tmp_path / "b")
    assert in_bwd is True and iters == ref_iters == STEPS
    assert losses == ref_losses
    for w, r in zip(weights, ref_weights):
        np.testing.assert_array_equal(w, r)
