"""A small GPT-style decoder-only language model in plain Keras 3.

The model is a ``keras.Sequential`` of top-level blocks, so that a sharding runtime can
treat each entry of ``model.layers`` as one unit to gather, run and release::

    model.layers == [embedding, block_0, ..., block_{L-1}, final_norm, lm_head]

    tokens  (B, T) int32 in [0, vocab_size)
    -> TokenAndPositionEmbedding   (B, T, C)
    -> TransformerBlock x L        (B, T, C)   pre-LayerNorm, causal self-attention, GELU MLP
    -> LayerNormalization          (B, T, C)
    -> Dense(vocab_size)           (B, T, V)   logits (no softmax)

B is the batch, T the sequence length (<= ``seq_len``), C = ``d_model``, V = ``vocab_size``.
Train it with ``keras.losses.SparseCategoricalCrossentropy(from_logits=True)`` (see
:func:`make_loss`) on next-token targets.

This module holds no sharding or distribution code; the training script wraps it.

Weights are deterministic for a ``seed``: every weight gets its own seeded Keras
initializer, whose integer seed is derived from ``seed`` and the weight's place in the
model (:func:`derive_seed`). No global random state is read or changed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np
from keras import ops

# Standard deviation of the normal initializer for embeddings and kernels (GPT-2's value).
INIT_STD = 0.02

# LayerNormalization epsilon (GPT-2's value).
LAYER_NORM_EPSILON = 1e-5

_PACKAGE = "zero_infinity_demo"


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model; the defaults make a ~137k-parameter model that trains on CPU.

    Attributes:
        vocab_size: Number of tokens (V). Default 256: one per byte, matching
            ``demo.data.VOCAB_SIZE``.
        seq_len: Longest input, in tokens (T); the number of learned positions.
            Default 64.
        d_model: Width of the residual stream (C). Default 64.
        n_heads: Attention heads; must divide ``d_model`` (head width ``d_model //
            n_heads``). Default 4, so 16-wide heads.
        n_layers: Transformer blocks (L). Default 2.
        d_ff: Hidden width of each block's MLP. Default 256 (the usual 4 * d_model).
        dropout: Dropout rate in [0, 1) after attention weights, attention output and MLP
            output. Default 0.0: the demo is too small and short to overfit.
    """

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    dropout: float = 0.0

    def __post_init__(self) -> None:
        """Validate the fields.

        Raises:
            ValueError: If a size is < 1, ``d_model`` is not a multiple of ``n_heads``, or
                ``dropout`` is outside [0, 1).
        """
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got dropout={self.dropout}")


def derive_seed(seed: int, *path: int) -> int:
    """Derive an independent integer seed for one weight from a model seed.

    Keras initializers seeded with the same integer produce the same values, so each
    weight needs its own seed. ``path`` names the weight's place (block index, weight
    index); the result mixes it with ``seed`` through ``numpy.random.SeedSequence``.

    Args:
        seed: Model seed, >= 0.
        *path: Non-negative ints locating the weight.

    Returns:
        An int in ``[0, 2**31)``, the same for the same arguments.

    Raises:
        ValueError: If ``seed`` or an element of ``path`` is negative.
    """
    if seed < 0 or any(p < 0 for p in path):
        raise ValueError(f"seed and path must be >= 0, got seed={seed}, path={path}")
    state = np.random.SeedSequence([seed, *path]).generate_state(1)[0]
    return int(state) & 0x7FFFFFFF


def _normal(std: float, seed: int) -> keras.initializers.Initializer:
    """Return a seeded ``RandomNormal(0, std)`` initializer."""
    return keras.initializers.RandomNormal(mean=0.0, stddev=std, seed=seed)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding plus a learned absolute position embedding.

    Input ``(B, T)`` integer tokens in ``[0, vocab_size)`` with ``T <= seq_len``; output
    ``(B, T, d_model)`` float, ``token_table[tokens] + position_table[:T]``. Both tables are
    initialized from ``N(0, INIT_STD**2)``.

    Args:
        vocab_size: Number of tokens (rows of the token table).
        seq_len: Number of positions (rows of the position table).
        d_model: Embedding width.
        seed: Weight seed, >= 0. Default 0.
        **kwargs: Passed to ``keras.layers.Layer`` (``name``, ``dtype``, ...).
    """

    def __init__(
        self, vocab_size: int, seq_len: int, d_model: int, seed: int = 0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.d_model = d_model
        self.seed = seed
        self.token_embedding = keras.layers.Embedding(
            vocab_size,
            d_model,
            embeddings_initializer=_normal(INIT_STD, derive_seed(seed, 0)),
            dtype=self.dtype_policy,
            name="token_embedding",
        )

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        """Create the tables. ``input_shape`` is ``(B, T)``."""
        self.token_embedding.build(input_shape)
        self.position_embedding = self.add_weight(
            shape=(self.seq_len, self.d_model),  # (T_max, C)
            initializer=_normal(INIT_STD, derive_seed(self.seed, 1)),
            name="position_embedding",
        )

    def call(self, tokens: Any) -> Any:
        """Embed ``tokens`` ``(B, T)`` int to ``(B, T, C)``.

        Raises:
            ValueError: If the static ``T`` exceeds ``seq_len``.
        """
        static_t = tokens.shape[-1]
        if static_t is not None and static_t > self.seq_len:
            raise ValueError(f"input length T={static_t} exceeds seq_len={self.seq_len}")
        t = ops.shape(tokens)[-1]
        positions = ops.take(self.position_embedding, ops.arange(t), axis=0)  # (T, C)
        return self.token_embedding(tokens) + positions  # (B, T, C) + (T, C) -> (B, T, C)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple:
        """``(B, T)`` -> ``(B, T, d_model)``."""
        return (*input_shape, self.d_model)

    def get_config(self) -> dict[str, Any]:
        """Return the constructor arguments, for saving."""
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "d_model": self.d_model,
            "seed": self.seed,
        }


@keras.saving.register_keras_serializable(package=_PACKAGE)
class TransformerBlock(keras.layers.Layer):
    """One pre-LayerNorm decoder block: causal self-attention and a GELU MLP, with residuals.

    ``x = x + Dropout(CausalSelfAttention(LayerNorm(x)))``;
    ``x = x + Dropout(Dense(d_model)(gelu(Dense(d_ff)(LayerNorm(x)))))``.

    Input and output are ``(B, T, d_model)`` float. Position ``t`` of the output depends
    only on positions ``<= t`` of the input (``use_causal_mask=True``).

    Kernels are initialized from ``N(0, INIT_STD**2)``, except the two that write into the
    residual stream (attention output, MLP output), which use ``residual_std`` (GPT-2 scales
    them by ``1 / sqrt(2 * n_layers)`` so the stream's variance does not grow with depth);
    biases are zero, LayerNorms are identity.

    Args:
        d_model: Width of the residual stream (C); a multiple of ``n_heads``.
        n_heads: Attention heads, each ``d_model // n_heads`` wide.
        d_ff: Hidden width of the MLP.
        dropout: Dropout rate in [0, 1). Default 0.0.
        residual_std: Init standard deviation of the residual-writing kernels.
            Default ``INIT_STD``.
        seed: Weight and dropout seed, >= 0. Default 0.
        **kwargs: Passed to ``keras.layers.Layer`` (``name``, ``dtype``, ...).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        residual_std: float = INIT_STD,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_ff = d_ff
        self.dropout = dropout
        self.residual_std = residual_std
        self.seed = seed
        policy = self.dtype_policy
        self.attn_norm = keras.layers.LayerNormalization(
            epsilon=LAYER_NORM_EPSILON, dtype=policy, name="attn_norm"
        )
        # The kernel initializer given here is replaced in build(): MultiHeadAttention
        # clones one initializer for the query, key and value projections, so a seeded
        # initializer would give all three the same values.
        self.attention = keras.layers.MultiHeadAttention(
            num_heads=n_heads,
            key_dim=d_model // n_heads,
            dropout=dropout,
            kernel_initializer=_normal(INIT_STD, derive_seed(seed, 0)),
            seed=derive_seed(seed, 1),
            dtype=policy,
            name="attention",
        )
        self.attn_dropout = keras.layers.Dropout(
            dropout, seed=derive_seed(seed, 2), dtype=policy, name="attn_dropout"
        )
        self.mlp_norm = keras.layers.LayerNormalization(
            epsilon=LAYER_NORM_EPSILON, dtype=policy, name="mlp_norm"
        )
        self.mlp_in = keras.layers.Dense(
            d_ff,
            activation="gelu",
            kernel_initializer=_normal(INIT_STD, derive_seed(seed, 3)),
            dtype=policy,
            name="mlp_in",
        )
        self.mlp_out = keras.layers.Dense(
            d_model,
            kernel_initializer=_normal(residual_std, derive_seed(seed, 4)),
            dtype=policy,
            name="mlp_out",
        )
        self.mlp_dropout = keras.layers.Dropout(
            dropout, seed=derive_seed(seed, 5), dtype=policy, name="mlp_dropout"
        )

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        """Create all weights. ``input_shape`` is ``(B, T, d_model)``."""
        self.attn_norm.build(input_shape)
        self.attention.build(input_shape, input_shape)
        projections = [
            (self.attention.query_dense, INIT_STD),
            (self.attention.key_dense, INIT_STD),
            (self.attention.value_dense, INIT_STD),
            (self.attention.output_dense, self.residual_std),
        ]
        for index, (dense, std) in enumerate(projections):
            kernel = dense.kernel  # query/key/value (C, H, C/H); output (H, C/H, C)
            init = _normal(std, derive_seed(self.seed, 6, index))
            kernel.assign(init(kernel.shape, kernel.dtype))
        self.mlp_norm.build(input_shape)
        self.mlp_in.build(input_shape)
        self.mlp_out.build((*input_shape[:-1], self.d_ff))

    def call(self, x: Any, training: bool | None = None) -> Any:
        """Apply the block to ``x`` ``(B, T, C)``; returns ``(B, T, C)``."""
        h = self.attn_norm(x)  # (B, T, C)
        h = self.attention(h, h, use_causal_mask=True, training=training)  # (B, T, C)
        x = x + self.attn_dropout(h, training=training)
        h = self.mlp_in(self.mlp_norm(x))  # (B, T, d_ff)
        h = self.mlp_out(h)  # (B, T, C)
        return x + self.mlp_dropout(h, training=training)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple:
        """The block preserves its input shape ``(B, T, C)``."""
        return tuple(input_shape)

    def get_config(self) -> dict[str, Any]:
        """Return the constructor arguments, for saving."""
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "d_ff": self.d_ff,
            "dropout": self.dropout,
            "residual_std": self.residual_std,
            "seed": self.seed,
        }


def build_gpt(config: GPTConfig | None = None, seed: int = 0) -> keras.Sequential:
    """Build an (uncompiled) GPT model as a ``keras.Sequential`` of top-level blocks.

    Layers, in order and by name: ``embedding`` (:class:`TokenAndPositionEmbedding`),
    ``block_0`` ... ``block_{n_layers-1}`` (:class:`TransformerBlock`), ``final_norm``
    (``LayerNormalization``), ``lm_head`` (``Dense(vocab_size)``, no activation). The
    model is built: all weights exist on return.

    Args:
        config: Model shape; default ``GPTConfig()``.
        seed: Weight seed, >= 0. The same ``config`` and ``seed`` give the same weights,
            independently of global random state. Default 0.

    Returns:
        A ``keras.Sequential`` named ``gpt`` mapping ``(B, T)`` int32 tokens,
        ``T <= config.seq_len``, to ``(B, T, vocab_size)`` float32 logits.

    Raises:
        ValueError: If ``seed`` is negative.
    """
    config = GPTConfig() if config is None else config
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got seed={seed}")
    # GPT-2: residual-writing projections get std / sqrt(2 * L), one per sublayer.
    residual_std = INIT_STD / math.sqrt(2 * config.n_layers)
    layers: list[keras.layers.Layer] = [
        keras.Input(shape=(None,), dtype="int32", name="tokens"),  # (B, T)
        TokenAndPositionEmbedding(
            config.vocab_size,
            config.seq_len,
            config.d_model,
            seed=derive_seed(seed, 0),
            name="embedding",
        ),
    ]
    for i in range(config.n_layers):
        layers.append(
            TransformerBlock(
                config.d_model,
                config.n_heads,
                config.d_ff,
                dropout=config.dropout,
                residual_std=residual_std,
                seed=derive_seed(seed, 1, i),
                name=f"block_{i}",
            )
        )
    layers.append(keras.layers.LayerNormalization(epsilon=LAYER_NORM_EPSILON, name="final_norm"))
    layers.append(
        keras.layers.Dense(
            config.vocab_size,
            kernel_initializer=_normal(INIT_STD, derive_seed(seed, 2)),
            name="lm_head",
        )
    )
    return keras.Sequential(layers, name="gpt")


def make_loss() -> keras.losses.Loss:
    """Return the training loss: mean next-token cross-entropy on logits, in nats.

    Returns:
        ``keras.losses.SparseCategoricalCrossentropy(from_logits=True)``; targets are
        ``(B, T)`` int token ids, predictions ``(B, T, V)`` logits. A uniform prediction
        costs ``ln(V)`` (5.545 for V = 256).
    """
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def count_params_by_block(model: keras.Model) -> dict[str, int]:
    """Count the parameters of each top-level layer of a built model.

    Args:
        model: A built model, such as one from :func:`build_gpt`.

    Returns:
        ``{layer.name: number of scalars in its weights}`` (trainable and not), in
        ``model.layers`` order; the values sum to ``model.count_params()``.

    Raises:
        ValueError: If ``model`` is not built.
    """
    if not model.built:
        raise ValueError(f"model {model.name!r} is not built; call it or build() it first")
    return {
        layer.name: int(sum(math.prod(w.shape) for w in layer.weights)) for layer in model.layers
    }
