"""Host update kernels, bit-for-bit equal to Keras 3's TensorFlow updates.

Each kernel runs numba's fused version (:mod:`zero_runtime.optim.numba_kernels`: one
pass over the elements, the same operations in the same order, bitwise equal) when
:func:`zero_runtime.optim.fused.active` says so, and otherwise the NumPy body below (one
pass per operation, through the two scratch buffers, which the fused kernels ignore).

Each kernel updates one shard in place. The operation order follows Keras's own
``update_step`` (for Adam ``m += (g - m) * (1 - beta_1)``, not the textbook
``m = beta_1 * m + (1 - beta_1) * g``), because the textbook form drifts by rounding
(TF_NOTES section 4). All arrays are float32 1-D of the same length; scalars are float32.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from zero_runtime.optim import fused

#: Elements per tile of a host update (float32: 256 KiB per buffer, 1.75 MiB for the
#: seven buffers of an Adam tile). Measured on the 2-core development machine
#: (bench/bench_host_adam.py): whole-array passes reach ~0.3 of the copy-bandwidth bound,
#: tiles of 16-256 Ki elements 0.45-0.6, so every pass over a tile hits the cache.
TILE_ELEMENTS = 65_536

#: Elements per tile of a fused (numba) host update (1 MiB per buffer). The fused kernel
#: makes one pass, so a tile needs no cache residency; what it pays per tile is the call
#: (~5-10 us: Python, numba's dispatch, the threading layer's launch), ~20% of a 64 Ki
#: tile at the bandwidth bound. Measured (bench/bench_host_adam.py, 2 shared cores): 0.55-0.78
#: of the bound at 64 Ki, 0.75-0.9 at 256 Ki and 1 Mi; the smaller of the two keeps the
#: EMA's second pass over a tile's parameters in the cache.
FUSED_TILE_ELEMENTS = 262_144


def tile_elements() -> int:
    """Elements per host-update tile for the kernels in use: :data:`FUSED_TILE_ELEMENTS`
    with numba's (:func:`zero_runtime.optim.fused.active`), else :data:`TILE_ELEMENTS`.

    Raises:
        as :func:`zero_runtime.optim.fused.active`.
    """
    return FUSED_TILE_ELEMENTS if fused.active() is not None else TILE_ELEMENTS


#: Alignment of a host update's output buffer, bytes: TensorFlow's CPU allocator's
#: (``EIGEN_MAX_ALIGN_BYTES``). A ``tf.numpy_function`` output this aligned becomes the
#: output tensor's buffer as is; any other is copied (measured: numpy's own allocations
#: here are 32 bytes off).
ALIGN_BYTES = 64


#: The fused RMSprop's stand-in for an absent buffer (never indexed then).
_NONE = np.empty(0, np.float32)


def _f32(*scalars) -> list[np.float32]:
    """The kernels' scalars as float32 (a Python float would make numba compute in
    float64)."""
    return [np.float32(s) for s in scalars]


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


def weight_decay(param: np.ndarray, wd: np.float32, lr: np.float32) -> None:
    """Keras's decoupled weight decay on a shard, in place: ``param -= param * (wd * lr)``.

    Keras writes ``variable.assign_sub(variable * wd * lr)``
    (``keras/src/backend/tensorflow/optimizer.py``, ``_apply_weight_decay``), and every
    training step runs it inside a ``tf.function``, where Grappler's arithmetic
    optimizer folds the two scalar factors first: TensorFlow computes
    ``variable - variable * float32(wd * lr)``. Measured on 4096 normal float32 values,
    ``wd`` 0.1, ``lr`` 0.01: the eager order ``(param * wd) * lr`` differs from it in 4
    elements by 1 ulp; this order is bitwise equal (with the arithmetic optimizer off,
    TensorFlow computes the eager order).

    Args:
        param: float32 ``[n]``, decayed in place.
        wd: ``float32(weight_decay)``.
        lr: the step's learning rate, float32.
    """
    param -= param * (np.float32(wd) * np.float32(lr))


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
    if (fk := fused.active()) is not None:  # one fused pass (fused.py)
        fk.adam(param, grad, m, v, *_f32(alpha, one_minus_beta_1, one_minus_beta_2, epsilon))
        return
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
    if (fk := fused.active()) is not None:  # one fused pass (fused.py)
        fk.sgd_momentum(param, grad, m, *_f32(lr, momentum), bool(nesterov))
        return
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
    if (fk := fused.active()) is not None:  # one fused pass (fused.py)
        fk.sgd(param, grad, *_f32(lr))
        return
    np.multiply(grad, lr, out=scratch)
    param -= scratch


# -- the element-wise optimizers of zero_runtime.optim.elementwise --------------------------
# Each kernel below updates one tile in place in the operation order of Keras 3.15's own
# ``update_step`` (keras/src/optimizers/<name>.py), each binary operation rounded to
# float32 once, as TensorFlow's element-wise kernels round it; the caller computes the
# step's scalars in TensorFlow (as Keras does) and passes them as float32. A coefficient
# Keras writes as ``1 - rho`` on Python floats is ``float32(1 - rho)``; one it writes on a
# float32 tensor (``1.0 - ops.cast(beta_1, dtype)``) is ``float32(1) - float32(beta_1)``:
# the callers pass each as Keras forms it.


def rmsprop_update(
    param: np.ndarray,
    grad: np.ndarray,
    velocity: np.ndarray,
    momentum_buf: np.ndarray | None,
    average_grad: np.ndarray | None,
    lr: np.float32,
    rho: np.float32,
    one_minus_rho: np.float32,
    momentum: np.float32,
    epsilon: np.float32,
    scratch: np.ndarray,
    scratch2: np.ndarray,
) -> None:
    """One RMSprop step on a shard, in place (Hinton, Srivastava & Swersky, "Neural
    Networks for Machine Learning", lecture 6e, 2012; the centered form: Graves,
    "Generating Sequences With Recurrent Neural Networks", arXiv:1308.0850, 2013,
    section 4), in Keras's order::

        v = rho * v + (1 - rho) * g**2
        a = rho * a + (1 - rho) * g                  (centered)
        d = v - a**2 + eps   (centered)  |  v + eps
        inc = lr * g / sqrt(d)
        m = momentum * m + inc; param -= m           (momentum > 0)  |  param -= inc

    Args:
        param: float32 ``[n]`` parameters, updated in place.
        grad: float32 ``[n]`` gradients (summed over replicas).
        velocity: float32 ``[n]`` mean square ``v``, updated in place.
        momentum_buf: float32 ``[n]`` momentum ``m`` (updated in place), or None when
            Keras's ``momentum`` is 0.
        average_grad: float32 ``[n]`` mean gradient ``a`` (updated in place), or None
            when not ``centered``.
        lr: float32 learning rate of the step.
        rho: ``float32(rho)``.
        one_minus_rho: ``float32(1 - rho)`` (Python subtraction, as Keras).
        momentum: ``float32(momentum)`` (unused when ``momentum_buf`` is None).
        epsilon: ``float32(epsilon)``.
        scratch: float32 ``[n]`` work buffer (overwritten).
        scratch2: float32 ``[n]`` work buffer (overwritten).
    """
    if (fk := fused.active()) is not None:  # one fused pass (fused.py)
        fk.rmsprop(
            param,
            grad,
            velocity,
            _NONE if momentum_buf is None else momentum_buf,
            _NONE if average_grad is None else average_grad,
            *_f32(lr, rho, one_minus_rho, momentum, epsilon),
            momentum_buf is not None,
            average_grad is not None,
        )
        return
    velocity *= rho
    np.multiply(grad, grad, out=scratch)
    scratch *= one_minus_rho
    velocity += scratch
    if average_grad is not None:
        average_grad *= rho
        np.multiply(grad, one_minus_rho, out=scratch)
        average_grad += scratch
        np.multiply(average_grad, average_grad, out=scratch)
        np.subtract(velocity, scratch, out=scratch)
        scratch += epsilon
    else:
        np.add(velocity, epsilon, out=scratch)
    np.sqrt(scratch, out=scratch)
    np.multiply(grad, lr, out=scratch2)
    scratch2 /= scratch
    if momentum_buf is not None:
        momentum_buf *= momentum
        momentum_buf += scratch2
        param -= momentum_buf
    else:
        param -= scratch2


def adagrad_update(
    param: np.ndarray,
    grad: np.ndarray,
    accumulator: np.ndarray,
    lr: np.float32,
    epsilon: np.float32,
    scratch: np.ndarray,
    scratch2: np.ndarray,
) -> None:
    """One Adagrad step on a shard, in place (Duchi, Hazan & Singer, "Adaptive
    Subgradient Methods for Online Learning and Stochastic Optimization", JMLR 12, 2011,
    the diagonal-matrix update, with Keras's ``epsilon`` inside the root), in
    Keras's order: ``acc += g**2``; ``param -= lr * g / sqrt(acc + eps)``.

    Args:
        param: float32 ``[n]`` parameters, updated in place.
        grad: float32 ``[n]`` gradients.
        accumulator: float32 ``[n]`` sum of squared gradients, updated in place (starts at
            Keras's ``initial_accumulator_value``).
        lr: float32 learning rate of the step.
        epsilon: ``float32(epsilon)``.
        scratch: float32 ``[n]`` work buffer (overwritten).
        scratch2: float32 ``[n]`` work buffer (overwritten).
    """
    if (fk := fused.active()) is not None:  # one fused pass (fused.py)
        fk.adagrad(param, grad, accumulator, *_f32(lr, epsilon))
        return
    np.multiply(grad, grad, out=scratch)
    accumulator += scratch
    np.add(accumulator, epsilon, out=scratch)
    np.sqrt(scratch, out=scratch)
    np.multiply(grad, lr, out=scratch2)
    scratch2 /= scratch
    param -= scratch2


def adamax_update(
    param: np.ndarray,
    grad: np.ndarray,
    m: np.ndarray,
    u: np.ndarray,
    lr: np.float32,
    one_minus_beta_1: np.float32,
    beta_2: np.float32,
    one_minus_beta_1_power: np.float32,
    epsilon: np.float32,
    scratch: np.ndarray,
    scratch2: np.ndarray,
) -> None:
    """One Adamax step on a shard, in place (Kingma & Ba, "Adam: A Method for Stochastic
    Optimization", ICLR 2015, section 7.1, Algorithm 2), in Keras's order::

        m += (g - m) * (1 - beta_1)
        u = max(beta_2 * u, |g|)
        param -= lr * m / ((1 - beta_1**t) * (u + eps))

    Args:
        param: float32 ``[n]`` parameters, updated in place.
        grad: float32 ``[n]`` gradients.
        m: float32 ``[n]`` first moment, updated in place.
        u: float32 ``[n]`` exponentially weighted infinity norm, updated in place.
        lr: float32 learning rate of the step.
        one_minus_beta_1: ``float32(1 - beta_1)`` (Python subtraction, as Keras).
        beta_2: ``float32(beta_2)``.
        one_minus_beta_1_power: ``1 - beta_1**t``, computed in TensorFlow as Keras does.
        epsilon: ``float32(epsilon)``.
        scratch: float32 ``[n]`` work buffer (overwritten).
        scratch2: float32 ``[n]`` work buffer (overwritten).
    """
    if (fk := fused.active()) is not None:  # one fused pass (fused.py)
        fk.adamax(
            param, grad, m, u, *_f32(lr, one_minus_beta_1, beta_2, one_minus_beta_1_power, epsilon)
        )
        return
    np.subtract(grad, m, out=scratch)
    scratch *= one_minus_beta_1
    m += scratch
    u *= beta_2
    np.abs(grad, out=scratch)
    np.maximum(u, scratch, out=u)
    np.add(u, epsilon, out=scratch)
    np.multiply(scratch, one_minus_beta_1_power, out=scratch)
    np.multiply(m, lr, out=scratch2)
    scratch2 /= scratch
    param -= scratch2


def nadam_update(
    param: np.ndarray,
    grad: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    lr: np.float32,
    one_minus_beta_1: np.float32,
    one_minus_beta_2: np.float32,
    u_t_1: np.float32,
    one_minus_u_product_t_1: np.float32,
    one_minus_u_t: np.float32,
    one_minus_u_product_t: np.float32,
    one_minus_beta_2_power: np.float32,
    epsilon: np.float32,
    scratch: np.ndarray,
    scratch2: np.ndarray,
) -> None:
    """One Nadam step on a shard, in place (Dozat, "Incorporating Nesterov Momentum into
    Adam", ICLR 2016 workshop, Algorithm 2, with Keras's momentum schedule
    ``u_t = beta_1 * (1 - 0.5 * 0.96**t)``; the paper's decays as ``0.96**(t / 250)``),
    in Keras's order::

        m += (g - m) * (1 - beta_1)
        v += (g**2 - v) * (1 - beta_2)
        m_hat = u_{t+1} * m / (1 - prod_{i<=t+1} u_i) + (1 - u_t) * g / (1 - prod_{i<=t} u_i)
        v_hat = v / (1 - beta_2**t)
        param -= m_hat * lr / (sqrt(v_hat) + eps)

    Args:
        param: float32 ``[n]`` parameters, updated in place.
        grad: float32 ``[n]`` gradients.
        m: float32 ``[n]`` first moment, updated in place.
        v: float32 ``[n]`` second moment, updated in place.
        lr: float32 learning rate of the step.
        one_minus_beta_1: ``float32(1) - float32(beta_1)`` (Keras subtracts on the cast
            tensor).
        one_minus_beta_2: ``float32(1) - float32(beta_2)``.
        u_t_1: ``u_{t+1}``; the four scalars below as Keras computes them in TensorFlow
            from its ``_u_product`` (``prod_{i<=t} u_i``).
        one_minus_u_product_t_1: ``1 - prod_{i<=t} u_i * u_{t+1}``.
        one_minus_u_t: ``1 - u_t``.
        one_minus_u_product_t: ``1 - prod_{i<=t} u_i``.
        one_minus_beta_2_power: ``1 - beta_2**t``.
        epsilon: ``float32(epsilon)``.
        scratch: float32 ``[n]`` work buffer (overwritten).
        scratch2: float32 ``[n]`` work buffer (overwritten).
    """
    if (fk := fused.active()) is not None:  # one fused pass (fused.py)
        fk.nadam(
            param,
            grad,
            m,
            v,
            *_f32(
                lr,
                one_minus_beta_1,
                one_minus_beta_2,
                u_t_1,
                one_minus_u_product_t_1,
                one_minus_u_t,
                one_minus_u_product_t,
                one_minus_beta_2_power,
                epsilon,
            ),
        )
        return
    np.subtract(grad, m, out=scratch)
    scratch *= one_minus_beta_1
    m += scratch
    np.multiply(grad, grad, out=scratch)
    scratch -= v
    scratch *= one_minus_beta_2
    v += scratch
    np.multiply(m, u_t_1, out=scratch)
    scratch /= one_minus_u_product_t_1
    np.multiply(grad, one_minus_u_t, out=scratch2)
    scratch2 /= one_minus_u_product_t
    scratch += scratch2  # m_hat
    scratch *= lr
    np.divide(v, one_minus_beta_2_power, out=scratch2)  # v_hat
    np.sqrt(scratch2, out=scratch2)
    scratch2 += epsilon
    scratch /= scratch2
    param -= scratch


def lion_update(
    param: np.ndarray,
    grad: np.ndarray,
    m: np.ndarray,
    lr: np.float32,
    beta_1: np.float32,
    one_minus_beta_1: np.float32,
    beta_2: np.float32,
    one_minus_beta_2: np.float32,
    scratch: np.ndarray,
    scratch2: np.ndarray,
) -> None:
    """One Lion step on a shard, in place (Chen et al., "Symbolic Discovery of
    Optimization Algorithms", NeurIPS 2023, Algorithm 2 without its weight decay, which
    Keras applies to the variables before the update), in Keras's order::

        param -= lr * sign(m * beta_1 + g * (1 - beta_1))
        m = m * beta_2 + g * (1 - beta_2)

    Args:
        param: float32 ``[n]`` parameters, updated in place.
        grad: float32 ``[n]`` gradients.
        m: float32 ``[n]`` momentum, updated in place.
        lr: float32 learning rate of the step.
        beta_1: ``float32(beta_1)``.
        one_minus_beta_1: ``float32(1) - float32(beta_1)`` (Keras subtracts on the cast
            tensor).
        beta_2: ``float32(beta_2)``.
        one_minus_beta_2: ``float32(1) - float32(beta_2)``.
        scratch: float32 ``[n]`` work buffer (overwritten).
        scratch2: float32 ``[n]`` work buffer (overwritten).
    """
    if (fk := fused.active()) is not None:  # one fused pass (fused.py)
        fk.lion(param, grad, m, *_f32(lr, beta_1, one_minus_beta_1, beta_2, one_minus_beta_2))
        return
    np.multiply(m, beta_1, out=scratch)
    np.multiply(grad, one_minus_beta_1, out=scratch2)
    scratch += scratch2
    np.sign(scratch, out=scratch)
    scratch *= lr
    param -= scratch
    m *= beta_2
    np.multiply(grad, one_minus_beta_2, out=scratch2)
    m += scratch2


def ema_update(
    average: np.ndarray,
    param: np.ndarray,
    momentum: np.float32,
    one_minus_momentum: np.float32,
    overwrite: bool,
    scratch: np.ndarray,
    scratch2: np.ndarray,
) -> None:
    """Keras's model-weight EMA of a shard, in place (``BaseOptimizer.
    _update_model_variables_moving_average``, then, on an overwrite step,
    ``_overwrite_model_variables_with_average_value``), in Keras's order::

        average = momentum * average + (1 - momentum) * param
        param = average                                  # only when ``overwrite``

    Args:
        average: float32 ``[n]`` average, updated in place.
        param: float32 ``[n]`` parameters after the step's update (overwritten by the
            average when ``overwrite``).
        momentum: ``float32(iterations != 0) * float32(ema_momentum)`` (0 on the first
            step).
        one_minus_momentum: ``float32(1) - momentum``.
        overwrite: True on an ``ema_overwrite_frequency`` step.
        scratch: float32 ``[n]`` work buffer (overwritten).
        scratch2: float32 ``[n]`` work buffer (overwritten).
    """
    if (fk := fused.active()) is not None:  # one fused pass (fused.py)
        fk.ema(average, param, *_f32(momentum, one_minus_momentum), bool(overwrite))
        return
    np.multiply(average, momentum, out=scratch)
    np.multiply(param, one_minus_momentum, out=scratch2)
    np.add(scratch, scratch2, out=average)
    if overwrite:
        np.copyto(param, average)
