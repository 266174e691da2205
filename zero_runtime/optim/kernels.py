"""Host (numpy) update kernels, bit-for-bit equal to Keras 3's TensorFlow updates.

Each kernel updates one shard in place. The operation order follows Keras's own
``update_step`` (for Adam ``m += (g - m) * (1 - beta_1)``, not the textbook
``m = beta_1 * m + (1 - beta_1) * g``), because the textbook form drifts by rounding
(TF_NOTES section 4). All arrays are float32 1-D of the same length; scalars are float32.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

#: Elements per tile of a host update (float32: 256 KiB per buffer, 1.75 MiB for the
#: seven buffers of an Adam tile). Measured on the 2-core development machine
#: (bench/bench_host_adam.py): whole-array passes reach ~0.3 of the copy-bandwidth bound,
#: tiles of 16-256 Ki elements 0.45-0.6, so every pass over a tile hits the cache.
TILE_ELEMENTS = 65_536


#: Alignment of a host update's output buffer, bytes: TensorFlow's CPU allocator's
#: (``EIGEN_MAX_ALIGN_BYTES``). A ``tf.numpy_function`` output this aligned becomes the
#: output tensor's buffer as is; any other is copied (measured: numpy's own allocations
#: here are 32 bytes off).
ALIGN_BYTES = 64


def aligned_empty(n: int) -> np.ndarray:
    """An uninitialised float32 ``[n]`` array whose data starts on an :data:`ALIGN_BYTES`
    boundary (``n`` >= 0)."""
    raw = np.empty(4 * n + ALIGN_BYTES, np.uint8)
    skip = -raw.ctypes.data % ALIGN_BYTES
    return raw[skip : skip + 4 * n].view(np.float32)


def tiles(n: int, tile: int = TILE_ELEMENTS) -> Iterator[tuple[int, int]]:
    """``[start, end)`` ranges covering ``[0, n)`` in steps of ``tile`` elements (>= 1)."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    for start in range(0, n, tile):
        yield start, min(n, start + tile)


def adam_update(
    param: np.ndarray,
    grad: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    alpha: np.float32,
    one_minus_beta_1: np.float32,
    one_minus_beta_2: np.float32,
    epsilon: np.float32,
    scratch: np.ndarray,
    scratch2: np.ndarray,
) -> None:
    """One Adam step on a shard, in place (Kingma & Ba, ICLR 2015, Algorithm 1, in the
    bias-corrected step-size form of section 2, as Keras implements it).

    Args:
        param: float32 ``[n]`` parameters, updated in place.
        grad: float32 ``[n]`` gradients (already summed over replicas).
        m: float32 ``[n]`` first moment, updated in place.
        v: float32 ``[n]`` second moment, updated in place.
        alpha: ``lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)``, computed by the caller in
            TensorFlow exactly as Keras does.
        one_minus_beta_1: ``float32(1 - beta_1)``.
        one_minus_beta_2: ``float32(1 - beta_2)``.
        epsilon: ``float32(epsilon)``.
        scratch: float32 ``[n]`` work buffer (contents overwritten).
        scratch2: float32 ``[n]`` work buffer (contents overwritten).
    """
    np.subtract(grad, m, out=scratch)
    scratch *= one_minus_beta_1
    m += scratch
    np.multiply(grad, grad, out=scratch)
    scratch -= v
    scratch *= one_minus_beta_2
    v += scratch
    np.sqrt(v, out=scratch)
    scratch += epsilon
    np.multiply(m, alpha, out=scratch2)
    scratch2 /= scratch
    param -= scratch2


def sgd_momentum_update(
    param: np.ndarray,
    grad: np.ndarray,
    m: np.ndarray,
    lr: np.float32,
    momentum: np.float32,
    nesterov: bool,
    scratch: np.ndarray,
    scratch2: np.ndarray,
) -> None:
    """One SGD-with-momentum step on a shard, in place, in Keras's operation order.

    ``m = m * momentum - grad * lr``; then ``param += m`` or, with Nesterov,
    ``param += m * momentum - grad * lr`` (Sutskever et al., ICML 2013, section 3).

    Args:
        param: float32 ``[n]`` parameters, updated in place.
        grad: float32 ``[n]`` gradients.
        m: float32 ``[n]`` momentum buffer, updated in place.
        lr: float32 learning rate.
        momentum: float32 momentum coefficient in [0, 1).
        nesterov: use Nesterov momentum.
        scratch: float32 ``[n]`` work buffer (overwritten).
        scratch2: float32 ``[n]`` work buffer (overwritten).
    """
    np.multiply(grad, lr, out=scratch)
    m *= momentum
    m -= scratch
    if nesterov:
        np.multiply(m, momentum, out=scratch2)
        scratch2 -= scratch
        param += scratch2
    else:
        param += m


def sgd_update(param: np.ndarray, grad: np.ndarray, lr: np.float32, scratch: np.ndarray) -> None:
    """Plain SGD on a shard, in place: ``param -= grad * lr``.

    Args:
        param: float32 ``[n]``, updated in place.
        grad: float32 ``[n]``.
        lr: float32 learning rate.
        scratch: float32 ``[n]`` work buffer.
    """
    np.multiply(grad, lr, out=scratch)
    param -= scratch
