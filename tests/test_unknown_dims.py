"""Stages 0-2 with dimensions unknown at trace time.

Two models whose gradients have shapes TensorFlow cannot know when it traces the step:

- ``dense3d``: ``Input((None, 8)) -> Dense(16) -> Dense(4)`` on 3-D input, fed numpy
  arrays of 20 samples in batches of 8 (the last batch is smaller: the batch dimension
  is None);
- ``gpt``: a small GPT-style functional transformer (token projection, one block of causal
  self-attention, an MLP, residual connections, LayerNormalization) with an unknown
  sequence length, fed batches of two sequence lengths and a smaller last batch.

Both use ``SparseCategoricalCrossentropy``, whose ``Assert`` on the unknown shapes made
stage 2's all-to-all deadlock (zero_runtime/comm/buckets.py). Each run is compared with
plain ``MirroredStrategy`` and Keras's Adam (``keras.optimizers.get("adam")``, which
resolves to the partitioned Adam inside the ZeRO scope): the weights after training are
bitwise equal. The token projection is a one-hot ``Dense`` rather than an ``Embedding``,
so Keras's own Adam sees a dense gradient (its sparse update is not Adam on the summed
gradient: tests/helpers/reference_optimizers.py).
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers.mirrored import Mirrored

import zero_runtime
from zero_runtime.optim import partitioned
from zero_runtime.optim.device_state import DeviceOptimizerState
from zero_runtime.optim.host_state import HostOptimizerState
from zero_runtime.optim.nvme_state import NvmeOptimizerState

VOCAB, WIDTH, CLASSES = 11, 16, 4
EPOCHS = 2
TIMEOUT = 20.0  # seconds: a deadlocked collective fails the case instead of hanging it
STORE = {"none": DeviceOptimizerState, "cpu": HostOptimizerState, "nvme": NvmeOptimizerState}


def _dense3d() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((None, 8))
    out = keras.layers.Dense(CLASSES, name="head")(keras.layers.Dense(16, name="hidden")(inp))
    return keras.Model(inp, out)


def _block(x, i: int):
    h = keras.layers.LayerNormalization(name=f"ln{i}a")(x)
    h = keras.layers.MultiHeadAttention(2, 8, name=f"attn{i}")(h, h, use_causal_mask=True)
    x = keras.layers.Add()([x, h])
    h = keras.layers.LayerNormalization(name=f"ln{i}b")(x)
    h = keras.layers.Dense(2 * WIDTH, activation="gelu", name=f"mlp{i}a")(h)
    return keras.layers.Add()([x, keras.layers.Dense(WIDTH, name=f"mlp{i}b")(h)])


def _gpt() -> keras.Model:
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32")  # (B, T), T unknown
    onehot = keras.layers.Lambda(lambda t: keras.ops.one_hot(t, VOCAB), output_shape=(None, VOCAB))(
        tokens
    )
    x = keras.layers.Dense(WIDTH, use_bias=False, name="tok")(onehot)  # (B, T, WIDTH)
    x = _block(x, 0)
    x = keras.layers.LayerNormalization(name="ln_f")(x)
    return keras.Model(tokens, keras.layers.Dense(VOCAB, name="lm_head")(x))


def _dense3d_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(1)
    x = rng.randn(20, 5, 8).astype("float32")
    y = rng.randint(0, CLASSES, (20, 5)).astype("int32")
    return x, y  # numpy, fit in batches of 8: 8, 8, 4 (batch None)


def _gpt_data() -> tf.data.Dataset:
    rng = np.random.RandomState(2)

    def part(n: int, length: int) -> tf.data.Dataset:
        x = rng.randint(0, VOCAB, (n, length + 1)).astype("int32")
        return tf.data.Dataset.from_tensor_slices((x[:, :-1], x[:, 1:]))

    # batch(8) without drop_remainder: 8 + 8 sequences of 7 tokens, then 4 of 5 tokens;
    # batch and sequence length None.
    return part(16, 7).batch(8).concatenate(part(4, 5).batch(8))


MODELS = {"dense3d": (_dense3d, _dense3d_data, 100), "gpt": (_gpt, _gpt_data, 800)}


def _fit(strategy, name: str) -> keras.Model:
    build, data, _ = MODELS[name]
    with strategy.scope():
        model = build()
        model.compile(
            optimizer=keras.optimizers.get("adam"),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    feed = data()
    if isinstance(feed, tuple):  # numpy whose length is not a multiple of the batch
        model.fit(*feed, batch_size=8, epochs=EPOCHS, verbose=0, shuffle=False)
    else:
        model.fit(feed, epochs=EPOCHS, verbose=0, shuffle=False)
    return model


@pytest.fixture(scope="module")
def reference(cpu_devices):
    """Weights after training under plain MirroredStrategy with Keras's Adam, per model."""

    @functools.cache
    def get(name: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
        model = _fit(Mirrored(cpu_devices), name)
        assert type(model.optimizer) is keras.optimizers.Adam
        return model.get_weights(), MODELS[name][0]().get_weights()

    return get


CASES = [
    (m, s, t)
    for m, extra in (("dense3d", (1, "nvme")), ("gpt", (2, "nvme")))
    for s, t in ((0, "none"), (1, "none"), (1, "cpu"), (2, "none"), (2, "cpu"), extra)
]


@pytest.mark.parametrize(
    ("name", "stage", "tier"), CASES, ids=[f"{m}-s{s}-{t}" for m, s, t in CASES]
)
def test_unknown_dims_bitwise_parity_with_mirrored(name, stage, tier, reference, tmp_path):
    ref_weights, initial = reference(name)
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": stage,
            "offload_optimizer": tier,
            "nvme_path": str(tmp_path),
            "reduce_bucket_size": MODELS[name][2],  # several buckets
            "collective_timeout_seconds": TIMEOUT,
        }
    )
    try:
        model = _fit(strategy, name)
        if stage:
            assert isinstance(model.optimizer, partitioned.Adam)
            zs = model.optimizer.zero_state
            assert zs.stage == stage and isinstance(zs.store, STORE[tier])
            assert len(zs.layout.buckets) > 1
            if stage == 2:
                assert zs.group.reduce_scatter_impl == "all_to_all"
        weights = model.get_weights()
    finally:
        strategy.close()
    assert any(not np.array_equal(w, w0) for w, w0 in zip(ref_weights, initial))  # trained
    for w, r in zip(weights, ref_weights):
        np.testing.assert_array_equal(w, r)
