"""Models nobody here wrote, their data and the parity measure.

Shared by ``tests/test_stage3_any_model.py`` and ``tests/test_parity_matrix.py``:

- :func:`gpt`: a GPT-style functional transformer (embedding, causal self-attention, MLP,
  residual ``Add``s, LayerNormalization) whose output head reads the embedding table
  (tied weights); tokens ``int32 (32, 6)``, targets the next tokens.
- :func:`dense3d`: ``Dense`` on 3-D input, 20 samples ``float32 (20, 5, 8)``: in batches
  of 8 the last one has 4 (the batch dimension is unknown when the step is traced).
- :func:`embed_add`: an untied ``Embedding`` feeding a ``Dense`` and a residual ``Add``
  (its gradient reaches the optimizer as ``tf.IndexedSlices`` with repeated rows); 20
  token rows ``int32 (20, 8)``, a smaller last batch.
- :func:`mobilenet`: ``keras.applications.MobileNetV3Small`` (``weights=None``, 32x32x3
  input, 4 classes, no dropout), images ``float32 (n, 32, 32, 3)`` in [0, 255).

:func:`rel` is the parity measure of docs/parity.md: ``max |w - r| / max |r|`` per variable;
:func:`check_stage3_placement` what a stage-3 run must report about where weights are.
"""

from __future__ import annotations

import keras
import numpy as np

VOCAB, WIDTH = 13, 16
BATCH = 8  # global batch: 4 per replica on the tests' 2 replicas
FLOOR = 1e-3  # smallest denominator of the relative difference (see rel)
# Stage 3 with parameters and optimizer states in host pages of 64 KiB: the stage-3 tests'
# common configuration (ZeroConfig keys).
STAGE3_HOST_CONFIG = {
    "stage": 3,
    "offload_param": "cpu",
    "offload_optimizer": "cpu",
    "page_size_bytes": 65536,
    "collective_timeout_seconds": 30,
}


class TiedHead(keras.layers.Layer):
    """Logits from the embedding table: ``x @ E^T`` (the GPT-2 tied output head)."""

    def __init__(self, embedding: keras.layers.Embedding, **kwargs) -> None:
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))  # (B, T, V)


def gpt() -> keras.Model:
    """The tied GPT: tokens ``(B, T)`` int32, T unknown -> logits ``(B, T, VOCAB)``."""
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


def gpt_data() -> tuple[np.ndarray, np.ndarray]:
    """32 random token sequences of 6 (int32) and their next tokens."""
    rng = np.random.RandomState(2)
    x = rng.randint(0, VOCAB, (4 * BATCH, 7)).astype("int32")
    return x[:, :-1], x[:, 1:]


def dense3d() -> keras.Model:
    """``(B, T, 8) -> Dense(16, relu) -> Dense(4)`` logits ``(B, T, 4)``; B and T unknown."""
    keras.utils.set_random_seed(8)
    inp = keras.Input((None, 8))
    h = keras.layers.Dense(16, activation="relu", name="hidden")(inp)
    return keras.Model(inp, keras.layers.Dense(4, name="head")(h))


def dense3d_data() -> tuple[np.ndarray, np.ndarray]:
    """20 samples (batches of 8, 8, 4): ``float32 (20, 5, 8)``, labels ``int32 (20, 5)``."""
    rng = np.random.RandomState(9)
    x = rng.standard_normal((20, 5, 8)).astype("float32")  # batches of 8, 8, 4
    return x, rng.randint(0, 4, (20, 5)).astype("int32")


def embed_add() -> keras.Model:
    """``Embedding(50, 16)`` -> ``Dense`` + residual ``Add`` -> ``Dense(50)`` logits
    ``(B, 8, 50)``; B unknown."""
    keras.utils.set_random_seed(13)
    tokens = keras.Input((8,), dtype="int32")  # (B, 8), B unknown
    x = keras.layers.Embedding(50, WIDTH, name="emb")(tokens)  # used twice below
    h = keras.layers.Dense(WIDTH, activation="relu", name="hidden")(x)
    x = keras.layers.Add()([x, h])
    return keras.Model(tokens, keras.layers.Dense(50, name="head")(x))


def embed_add_data() -> tuple[np.ndarray, np.ndarray]:
    """20 token rows ``int32 (20, 8)`` (batches of 8, 8, 4) and targets of the same shape."""
    rng = np.random.RandomState(14)
    x = rng.randint(0, 50, (20, 8)).astype("int32")  # batches of 8, 8, 4
    return x, rng.randint(0, 50, (20, 8)).astype("int32")


def mobilenet() -> keras.Model:
    """``keras.applications.MobileNetV3Small``, untrained, 32x32x3 -> 4 class probabilities."""
    keras.utils.set_random_seed(10)
    return keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=4, dropout_rate=0.0
    )


def image_data(n: int = 4 * BATCH) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random images ``float32 (n, 32, 32, 3)`` in [0, 255) and labels ``int32 (n,)``."""
    rng = np.random.RandomState(11)
    x = rng.uniform(0.0, 255.0, (n, 32, 32, 3)).astype("float32")
    return x, rng.randint(0, 4, (n,)).astype("int32")


def rel(w: np.ndarray, r: np.ndarray) -> float:
    """``max |w - r| / max |r|``; the denominator at least ``FLOOR`` (an attention key
    bias has no gradient, softmax being shift-invariant: it stays at rounding noise,
    |r| ~ 1e-9, where a ratio says nothing)."""
    return float(np.max(np.abs(w - r)) / max(float(np.max(np.abs(r))), FLOOR))


def check_stage3_placement(strategy, model: keras.Model) -> None:
    """Assert what a stage-3 run of ``model`` reports: every
    trainable variable "(ZeRO-3)" in the placement table, every non-trainable one
    "frozen", and the device tier record's parameter bytes = the pool's parameter pages
    + the frozen weights' bytes on each local replica (they are replicated there).

    Raises:
        AssertionError: naming the first mismatch.
    """
    rows = strategy.runtime.placement()["variables"]
    sharded = {r["name"] for r in rows if "(ZeRO-3)" in r["partitioning"]}
    assert sharded == {v.path for v in model.trainable_variables}, sharded
    frozen = {r["name"] for r in rows if r["partitioning"].startswith("frozen")}
    assert frozen == {v.path for v in model.weights if not v.trainable}, frozen
    frozen_bytes = sum(
        np.dtype(v.dtype).itemsize * int(np.prod(v.shape)) for v in model.weights if not v.trainable
    )
    (engine,) = strategy.runtime.accounting.stage3_engines
    assert engine.frozen_bytes == frozen_bytes
    device = strategy.runtime.recorder.last(1)[0].tiers["device"]
    pool_param = engine.last_step.usage["device"].bytes_by_kind.get("param", 0)
    assert device.param_bytes == pool_param + frozen_bytes * strategy.num_replicas_in_sync
