"""Fused host update kernels compiled by numba: one pass over each element.

The NumPy kernels of :mod:`zero_runtime.optim.kernels` make one pass per operation
(about 12 for Adam, each a read and a write of a tile); each kernel here reads every
input element once, computes the whole update in registers and writes each output once,
vectorised by LLVM and split over threads (``prange``). That is what DeepSpeed's CPU Adam
does in AVX C++ (Rajbhandari et al., "ZeRO-Infinity", SC21, section 6.1; ZeRO-Offload,
Ren et al., USENIX ATC 2021, section 4.3): the update is memory bound, so one pass is the
bound.

The results are bitwise those of the NumPy kernels, and so of Keras's TensorFlow update:
each expression below is the NumPy kernel's sequence of operations written as one
expression in the same order, every operand float32, so that each binary operation is
rounded to float32 once, as TensorFlow's element-wise kernels round it. ``fastmath`` is
off (no reassociation, no fused multiply-add contraction, IEEE ``sqrt`` and division) and
``error_model='numpy'`` (a division by zero gives inf or NaN as in TensorFlow, with no
branch to stop vectorisation). The callers pass every scalar as ``np.float32``: a Python
float would be typed float64 and the arithmetic promoted.

Importing this module imports numba (an ImportError when it is not installed; the
backend choice is :mod:`zero_runtime.optim.fused`'s). Every array argument is float32
``[n]`` (contiguous or not; each layout compiles once) and the arrays are distinct
buffers. Each call runs on the calling thread's ``numba.set_num_threads`` threads
(:func:`zero_runtime.optim.fused.active` sets them; set inside a kernel, it would stop
the kernel from being cached). Compiled code is cached on disk (``cache=True``).
"""

from __future__ import annotations

import os

import numba
import numpy as np
from numba import prange

# A layer whose parallel launches may come from several threads at once: the replicas'
# host updates run concurrently on TensorFlow's executor threads, and numba's
# 'workqueue' layer aborts the process on a concurrent launch. An explicit
# NUMBA_THREADING_LAYER is left to the user (fused.py checks the layer loaded).
if not os.environ.get("NUMBA_THREADING_LAYER"):
    numba.config.THREADING_LAYER = "threadsafe"

_jit = numba.njit(parallel=True, fastmath=False, error_model="numpy", cache=True, nogil=True)


@_jit
def probe(out):
    """``out[i] = i`` over a float32 ``[n]`` array: a launch through the threading layer."""
    for i in prange(out.shape[0]):
        out[i] = np.float32(i)


@numba.njit(inline="always", fastmath=False, error_model="numpy", cache=True)
def _moments(g, m, v, i, one_minus_beta_1, one_minus_beta_2):
    """Adam's (and Nadam's) moments of element ``i``, in Keras's order, stored and
    returned: ``m += (g - m) * (1 - b1)``; ``v += (g * g - v) * (1 - b2)``."""
    mi = m[i] + (g - m[i]) * one_minus_beta_1
    vi = v[i] + (g * g - v[i]) * one_minus_beta_2
    m[i] = mi
    v[i] = vi
    return mi, vi


@_jit
def adam(param, grad, m, v, alpha, one_minus_beta_1, one_minus_beta_2, epsilon):
    """Adam, as :func:`zero_runtime.optim.kernels.adam_update` (arguments the same, no
    scratch): the moments (:func:`_moments`), then
    ``param -= (m * alpha) / (sqrt(v) + eps)``."""
    for i in prange(param.shape[0]):
        mi, vi = _moments(grad[i], m, v, i, one_minus_beta_1, one_minus_beta_2)
        param[i] = param[i] - (mi * alpha) / (np.sqrt(vi) + epsilon)


@_jit
def sgd(param, grad, lr):
    """Plain SGD, as :func:`zero_runtime.optim.kernels.sgd_update`: ``param -= g * lr``."""
    for i in prange(param.shape[0]):
        param[i] = param[i] - grad[i] * lr


@_jit
def sgd_momentum(param, grad, m, lr, momentum, nesterov):
    """SGD with momentum, as :func:`zero_runtime.optim.kernels.sgd_momentum_update`:
    ``m = m * momentum - g * lr``; ``param += m`` or, with ``nesterov``,
    ``param += m * momentum - g * lr``."""
    for i in prange(param.shape[0]):
        step = grad[i] * lr
        mi = m[i] * momentum - step
        m[i] = mi
        if nesterov:
            param[i] = param[i] + (mi * momentum - step)
        else:
            param[i] = param[i] + mi


@_jit
def rmsprop(
    param,
    grad,
    velocity,
    momentum_buf,
    average_grad,
    lr,
    rho,
    one_minus_rho,
    momentum,
    epsilon,
    use_momentum,
    centered,
):
    """RMSprop, as :func:`zero_runtime.optim.kernels.rmsprop_update`; ``momentum_buf``
    and ``average_grad`` are read only when ``use_momentum`` / ``centered`` (pass any
    float32 array otherwise). In order: ``v = v * rho + (g * g) * (1 - rho)``; centered:
    ``a = a * rho + g * (1 - rho)``, ``d = (v - a * a) + eps``, else ``d = v + eps``;
    ``inc = (g * lr) / sqrt(d)``; with momentum ``m = m * momentum + inc`` and
    ``param -= m``, else ``param -= inc``.
    """
    for i in prange(param.shape[0]):
        g = grad[i]
        vi = velocity[i] * rho + (g * g) * one_minus_rho
        velocity[i] = vi
        if centered:
            ai = average_grad[i] * rho + g * one_minus_rho
            average_grad[i] = ai
            d = (vi - ai * ai) + epsilon
        else:
            d = vi + epsilon
        inc = (g * lr) / np.sqrt(d)
        if use_momentum:
            mi = momentum_buf[i] * momentum + inc
            momentum_buf[i] = mi
            param[i] = param[i] - mi
        else:
            param[i] = param[i] - inc


@_jit
def adagrad(param, grad, accumulator, lr, epsilon):
    """Adagrad, as :func:`zero_runtime.optim.kernels.adagrad_update`:
    ``acc += g * g``; ``param -= (g * lr) / sqrt(acc + eps)``."""
    for i in prange(param.shape[0]):
        g = grad[i]
        acc = accumulator[i] + g * g
        accumulator[i] = acc
        param[i] = param[i] - (g * lr) / np.sqrt(acc + epsilon)


@_jit
def adamax(param, grad, m, u, lr, one_minus_beta_1, beta_2, one_minus_beta_1_power, epsilon):
    """Adamax, as :func:`zero_runtime.optim.kernels.adamax_update`:
    ``m += (g - m) * (1 - b1)``; ``u = maximum(u * b2, |g|)`` (NaN propagating, as
    ``np.maximum``); ``param -= (m * lr) / ((u + eps) * (1 - b1**t))``."""
    for i in prange(param.shape[0]):
        g = grad[i]
        mi = m[i] + (g - m[i]) * one_minus_beta_1
        m[i] = mi
        ui = np.maximum(u[i] * beta_2, np.abs(g))
        u[i] = ui
        param[i] = param[i] - (mi * lr) / ((ui + epsilon) * one_minus_beta_1_power)


@_jit
def nadam(
    param,
    grad,
    m,
    v,
    lr,
    one_minus_beta_1,
    one_minus_beta_2,
    u_t_1,
    one_minus_u_product_t_1,
    one_minus_u_t,
    one_minus_u_product_t,
    one_minus_beta_2_power,
    epsilon,
):
    """Nadam, as :func:`zero_runtime.optim.kernels.nadam_update` (the same scalars): the
    moments (:func:`_moments`), then ``m_hat = (m * u_{t+1}) / (1 - prod_{t+1}) +
    (g * (1 - u_t)) / (1 - prod_t)`` and ``param -= (m_hat * lr) / (sqrt(v / (1 -
    b2**t)) + eps)``.
    """
    for i in prange(param.shape[0]):
        g = grad[i]
        mi, vi = _moments(g, m, v, i, one_minus_beta_1, one_minus_beta_2)
        m_hat = (mi * u_t_1) / one_minus_u_product_t_1 + (g * one_minus_u_t) / (
            one_minus_u_product_t
        )
        v_hat = vi / one_minus_beta_2_power
        param[i] = param[i] - (m_hat * lr) / (np.sqrt(v_hat) + epsilon)


@_jit
def lion(param, grad, m, lr, beta_1, one_minus_beta_1, beta_2, one_minus_beta_2):
    """Lion, as :func:`zero_runtime.optim.kernels.lion_update`:
    ``param -= sign(m * b1 + g * (1 - b1)) * lr``; ``m = m * b2 + g * (1 - b2)``."""
    for i in prange(param.shape[0]):
        g = grad[i]
        mi = m[i]
        param[i] = param[i] - np.sign(mi * beta_1 + g * one_minus_beta_1) * lr
        m[i] = mi * beta_2 + g * one_minus_beta_2


@_jit
def ema(average, param, momentum, one_minus_momentum, overwrite):
    """Keras's model-weight EMA, as :func:`zero_runtime.optim.kernels.ema_update`:
    ``average = average * momentum + param * (1 - momentum)``; ``param = average`` when
    ``overwrite``."""
    for i in prange(param.shape[0]):
        a = average[i] * momentum + param[i] * one_minus_momentum
        average[i] = a
        if overwrite:
            param[i] = a
