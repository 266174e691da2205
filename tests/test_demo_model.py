"""Tests of the demo's data pipeline (demo.data) and GPT model (demo.model)."""

from __future__ import annotations

import math
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from demo import data, model

# A model small enough to build, run and train in a few seconds on one CPU core.
TINY = model.GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=2, n_layers=1, d_ff=64)


def gpt_param_count(c: model.GPTConfig) -> int:
    """Parameters of build_gpt(c), counted by hand from the architecture."""
    v, t, d, f, n = c.vocab_size, c.seq_len, c.d_model, c.d_ff, c.n_layers
    embedding = v * d + t * d  # token table + position table
    attention = 4 * (d * d + d)  # query, key, value, output kernels (heads * head width = d)
    mlp = (d * f + f) + (f * d + d)
    norms = 2 * (2 * d)  # two LayerNorms, gamma and beta
    block = attention + mlp + norms
    return embedding + n * block + 2 * d + (d * v + v)  # + final norm + lm head


def tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
    """Random int32 tokens of shape (batch, length)."""
    return np.random.default_rng(seed).integers(0, 256, (batch, length)).astype(np.int32)


@pytest.fixture(scope="module")
def tiny_gpt() -> keras.Model:
    return model.build_gpt(TINY, seed=0)


# --- data -------------------------------------------------------------------------------


def test_corpus_is_deterministic_stdlib_source() -> None:
    corpus = data.load_corpus(max_bytes=200_000, seed=0)
    assert corpus.dtype == np.uint8 and corpus.shape == (200_000,)
    np.testing.assert_array_equal(corpus, data.load_corpus(max_bytes=200_000, seed=0))
    text = corpus.tobytes()
    assert b"def " in text and b"import " in text and b"return " in text
    first_file = data.list_stdlib_sources(seed=0)[0].read_bytes()
    assert text.startswith(first_file[:200_000])  # files are concatenated unmodified
    assert not np.array_equal(corpus, data.load_corpus(max_bytes=200_000, seed=1))


def test_corpus_files_come_from_the_stdlib_and_skip_tests() -> None:
    files = data.list_stdlib_sources()
    root = data.stdlib_root()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert all(f.is_relative_to(root) for f in files)
    assert not any(set(f.relative_to(root).parts) & data.EXCLUDED_DIRS for f in files)
    assert root / "os.py" in files


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"max_bytes": 0}, "max_bytes=0"), ({"seed": -1}, "seed=-1")]
)
def test_load_corpus_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        data.load_corpus(**kwargs)


def test_split_corpus_is_contiguous_and_disjoint() -> None:
    corpus = np.arange(100, dtype=np.uint8)
    split = data.split_corpus(corpus, val_fraction=0.25)
    assert len(split.train) == 75 and len(split.validation) == 25
    np.testing.assert_array_equal(np.concatenate(split), corpus)
    with pytest.raises(ValueError, match="val_fraction=1.5"):
        data.split_corpus(corpus, val_fraction=1.5)
    with pytest.raises(ValueError, match="empty"):
        data.split_corpus(corpus[:3], val_fraction=0.1)


def test_dataset_shapes_dtypes_and_shift_by_one() -> None:
    # Byte i of this corpus is i, so a value names its own position.
    corpus = np.arange(200, dtype=np.uint8)
    ds = data.make_dataset(corpus, seq_len=8, batch_size=4, seed=0, repeat=False)
    batches = list(ds)
    assert len(batches) == ds.cardinality() == (199 // 8) // 4 == 6
    starts = []
    for x, y in batches:
        assert x.dtype == y.dtype == tf.int32
        assert x.shape == y.shape == (4, 8)
        x, y = x.numpy(), y.numpy()
        np.testing.assert_array_equal(y, x + 1)  # y[t] is the byte after x[t]
        np.testing.assert_array_equal(x, x[:, :1] + np.arange(8))  # contiguous windows
        starts.extend(x[:, 0])
    # One pass visits each window (starts 0, 8, ..., 184) exactly once, shuffled.
    assert sorted(starts) == list(range(0, 24 * 8, 8))
    assert starts != sorted(starts)


def test_dataset_is_deterministic_and_reshuffles_each_pass() -> None:
    corpus = np.arange(200, dtype=np.uint8)

    def first_starts(seed: int, n_batches: int) -> list[int]:
        ds = data.make_dataset(corpus, seq_len=8, batch_size=4, seed=seed)
        return [int(s) for x, _ in ds.take(n_batches) for s in x.numpy()[:, 0]]

    run = first_starts(seed=7, n_batches=12)  # two passes of 24 windows
    tf.random.set_seed(123)  # the order must not depend on TensorFlow's global seed
    assert run == first_starts(seed=7, n_batches=12)
    assert run != first_starts(seed=8, n_batches=12)
    assert sorted(run[:24]) == sorted(run[24:]) and run[:24] != run[24:]


@pytest.mark.parametrize(
    ("corpus", "kwargs", "error", "message"),
    [
        (np.zeros(100, np.uint8), {"seq_len": 0}, ValueError, "seq_len=0"),
        (np.zeros(100, np.uint8), {"batch_size": 0}, ValueError, "batch_size=0"),
        (np.zeros(8, np.uint8), {"seq_len": 8}, ValueError, "8 bytes.*seq_len \\+ 1 = 9"),
        (np.zeros(20, np.uint8), {"batch_size": 3, "repeat": False}, ValueError, "2 windows"),
        (np.zeros(100, np.int32), {}, TypeError, "dtype int32"),
        (np.zeros((10, 10), np.uint8), {}, TypeError, "shape \\(10, 10\\)"),
    ],
)
def test_make_dataset_rejects_bad_arguments(
    corpus: np.ndarray, kwargs: dict, error: type, message: str
) -> None:
    args = {"seq_len": 8, "batch_size": 2, **kwargs}
    with pytest.raises(error, match=message):
        data.make_dataset(corpus, **args)


# --- model ------------------------------------------------------------------------------


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="d_model=30 must be a multiple of n_heads=4"):
        model.GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_layers=0"):
        model.GPTConfig(n_layers=0)
    with pytest.raises(ValueError, match="dropout=1.0"):
        model.GPTConfig(dropout=1.0)


def test_output_shape_and_blocks(tiny_gpt: keras.Model) -> None:
    logits = np.asarray(tiny_gpt(tokens(3, TINY.seq_len)))
    assert logits.shape == (3, TINY.seq_len, 256) and logits.dtype == np.float32
    assert np.asarray(tiny_gpt(tokens(3, 5))).shape == (3, 5, 256)  # shorter inputs work
    names = [layer.name for layer in tiny_gpt.layers]
    assert names == ["embedding", "block_0", "final_norm", "lm_head"]


@pytest.mark.parametrize("config", [TINY, model.GPTConfig()], ids=["tiny", "default"])
def test_param_count_matches_formula(config: model.GPTConfig) -> None:
    gpt = model.build_gpt(config)
    assert gpt.count_params() == gpt_param_count(config)
    by_block = model.count_params_by_block(gpt)
    assert sum(by_block.values()) == gpt.count_params()
    d, v = config.d_model, config.vocab_size
    assert by_block["embedding"] == v * d + config.seq_len * d
    assert by_block["lm_head"] == d * v + v


def test_default_param_count() -> None:
    assert gpt_param_count(model.GPTConfig()) == 137_216


def test_weights_are_deterministic_for_a_seed(tiny_gpt: keras.Model) -> None:
    tf.random.set_seed(99)  # global state must not matter
    again = model.build_gpt(TINY, seed=0)
    for a, b in zip(tiny_gpt.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(a, b)
    other = model.build_gpt(TINY, seed=1)
    assert not np.array_equal(tiny_gpt.get_weights()[0], other.get_weights()[0])
    attention = tiny_gpt.get_layer("block_0").attention
    q, k = attention.query_dense.kernel.numpy(), attention.key_dense.kernel.numpy()
    assert not np.allclose(q, k)  # each projection has its own seed
    assert abs(float(q.std()) - model.INIT_STD) < 0.005


def test_attention_is_causal(tiny_gpt: keras.Model) -> None:
    x = tokens(2, TINY.seq_len)
    changed = x.copy()
    k = 9
    changed[:, k] = (changed[:, k] + 1) % 256
    before, after = np.asarray(tiny_gpt(x)), np.asarray(tiny_gpt(changed))
    np.testing.assert_allclose(after[:, :k], before[:, :k], rtol=0, atol=1e-6)
    assert np.abs(after[:, k:] - before[:, k:]).max(axis=-1).min() > 1e-4


def test_save_load_round_trip(tiny_gpt: keras.Model, tmp_path: Path) -> None:
    path = tmp_path / "gpt.keras"
    tiny_gpt.save(path)
    loaded = keras.saving.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in tiny_gpt.layers]
    x = tokens(2, TINY.seq_len)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(tiny_gpt(x)))


@pytest.mark.slow
def test_thirty_steps_of_fit_reduce_the_loss() -> None:
    corpus = data.load_corpus(max_bytes=256 << 10)
    split = data.split_corpus(corpus, val_fraction=0.1)
    train = data.make_dataset(split.train, TINY.seq_len, batch_size=16, seed=0)
    val = data.make_dataset(split.validation, TINY.seq_len, batch_size=32, repeat=False).take(8)
    gpt = model.build_gpt(TINY)
    gpt.compile(optimizer="adam", loss=model.make_loss())
    before = gpt.evaluate(val, verbose=0)
    assert abs(before - math.log(256)) < 0.15  # a fresh model is close to uniform
    gpt.fit(train, steps_per_epoch=30, epochs=1, shuffle=False, verbose=0)
    after = gpt.evaluate(val, verbose=0)
    assert after < before - 1.0, (before, after)
