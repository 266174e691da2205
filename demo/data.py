"""Byte-level language-modelling data from the Python standard library's own source.

Every machine that runs this demo has Python, so it has the standard library's ``.py``
files on disk: a few MiB of real, structured text that needs no download. Tokens are raw
bytes (vocabulary :data:`VOCAB_SIZE` = 256, no tokenizer), so the model's output layer has
256 logits and a uniform guess costs ``ln(256) ~= 5.545`` nats per byte.

Vocabulary used below:

- *corpus*: a 1-D ``uint8`` array of bytes, the files concatenated (:func:`load_corpus`).
- *window*: ``seq_len + 1`` consecutive corpus bytes; its first ``seq_len`` bytes are the
  input ``x`` and its last ``seq_len`` bytes the target ``y`` (``y[t] == x[t + 1]``).
  Windows start at multiples of ``seq_len``, so consecutive windows share one byte and
  together cover the corpus once (:func:`make_dataset`).

The corpus depends on the Python installation (its version's standard library); for one
installation, every function here is a pure function of its arguments.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import NamedTuple

import numpy as np
import tensorflow as tf

# Number of distinct tokens: one per byte value.
VOCAB_SIZE = 256

# Default corpus budget, in bytes (4 MiB; the 3.11 standard library holds ~11.5 MiB of
# eligible source, so the default is a seed-dependent subset of it).
DEFAULT_MAX_BYTES = 4 << 20

# Directory names skipped anywhere under the standard library: third-party packages, and
# the test suites (which some distributions ship separately, so leaving them out keeps
# the corpus closer to identical across installs of one Python version, and which include
# deliberately malformed files).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


class CorpusSplit(NamedTuple):
    """A corpus cut in two contiguous pieces (see :func:`split_corpus`).

    Attributes:
        train: 1-D ``uint8``, the leading ``len(corpus) - len(validation)`` bytes.
        validation: 1-D ``uint8``, the trailing bytes.
    """

    train: np.ndarray
    validation: np.ndarray


def stdlib_root() -> Path:
    """Return the directory of this interpreter's standard library.

    Returns:
        ``Path(sysconfig.get_paths()["stdlib"])``, e.g. ``/usr/lib/python3.11``.
    """
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_sources(seed: int = 0, root: Path | None = None) -> list[Path]:
    """List the standard library's ``.py`` files in a deterministic, seed-shuffled order.

    Files are collected under ``root`` without following symbolic links, skipping any
    directory named in :data:`EXCLUDED_DIRS`, sorted by their path relative to ``root``
    (so the result does not depend on file-system enumeration order), then permuted with
    ``numpy.random.default_rng(seed)`` so that a byte budget smaller than the whole library
    takes files from all over it rather than only the alphabetically first packages.

    Args:
        seed: Seed of the permutation; any non-negative int. Default 0.
        root: Directory to scan; default :func:`stdlib_root`.

    Returns:
        Absolute paths, in corpus order.

    Raises:
        ValueError: If ``seed`` is negative.
        FileNotFoundError: If no eligible ``.py`` file exists under ``root``.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got seed={seed}")
    root = stdlib_root() if root is None else Path(root)
    relative: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                relative.append(os.path.relpath(os.path.join(dirpath, name), root))
    if not relative:
        raise FileNotFoundError(f"no eligible .py files under {root}")
    relative.sort()
    order = np.random.default_rng(seed).permutation(len(relative))
    return [root / relative[i] for i in order]


def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES, seed: int = 0) -> np.ndarray:
    """Load up to ``max_bytes`` bytes of standard-library Python source.

    The files of :func:`list_stdlib_sources` (``seed``) are concatenated, unmodified, in
    that order until the budget is reached; the last file is cut at the budget.

    Args:
        max_bytes: Budget in bytes, >= 1. Default :data:`DEFAULT_MAX_BYTES` (4 MiB).
        seed: Chooses the file order, hence which files fill the budget. Default 0.

    Returns:
        1-D ``uint8`` array of length ``min(max_bytes, total eligible bytes)``; the same
        array for the same arguments on the same Python installation.

    Raises:
        ValueError: If ``max_bytes < 1`` or ``seed < 0``.
        FileNotFoundError: If the standard library has no eligible ``.py`` files.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got max_bytes={max_bytes}")
    chunks: list[bytes] = []
    remaining = max_bytes
    for path in list_stdlib_sources(seed):
        if remaining == 0:
            break
        data = path.read_bytes()[:remaining]
        chunks.append(data)
        remaining -= len(data)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()


def split_corpus(corpus: np.ndarray, val_fraction: float = 0.1) -> CorpusSplit:
    """Cut a corpus into a leading training piece and a trailing validation piece.

    The pieces are contiguous and disjoint, so no validation window overlaps a training
    window. The validation piece has ``round(len(corpus) * val_fraction)`` bytes.

    Args:
        corpus: 1-D ``uint8`` array, as from :func:`load_corpus`.
        val_fraction: Fraction of bytes for validation, in the open interval (0, 1).
            Default 0.1.

    Returns:
        :class:`CorpusSplit` of two views into ``corpus`` (no copy).

    Raises:
        TypeError: If ``corpus`` is not a 1-D ``uint8`` numpy array.
        ValueError: If ``val_fraction`` is outside (0, 1), or either piece would be empty.
    """
    _check_corpus(corpus)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got val_fraction={val_fraction}")
    n_val = int(round(len(corpus) * val_fraction))
    if n_val == 0 or n_val == len(corpus):
        raise ValueError(
            f"val_fraction={val_fraction} of a {len(corpus)}-byte corpus leaves an empty "
            f"piece ({len(corpus) - n_val} train, {n_val} validation bytes)"
        )
    cut = len(corpus) - n_val
    return CorpusSplit(train=corpus[:cut], validation=corpus[cut:])


def make_dataset(
    corpus: np.ndarray,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    repeat: bool = True,
) -> tf.data.Dataset:
    """Build a shuffled next-byte-prediction dataset over a corpus.

    The corpus is cut into ``n = (len(corpus) - 1) // seq_len`` windows of ``seq_len + 1``
    bytes starting at ``0, seq_len, 2 * seq_len, ...`` (trailing bytes that do not fill a
    window are unused). Each pass over the windows (an *epoch* of the data, unrelated to
    Keras' ``steps_per_epoch``) visits every window once in an order given by
    ``tf.random.experimental.stateless_shuffle`` keyed on ``(seed, pass index)``: the
    stream is the same on every run for a given ``seed``, whatever TensorFlow's global seed.
    Windows are then batched with ``drop_remainder=True``; with ``repeat=True`` a batch may
    straddle two passes.

    Args:
        corpus: 1-D ``uint8`` array of bytes, as from :func:`load_corpus`.
        seq_len: Tokens per example (T), >= 1.
        batch_size: Examples per batch (B), >= 1.
        seed: Shuffle seed, any int. Default 0.
        repeat: If True (default), pass over the windows forever, reshuffling each pass;
            if False, one pass of ``n // batch_size`` batches (for validation).

    Returns:
        A ``tf.data.Dataset`` of ``(x, y)`` pairs, both ``int32`` of shape
        ``[batch_size, seq_len]`` with values in ``[0, 256)``, where
        ``y[:, t] == corpus[start + t + 1]`` for ``x[:, t] == corpus[start + t]``.

    Raises:
        TypeError: If ``corpus`` is not a 1-D ``uint8`` numpy array.
        ValueError: If ``seq_len < 1``, ``batch_size < 1``, the corpus is shorter than
            ``seq_len + 1`` bytes, or ``repeat=False`` and there are fewer than
            ``batch_size`` windows (the single pass would yield no batch).
    """
    _check_corpus(corpus)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got seq_len={seq_len}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got batch_size={batch_size}")
    if len(corpus) < seq_len + 1:
        raise ValueError(
            f"corpus of {len(corpus)} bytes is shorter than seq_len + 1 = {seq_len + 1}"
        )
    n_windows = (len(corpus) - 1) // seq_len
    if not repeat and n_windows < batch_size:
        raise ValueError(
            f"corpus of {len(corpus)} bytes gives {n_windows} windows of seq_len + 1 = "
            f"{seq_len + 1} bytes, fewer than batch_size={batch_size}, so one pass "
            "(repeat=False) yields no batch"
        )

    # (n, T + 1) uint8: window i is corpus[i * T : i * T + T + 1]; copied so the graph
    # constant does not alias the caller's array.
    windows = np.lib.stride_tricks.sliding_window_view(corpus, seq_len + 1)[::seq_len]
    windows = np.ascontiguousarray(windows[:n_windows])
    windows_t = tf.constant(windows)

    def pass_order(pass_index: tf.Tensor) -> tf.data.Dataset:
        key = tf.stack([tf.constant(seed, tf.int64), pass_index])
        order = tf.random.experimental.stateless_shuffle(tf.range(n_windows), seed=key)
        return tf.data.Dataset.from_tensor_slices(order)

    passes = tf.data.Dataset.counter() if repeat else tf.data.Dataset.range(1)  # int64
    indices = passes.flat_map(pass_order)

    def to_example(batch_indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        batch = tf.cast(tf.gather(windows_t, batch_indices), tf.int32)  # (B, T + 1)
        return batch[:, :-1], batch[:, 1:]  # (B, T), (B, T)

    # flat_map hides the length; state it so Keras can count steps (Keras 3.15's evaluate()
    # on a finite dataset of unknown cardinality averages in one empty extra step).
    n_batches = tf.data.INFINITE_CARDINALITY if repeat else n_windows // batch_size
    return (
        indices.batch(batch_size, drop_remainder=True)
        .apply(tf.data.experimental.assert_cardinality(n_batches))
        .map(to_example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        .prefetch(tf.data.AUTOTUNE)
    )


def _check_corpus(corpus: np.ndarray) -> None:
    """Raise TypeError unless ``corpus`` is a 1-D ``uint8`` numpy array."""
    if not isinstance(corpus, np.ndarray) or corpus.dtype != np.uint8 or corpus.ndim != 1:
        desc = (
            f"{type(corpus).__name__} of dtype {corpus.dtype}, shape {corpus.shape}"
            if isinstance(corpus, np.ndarray)
            else type(corpus).__name__
        )
        raise TypeError(f"corpus must be a 1-D uint8 numpy array, got {desc}")
