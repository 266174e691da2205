"""ZeRO stage 3: gradient accumulation and gradient clipping on gradient shards.

Accumulation: N=4 micro-batches of B at stage 3 == one step on 4B under MirroredStrategy
with Keras's own SGD (Nesterov momentum, decoupled weight decay, a learning-rate schedule
that counts optimizer steps), within 1e-6 relative, with the accumulator on the host
(offload_optimizer='cpu') and on the device ('none'). SGD is linear in the gradient; with
Adam, float32 summation-order noise in near-zero gradient elements is amplified by the
normalised update (AdamW here: max |dw| 3.9e-7 on weights ~0.05 after 4 updates).
Keras's own ``gradient_accumulation_steps`` cannot serve as the
reference: it fails under MirroredStrategy (tests/test_stage2.py) and counts micro-steps.

Clipping: stage 3 (2 replicas) clips the reduced gradient, norms across shards
(zero_runtime/stage3/clipping.py); the reference is Keras's own clipping in a
MirroredStrategy over one device, where Keras's per-replica clipping sees the whole
gradient of the global batch (with 2 replicas Keras clips each replica's gradient before
the all-reduce, which no sharded runtime can reproduce for global_clipnorm; docs).
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers.mirrored import Mirrored
from helpers.reference_optimizers import DenseGradAdam, DenseGradSGD

import zero_runtime
from demo.model import GPTConfig, build_gpt
from zero_runtime import optim

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=32)
N = 4  # micro-steps per optimizer step
MICRO = 4  # global micro-batch (2 per replica)
UPDATES = 4  # optimizer steps
CLIP_STEPS = 6
CLIP_BATCH = 8
PAGE = 65536
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@functools.cache
def _data(n: int) -> tuple[np.ndarray, np.ndarray]:
    # Learnable sequences: t[i + 1] = (5 * t[i] + 3) mod V from a random start token.
    rng = np.random.RandomState(7)
    tokens = np.zeros((n, CFG.seq_len + 1), np.int64)
    tokens[:, 0] = rng.randint(0, CFG.vocab_size, size=n)
    for i in range(CFG.seq_len):
        tokens[:, i + 1] = (5 * tokens[:, i] + 3) % CFG.vocab_size
    return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")


def _ds(n: int, batch: int) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(_data(n)).batch(batch)


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=2, decay_rate=0.7)


def _fit_stage3(config: dict, optimizer, ds) -> tuple[list, object]:
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 3,
            "page_size_bytes": PAGE,
            "collective_timeout_seconds": 20,
            "persistence_threshold": 100,
            **config,
        }
    )
    with strategy.scope():
        model = build_gpt(CFG, seed=3)
        sharded = strategy.shard_model(model)
        sharded.compile(optimizer=optimizer(), loss=LOSS)
    sharded.fit(ds, epochs=1, verbose=0, shuffle=False)
    out = {
        "iterations": int(sharded.optimizer.iterations.numpy()),
        "accumulator": sharded.accumulator,
        "pending": (
            [sharded.accumulator.pending(r) for r in (0, 1)] if sharded.accumulator else None
        ),
    }
    weights = model.get_weights()
    sharded.close()
    strategy.close()
    return weights, out


def _fit_reference(devices, optimizer, ds) -> list:
    strategy = Mirrored(devices)
    with strategy.scope():
        model = build_gpt(CFG, seed=3)
        model.compile(optimizer=optimizer(), loss=LOSS)
    model.fit(ds, epochs=1, verbose=0, shuffle=False)
    return model.get_weights()


def _sgd(cls):
    return cls(learning_rate=_schedule(), momentum=0.9, nesterov=True, weight_decay=0.01)


@pytest.fixture(scope="module")
def larger_batch_reference(cpu_devices):
    """One MirroredStrategy step on 4B per optimizer step (accumulation semantics)."""
    ds = _ds(N * MICRO * UPDATES, N * MICRO)
    return _fit_reference(cpu_devices, functools.partial(_sgd, DenseGradSGD), ds)


@pytest.mark.parametrize("offload_optimizer", ["cpu", "none"])
def test_stage3_accumulation_equals_larger_batch(offload_optimizer, larger_batch_reference):
    """N=4 micro-batches of 4 at stage 3 == one step of 16 (params on the host)."""
    weights, out = _fit_stage3(
        {
            "offload_param": "cpu",
            "offload_optimizer": offload_optimizer,
            "gradient_accumulation_steps": N,
        },
        functools.partial(_sgd, optim.SGD),
        _ds(N * MICRO * UPDATES, MICRO),
    )
    acc = out["accumulator"]
    assert out["iterations"] == N * UPDATES  # Keras's counter counts micro-steps
    assert acc.tier == {"cpu": "host", "none": "device"}[offload_optimizer]
    # One shard per local replica, never a full gradient: 4 * shard_size bytes each.
    total = sum(int(np.prod(w.shape)) for w in weights)
    assert acc.shard_size < total and acc.nbytes == 2 * 4 * acc.shard_size
    assert all(not p.any() for p in out["pending"])  # emptied by the last update
    initial = build_gpt(CFG, seed=3).get_weights()
    worst = max(
        float(np.max(np.abs(w - r) / np.maximum(np.abs(r), 1e-1)))
        for w, r in zip(weights, larger_batch_reference)
    )
    print(f"stage 3 accumulation ({offload_optimizer}): max rel weight diff {worst:.3g}")
    for w, r in zip(weights, larger_batch_reference):
        np.testing.assert_allclose(w, r, rtol=1e-6, atol=1e-7)
    moved = [not np.allclose(w, w0, rtol=0, atol=1e-4) for w, w0 in zip(weights, initial)]
    assert sum(moved) > len(moved) // 2  # it trained (zero-initialised biases barely move)


CLIPS = {"clipnorm": 0.05, "global_clipnorm": 0.1, "clipvalue": 0.002}


@functools.cache
def _first_gradient() -> list[np.ndarray]:
    """The gradient of the first global batch's loss at the initial weights (plain Keras)."""
    model = build_gpt(CFG, seed=3)
    x, y = (t[:CLIP_BATCH] for t in _data(CLIP_STEPS * CLIP_BATCH))
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    return [np.asarray(tf.convert_to_tensor(g)) for g in grads]


def _clipping_bites(kind: str) -> bool:
    """True when ``kind`` changes the first step's gradient (so the test tests it)."""
    grads = _first_gradient()
    if kind == "clipvalue":
        return max(float(np.abs(g).max()) for g in grads) > CLIPS[kind]
    if kind == "clipnorm":
        return max(float(np.linalg.norm(g)) for g in grads) > CLIPS[kind]
    return float(np.sqrt(sum(float(np.sum(g * g)) for g in grads))) > CLIPS[kind]


@pytest.mark.parametrize("kind", list(CLIPS))
def test_stage3_clipping_matches_keras(kind):
    """clipnorm / global_clipnorm / clipvalue at stage 3 (2 replicas, params on the host)
    == Keras's own clipping of the global batch's gradient: ``max |dw| <= 1e-4 max |w|``
    per variable (docs/parity.md's stage-3 bound), or 1e-6 for a variable that stays at
    rounding noise (the attention key bias, |w| ~ 1e-7: its gradient is zero in exact
    arithmetic).
    Element-wise, a weight near zero differs by rounding: clipvalue's weights differed by
    1.07e-6 at -6.3e-4 in one run, 4e-5 of that variable's largest weight."""
    ds = _ds(CLIP_STEPS * CLIP_BATCH, CLIP_BATCH)
    kw = {"learning_rate": 0.01, kind: CLIPS[kind]}
    ref = _fit_reference(("/cpu:0",), lambda: DenseGradAdam(**kw), ds)
    weights, _ = _fit_stage3(
        {"offload_param": "cpu", "offload_optimizer": "cpu"},
        lambda: optim.Adam(**kw),
        ds,
    )
    assert _clipping_bites(kind)  # the threshold is below the gradient's own figure
    worst = max(
        float(np.max(np.abs(w - r) / np.maximum(np.abs(r), 1e-1))) for w, r in zip(weights, ref)
    )
    print(f"stage 3 {kind}={CLIPS[kind]}: max rel weight diff {worst:.3g}")
    for w, r in zip(weights, ref):
        assert float(np.max(np.abs(w - r))) <= max(1e-4 * float(np.max(np.abs(r))), 1e-6), (w, r)


def test_stage3_accumulation_with_global_clipnorm(cpu_devices):
    """N=2 + global_clipnorm at stage 3 == Keras clipping the gradient of the 2x batch."""
    n, micro, steps = 2, CLIP_BATCH // 2, 3
    kw = {"learning_rate": 0.01, "global_clipnorm": CLIPS["global_clipnorm"]}
    ref = _fit_reference(
        ("/cpu:0",), lambda: DenseGradAdam(**kw), _ds(n * micro * steps, n * micro)
    )
    weights, out = _fit_stage3(
        {"offload_param": "none", "offload_optimizer": "cpu", "gradient_accumulation_steps": n},
        lambda: optim.Adam(**kw),
        _ds(n * micro * steps, micro),
    )
    assert out["iterations"] == n * steps
    for w, r in zip(weights, ref):
        np.testing.assert_allclose(w, r, rtol=1e-5, atol=1e-6)
