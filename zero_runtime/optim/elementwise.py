"""Partitioned forms of Keras's other element-wise optimizers: ``RMSprop``, ``Adagrad``,
``Adamax``, ``Nadam`` and ``Lion`` (ZeRO stages 1-3, any ``offload_optimizer`` tier).

Each class subclasses the stock Keras optimizer and the ZeRO update mixin
(:class:`~zero_runtime.optim.partitioned._PartitionedUpdate`), as ``Adam``/``AdamW``/``SGD``
do in :mod:`zero_runtime.optim.partitioned`: the states are float32 ``[shard_size]``
buffers per slot and replica on the tier ``offload_optimizer`` names (device variables,
host numpy buffers or NVMe pages), and the update is Keras 3.15's ``update_step``
operation for operation: on the device tier as TensorFlow ops
(``_zero_device_delta``), on the host and NVMe tiers as the numpy kernels of
:mod:`zero_runtime.optim.kernels`, bitwise equal to Keras's at stages 1-2
(``tests/test_optim_elementwise.py``; docs/parity.md), except RMSprop and Adagrad on the
host and NVMe tiers: TensorFlow computes their ``x / sqrt(d)`` with an approximate
vectorised reciprocal square root numpy does not have (:func:`div_sqrt_as_keras`),
measured within 4e-7 (``max |dw| / max |w|``, 20 steps). Every update is element-wise, so
the stage-3 update during backward (:mod:`.backward_update`), block by block, gives the
same result as the update after backward.

Two states are not plain zero-initialised per-element buffers in Keras:

- Adagrad's accumulator starts at ``initial_accumulator_value``: the store's slot is
  overwritten with that value right after it is created (:meth:`Adagrad._zero_make_store`,
  through the stores' ``write_shard``);
- Nadam's ``_u_product`` (the product of the momentum schedule, one scalar per optimizer)
  is advanced once per optimizer step, as Keras's ``Nadam._backend_update_step`` does,
  by :meth:`Nadam._zero_scalars` on each replica's copy (:meth:`Nadam._zero_u_product`).

``Adafactor``, whose update is not element-wise, is partitioned in :mod:`.adafactor`.

Importing this module (``zero_runtime.optim`` does) registers the classes with Keras's
serialization and the names ``"rmsprop"``/``"RMSprop"``, ``"adagrad"``/``"Adagrad"``,
``"adamax"``/``"Adamax"``, ``"nadam"``/``"Nadam"`` and ``"lion"``/``"Lion"`` with the
strategy's scope (:func:`~zero_runtime.optim.partitioned.register_partitioned`).
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import tensorflow as tf

from zero_runtime.optim import kernels
from zero_runtime.optim.layout import FlatLayout
from zero_runtime.optim.partitioned import (
    _masked,
    _masked_delta,
    _PartitionedUpdate,
    register_partitioned,
)
from zero_runtime.optim.replica_context import local_copy, local_replicas, replica_id, unwrap

#: Elements: a multiple of every packet size (4, 8 or 16 float32 by the instruction set)
#: in which Eigen evaluates TensorFlow's element-wise CPU kernels (see :func:`_div_sqrt`).
PACKET_BLOCK = 64


def _f32(value) -> tf.Tensor:
    """``value`` (Python float, tensor or variable) as a float32 tensor, as Keras's
    ``ops.cast(value, "float32")``."""
    return tf.cast(value, tf.float32)


@functools.lru_cache(maxsize=64)
def _div_sqrt_fixups(
    layout: FlatLayout, replica: int, n: int
) -> tuple[tuple[int, int, int, int], ...]:
    """The pieces of shard elements ``[0, n)`` of ``replica`` that :func:`_div_sqrt`
    evaluates apart: ``(shard start, lead, length, block)`` each, the piece being
    elements ``[lead, lead + length)`` of a variable's :data:`PACKET_BLOCK`-element block
    (``block`` elements: 64, or the size modulo 64 for a variable's last block).

    A block is taken apart when the shard holds it only in part (a shard boundary cuts
    it), when it is the variable's partial last block (its last ``size % P`` elements are
    Keras's scalar tail), or when it reaches into the shard's own last ``n % 64``
    elements (the scalar tail of the whole-shard evaluation). Every other element is in
    a whole 64-block both in Keras's tensor and in the shard: a packet in both.
    """
    fixups = []
    shard_tail = n - n % PACKET_BLOCK
    for b in layout.buckets:
        lo = b.flat_offset + replica * b.piece_size
        hi = lo + b.piece_size
        for i in range(b.var_start, b.var_end):
            offset, size = layout.offsets[i], layout.sizes[i]
            start, end = max(offset, lo) - offset, min(offset + size, hi) - offset
            if start >= end:
                continue
            shift = lo - b.shard_offset - offset  # var-local index of shard element 0
            first = start - start % PACKET_BLOCK
            # Blocks that can need it: the first and last the piece touches, the variable's
            # last, and those in the shard's last partial block.
            candidates = {first, (end - 1) - (end - 1) % PACKET_BLOCK}
            candidates.add((size - 1) - (size - 1) % PACKET_BLOCK)
            tail_var = shard_tail + shift  # var-local index of shard element shard_tail
            if tail_var < end:
                t0 = max(first, tail_var - tail_var % PACKET_BLOCK)
                candidates.update(range(t0, end, PACKET_BLOCK))
            for block in sorted(candidates):
                block_end = min(block + PACKET_BLOCK, size)
                a, e = max(start, block), min(end, block_end, n + shift)
                if a >= e:
                    continue
                whole = a == block and e == block_end and block_end - block == PACKET_BLOCK
                if whole and e - shift <= shard_tail:
                    continue  # packets in Keras's tensor and in the shard alike
                fixups.append((a - shift, a - block, e - a, block_end - block))
    return tuple(sorted(fixups))


def div_sqrt_as_keras(x: tf.Tensor, d: tf.Tensor, layout: FlatLayout, replica: int) -> tf.Tensor:
    """``x / sqrt(d)`` on elements ``[0, n)`` of ``replica``'s stage 1-2 shard, each element
    rounded as Keras's per-variable ``ops.divide(x, ops.sqrt(d))`` rounds it in a
    ``tf.function``.

    TensorFlow's graph optimizer rewrites ``x / sqrt(d)`` into ``x * rsqrt(d)``
    (Grappler's arithmetic optimizer, ``SqrtDivToRsqrtMul``), in Keras's step as in this
    one. Eigen evaluates ``Rsqrt`` on a tensor of T elements in packets of P (4, 8 or 16
    by the instruction set: an approximate reciprocal square root refined by a Newton
    step) except the last ``T % P`` elements, which it computes as ``1 / sqrt`` one at a
    time; the two differ in the last bit for about 40 % of the inputs (measured). So each
    element's result depends on its place in its tensor: Keras's tensor is the variable,
    this one the shard. The shard is evaluated whole, then the pieces where the two
    places could disagree (:func:`_div_sqrt_fixups`: a few 64-element blocks per
    variable) are evaluated again, each laid out as in its variable (padded to its whole
    block with ``x = 0``, ``d = 1``), and written over it. Without the rewrite both are
    the exact ``x / sqrt(d)``.

    Args:
        x: float32 ``[n]`` (static ``n`` <= ``layout.shard_size``), the numerators.
        d: float32 ``[n]``, positive, the radicands.
        layout: the optimizer's flat layout (stages 1-2: flat pieces of the variables).
        replica: the shard's replica id.

    Returns:
        float32 ``[n]``.
    """
    full = x / tf.sqrt(d)
    n = x.shape[0]
    if n is None:
        return full
    fixups = _div_sqrt_fixups(layout, replica, int(n))
    if not fixups:
        return full
    values, index = [], []
    for start, lead, length, block in fixups:
        xs, ds = x[start : start + length], d[start : start + length]
        trail = block - lead - length
        if lead or trail:
            xs = tf.pad(xs, [[lead, trail]])
            ds = tf.pad(ds, [[lead, trail]], constant_values=1.0)
        q = xs / tf.sqrt(ds)
        values.append(q[lead : lead + length] if lead or trail else q)
        index.extend(range(start, start + length))
    index_t = tf.constant(np.asarray(index, np.int32)[:, None])
    return tf.tensor_scatter_nd_update(full, index_t, tf.concat(values, axis=0))


def _div_sqrt(optimizer: _PartitionedUpdate, x: tf.Tensor, d: tf.Tensor) -> tf.Tensor:
    """The device tier's ``x / sqrt(d)`` (float32, ``x``'s shape): at stages 1-2
    :func:`div_sqrt_as_keras` on the replica's shard; at stage 3 (whose shards are rows
    of the variables' moved values, and whose gradients differ from Keras's by their
    summation order anyway: docs/parity.md) plain."""
    zs = optimizer._zero
    if zs is None or zs.stage >= 3:
        return x / tf.sqrt(d)
    return div_sqrt_as_keras(x, d, zs.layout, replica_id())


@keras.saving.register_keras_serializable(package="zero_runtime")
class RMSprop(_PartitionedUpdate, keras.optimizers.RMSprop):
    """Keras ``RMSprop`` with ZeRO-partitioned state (stages 1-3, any offload tier).

    RMSprop: Hinton, Srivastava & Swersky, "Neural Networks for Machine Learning",
    lecture 6e (2012); ``centered=True`` is Graves's variant ("Generating Sequences With
    Recurrent Neural Networks", arXiv:1308.0850, 2013, section 4), which divides by an
    estimate of the gradient's variance instead of its second moment. Same constructor,
    defaults and behaviour as ``keras.optimizers.RMSprop`` (``learning_rate=0.001``,
    ``rho=0.9``, ``momentum=0.0``, ``epsilon=1e-7``, ``centered=False``); the update is
    bitwise Keras's on the device tier, within 4e-7 on the host and NVMe tiers (the
    module docstring; :func:`~zero_runtime.optim.kernels.rmsprop_update`).

    State per replica on the ``offload_optimizer`` tier: float32 ``velocity`` (mean
    square), plus ``momentum`` when ``momentum > 0`` and ``average_gradient`` when
    ``centered``: ``4 * k * shard_size`` bytes with ``k`` in 1..3 (about ``4 k P / N``
    for P float32 parameters over N replicas).
    """

    @property
    def _zero_slots(self) -> tuple[str, ...]:  # type: ignore[override]
        slots = ["velocity"]
        if self.momentum > 0:  # Keras: a momentum slot only for momentum > 0
            slots.append("momentum")
        if self.centered:
            slots.append("average_gradient")
        return tuple(slots)

    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        """``[lr]``, float32: Keras's ``ops.cast(learning_rate, dtype)``."""
        return [_f32(learning_rate)]

    def _zero_host_step(self, slots, scratch, param, grad, scalars) -> None:
        (lr,) = scalars
        kernels.rmsprop_update(
            param,
            grad,
            slots["velocity"],
            slots.get("momentum"),
            slots.get("average_gradient"),
            np.float32(lr),
            np.float32(self.rho),
            np.float32(1 - self.rho),
            np.float32(self.momentum),
            np.float32(self.epsilon),
            scratch[0],
            scratch[1],
        )

    def _zero_device_delta(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        # Keras's RMSprop.update_step on the shard, op for op.
        (lr,) = scalars
        rho, one_minus_rho = _f32(self.rho), _f32(1 - self.rho)
        v_var = slots["velocity"]
        v_old = v_var.read_value()
        v = _masked(mask, rho * v_old + one_minus_rho * tf.square(grad), v_old)
        v_var.assign(v)
        if self.centered:
            a_var = slots["average_gradient"]
            a_old = a_var.read_value()
            a = _masked(mask, rho * a_old + one_minus_rho * grad, a_old)
            a_var.assign(a)
            denominator = v - tf.square(a) + _f32(self.epsilon)
        else:
            denominator = v + _f32(self.epsilon)
        increment = _div_sqrt(self, lr * grad, denominator)
        if self.momentum > 0:
            m_var = slots["momentum"]
            m_old = m_var.read_value()
            m = _masked(mask, _f32(self.momentum) * m_old + increment, m_old)
            m_var.assign(m)
            return _masked_delta(mask, m)
        return _masked_delta(mask, increment)


@keras.saving.register_keras_serializable(package="zero_runtime")
class Adagrad(_PartitionedUpdate, keras.optimizers.Adagrad):
    """Keras ``Adagrad`` with ZeRO-partitioned state (stages 1-3, any offload tier).

    Adagrad: Duchi, Hazan & Singer, "Adaptive Subgradient Methods for Online Learning
    and Stochastic Optimization", JMLR 12 (2011), the diagonal-matrix update. Same
    constructor, defaults and behaviour as ``keras.optimizers.Adagrad``
    (``learning_rate=0.001``, ``initial_accumulator_value=0.1``, ``epsilon=1e-7``); the
    update is bitwise Keras's on the device tier, within 4e-7 on the host and NVMe tiers
    (the module docstring; :func:`~zero_runtime.optim.kernels.adagrad_update`).

    State per replica on the ``offload_optimizer`` tier: one float32 ``accumulator``
    (sum of squared gradients, starting at ``initial_accumulator_value``):
    ``4 * shard_size`` bytes (about ``4 P / N``).

    Raises:
        NotImplementedError: at stage 3, with a row-paged embedding table and a non-zero
            ``initial_accumulator_value`` (the table's row states start at zero,
            zero_runtime/stage3/embedding.py), when the optimizer is built.
    """

    _zero_slots = ("accumulator",)

    def build(self, variables: list) -> None:
        """:meth:`_PartitionedUpdate.build`, refusing row-paged tables with a non-zero
        initial accumulator (see the class docstring)."""
        if self.built:
            return
        super().build(variables)
        if self._zero is not None and self.initial_accumulator_value:
            paged = [v for v in self._trainable_variables if getattr(v, "row_paged", False)]
            if paged:
                raise NotImplementedError(
                    f"Adagrad(initial_accumulator_value={self.initial_accumulator_value}) "
                    f"with the row-paged embedding table {paged[0].path!r}: its row states "
                    "start at 0; use initial_accumulator_value=0.0 or an unpaged table"
                )

    def _zero_make_store(self, config, layout, devices):
        """The store of :meth:`_PartitionedUpdate._zero_make_store`, its ``accumulator``
        of every local replica set to ``initial_accumulator_value`` (Keras's
        ``initializers.Constant``), float32 ``[shard_size]`` (padding included: a
        padding element's gradient is 0, so it never changes a parameter)."""
        store = super()._zero_make_store(config, layout, devices)
        value = np.float32(self.initial_accumulator_value)
        if value != 0:
            full = np.full(layout.shard_size, value, np.float32)
            for r in local_replicas(self._distribution_strategy, len(devices)):
                store.write_shard(r, "accumulator", full)
        return store

    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        """``[lr]``, float32."""
        return [_f32(learning_rate)]

    def _zero_host_step(self, slots, scratch, param, grad, scalars) -> None:
        (lr,) = scalars
        kernels.adagrad_update(
            param,
            grad,
            slots["accumulator"],
            np.float32(lr),
            np.float32(self.epsilon),
            scratch[0],
            scratch[1],
        )

    def _zero_device_delta(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        # Keras's Adagrad.update_step on the shard.
        (lr,) = scalars
        acc_var = slots["accumulator"]
        acc_old = acc_var.read_value()
        acc = _masked(mask, acc_old + tf.square(grad), acc_old)
        acc_var.assign(acc)
        return _masked_delta(mask, _div_sqrt(self, lr * grad, acc + _f32(self.epsilon)))


@keras.saving.register_keras_serializable(package="zero_runtime")
class Adamax(_PartitionedUpdate, keras.optimizers.Adamax):
    """Keras ``Adamax`` with ZeRO-partitioned state (stages 1-3, any offload tier).

    Adamax: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015,
    section 7.1 (Algorithm 2, Adam with the infinity norm). Same constructor, defaults and
    behaviour as ``keras.optimizers.Adamax`` (``learning_rate=0.001``, ``beta_1=0.9``,
    ``beta_2=0.999``, ``epsilon=1e-7``); the update is bitwise Keras's
    (:func:`~zero_runtime.optim.kernels.adamax_update`), its bias correction counting
    optimizer steps (``iterations // gradient_accumulation_steps``).

    State per replica on the ``offload_optimizer`` tier: float32 ``momentum`` and ``norm``
    (the weighted infinity norm): ``8 * shard_size`` bytes (about ``8 P / N``).
    """

    _zero_slots = ("momentum", "norm")

    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        """``[lr, 1 - beta_1**t]``, float32, as Keras computes them (t = step + 1)."""
        local_step = _f32(self._zero_step() + 1)
        beta_1_power = tf.pow(_f32(self.beta_1), local_step)
        return [_f32(learning_rate), 1 - beta_1_power]

    def _zero_host_step(self, slots, scratch, param, grad, scalars) -> None:
        lr, one_minus_power = scalars
        kernels.adamax_update(
            param,
            grad,
            slots["momentum"],
            slots["norm"],
            np.float32(lr),
            np.float32(1 - self.beta_1),
            np.float32(self.beta_2),
            np.float32(one_minus_power),
            np.float32(self.epsilon),
            scratch[0],
            scratch[1],
        )

    def _zero_device_delta(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        # Keras's Adamax.update_step on the shard.
        lr, one_minus_power = scalars
        m_var, u_var = slots["momentum"], slots["norm"]
        m_old, u_old = m_var.read_value(), u_var.read_value()
        m = _masked(mask, m_old + (grad - m_old) * _f32(1 - self.beta_1), m_old)
        u = _masked(mask, tf.maximum(_f32(self.beta_2) * u_old, tf.abs(grad)), u_old)
        m_var.assign(m)
        u_var.assign(u)
        return _masked_delta(mask, (lr * m) / (one_minus_power * (u + _f32(self.epsilon))))


@keras.saving.register_keras_serializable(package="zero_runtime")
class Nadam(_PartitionedUpdate, keras.optimizers.Nadam):
    """Keras ``Nadam`` with ZeRO-partitioned state (stages 1-3, any offload tier).

    Nadam: Dozat, "Incorporating Nesterov Momentum into Adam", ICLR 2016 workshop
    (Algorithm 2), with Keras's momentum schedule ``u_t = beta_1 * (1 - 0.5 * 0.96**t)``.
    Same constructor, defaults and behaviour as ``keras.optimizers.Nadam``
    (``learning_rate=0.001``, ``beta_1=0.9``, ``beta_2=0.999``, ``epsilon=1e-7``); the
    update is bitwise Keras's (:func:`~zero_runtime.optim.kernels.nadam_update`), its
    step ``t`` counting optimizer steps (``iterations // gradient_accumulation_steps``).

    State per replica on the ``offload_optimizer`` tier: float32 ``momentum`` and
    ``velocity``: ``8 * shard_size`` bytes (about ``8 P / N``). Replicated, as in Keras:
    the float32 scalar ``_u_product`` (``prod_{i<=t} u_i``), and here the int64 scalar
    ``_zero_u_steps`` (how many factors it holds), 12 bytes per replica.
    """

    _zero_slots = ("momentum", "velocity")
    _zero_u_steps = None

    def build(self, variables: list) -> None:
        """:meth:`_PartitionedUpdate.build`; with the ZeRO update, also ``_u_product``
        (float32 1.0, as Keras's ``Nadam.build``) and ``_zero_u_steps`` (int64 0). In
        fallback mode Keras's ``Nadam.build`` made ``_u_product`` and Keras's
        ``_backend_update_step`` advances it."""
        if self.built:
            return
        super().build(variables)
        if self._zero is None:
            return
        self._u_product = self.add_variable(
            (), initializer=keras.initializers.Constant(1.0), dtype="float32", name="u_product"
        )
        self._zero_u_steps = self.add_variable((), dtype="int64", name="u_product_steps")

    def _zero_u_product(self) -> tf.Tensor:
        """This replica's ``_u_product`` advanced to the step being taken, float32 scalar.

        Keras multiplies ``_u_product`` by ``u_{t} = beta_1 * (1 - 0.5 * 0.96**t)`` (t =
        ``iterations + 1``, here the optimizer step + 1) once per step, in its
        ``_backend_update_step``, before the per-variable updates; the ZeRO update does
        not run that method. Here every call in a step gives the same value and the
        variable is advanced by the first (the stage-3 row-paged tables ask for the
        scalars too; a step that failed and is retried does not advance it twice):
        ``_zero_u_steps`` counts the factors in ``_u_product``, and the product is
        advanced only when that count is not yet ``step + 1``. Each replica writes its
        own copy (as Keras's replica-context assign does; all copies are equal), so the
        assignment is valid inside ``tf.cond`` (gradient accumulation)."""
        u_var = local_copy(unwrap(self._u_product))
        n_var = local_copy(unwrap(self._zero_u_steps))
        steps = tf.cast(self._zero_step() + 1, tf.int64)
        u_old = u_var.read_value()
        # Keras: self._u_product * self.beta_1 * (1.0 - 0.5 * ops.power(0.96, t)).
        advanced = (u_old * _f32(self.beta_1)) * (
            1.0 - 0.5 * tf.pow(_f32(0.96), tf.cast(steps, tf.float32))
        )
        u = tf.where(tf.equal(n_var.read_value(), steps), u_old, advanced)
        with tf.control_dependencies([u_var.assign(u), n_var.assign(steps)]):
            return tf.identity(u)

    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        """``[lr, u_{t+1}, 1 - u_product_{t+1}, 1 - u_t, 1 - u_product_t,
        1 - beta_2**t]``, float32, as Keras's ``Nadam.update_step`` computes them."""
        local_step = _f32(self._zero_step() + 1)
        next_step = _f32(self._zero_step() + 2)
        decay = _f32(0.96)
        beta_1, beta_2 = _f32(self.beta_1), _f32(self.beta_2)
        u_t = beta_1 * (1.0 - 0.5 * tf.pow(decay, local_step))
        u_t_1 = beta_1 * (1.0 - 0.5 * tf.pow(decay, next_step))
        u_product_t = self._zero_u_product()
        u_product_t_1 = u_product_t * u_t_1
        beta_2_power = tf.pow(beta_2, local_step)
        return [
            _f32(learning_rate),
            u_t_1,
            1 - u_product_t_1,
            1 - u_t,
            1 - u_product_t,
            1 - beta_2_power,
        ]

    def _zero_host_step(self, slots, scratch, param, grad, scalars) -> None:
        lr, u_t_1, c_t_1, c_u_t, c_t, c_b2 = (np.float32(s) for s in scalars)
        one = np.float32(1)
        kernels.nadam_update(
            param,
            grad,
            slots["momentum"],
            slots["velocity"],
            lr,
            one - np.float32(self.beta_1),
            one - np.float32(self.beta_2),
            u_t_1,
            c_t_1,
            c_u_t,
            c_t,
            c_b2,
            np.float32(self.epsilon),
            scratch[0],
            scratch[1],
        )

    def _zero_device_delta(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        # Keras's Nadam.update_step on the shard.
        lr, u_t_1, c_t_1, c_u_t, c_t, c_b2 = scalars
        beta_1, beta_2 = _f32(self.beta_1), _f32(self.beta_2)
        m_var, v_var = slots["momentum"], slots["velocity"]
        m_old, v_old = m_var.read_value(), v_var.read_value()
        m = _masked(mask, m_old + (grad - m_old) * (1 - beta_1), m_old)
        v = _masked(mask, v_old + (tf.square(grad) - v_old) * (1 - beta_2), v_old)
        m_var.assign(m)
        v_var.assign(v)
        m_hat = (u_t_1 * m) / c_t_1 + (c_u_t * grad) / c_t
        v_hat = v / c_b2
        return _masked_delta(mask, (m_hat * lr) / (tf.sqrt(v_hat) + _f32(self.epsilon)))


@keras.saving.register_keras_serializable(package="zero_runtime")
class Lion(_PartitionedUpdate, keras.optimizers.Lion):
    """Keras ``Lion`` with ZeRO-partitioned state (stages 1-3, any offload tier).

    Lion: Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023
    (Algorithm 2; decoupled weight decay is Keras's ``weight_decay``, applied to the
    variables before the update). Same constructor, defaults and behaviour as
    ``keras.optimizers.Lion`` (``learning_rate=0.001``, ``beta_1=0.9``,
    ``beta_2=0.99``); the update is bitwise Keras's
    (:func:`~zero_runtime.optim.kernels.lion_update`).

    State per replica on the ``offload_optimizer`` tier: one float32 ``momentum``:
    ``4 * shard_size`` bytes (about ``4 P / N``).
    """

    _zero_slots = ("momentum",)

    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        """``[lr]``, float32."""
        return [_f32(learning_rate)]

    def _zero_host_step(self, slots, scratch, param, grad, scalars) -> None:
        (lr,) = scalars
        one = np.float32(1)
        beta_1, beta_2 = np.float32(self.beta_1), np.float32(self.beta_2)
        kernels.lion_update(
            param,
            grad,
            slots["momentum"],
            np.float32(lr),
            beta_1,
            one - beta_1,
            beta_2,
            one - beta_2,
            scratch[0],
            scratch[1],
        )

    def _zero_device_delta(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        # Keras's Lion.update_step on the shard.
        (lr,) = scalars
        beta_1, beta_2 = _f32(self.beta_1), _f32(self.beta_2)
        m_var = slots["momentum"]
        m_old = m_var.read_value()
        delta = lr * tf.sign(m_old * beta_1 + grad * (1.0 - beta_1))
        m = _masked(mask, m_old * beta_2 + grad * (1.0 - beta_2), m_old)
        m_var.assign(m)
        return _masked_delta(mask, delta)


register_partitioned(keras.optimizers.RMSprop, RMSprop, "rmsprop", "RMSprop")
register_partitioned(keras.optimizers.Adagrad, Adagrad, "adagrad", "Adagrad")
register_partitioned(keras.optimizers.Adamax, Adamax, "adamax", "Adamax")
register_partitioned(keras.optimizers.Nadam, Nadam, "nadam", "Nadam")
register_partitioned(keras.optimizers.Lion, Lion, "lion", "Lion")
