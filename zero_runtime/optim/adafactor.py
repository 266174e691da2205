"""Keras's ``Adafactor`` partitioned (ZeRO stages 1-3, optimizer states on the device).

Keras 3.15's ``Adafactor.update_step`` (Shazeer & Stern, ICML 2018, Algorithm 4 with
update clipping and the relative step size) is not element-wise. Per variable ``w`` with
gradient ``g``, at step ``t = iterations + 1``::

    rho     = min(lr, 1 / sqrt(t))               # lr first min'ed so too when relative_step
    alpha   = max(epsilon_2, rms(w)) * rho       # rms(x) = sqrt(mean(x ** 2)), whole tensor
    G       = g ** 2 + epsilon_1
    beta    = 1 - t ** beta_2_decay
    rank >= 2 (shape [..., R, C]):
        r = beta * r + (1 - beta) * mean(G, axis=-1)           # [..., R]
        c = beta * c + (1 - beta) * mean(G, axis=-2)           # [..., C]
        v = (r / mean(r, axis=-1, keepdims))[..., :, None] * c[..., None, :]
    rank < 2:
        v = beta * v + (1 - beta) * G
    u       = g / sqrt(v)
    w      -= alpha * u / max(1, rms(u) / clip_threshold)

A replica holds a contiguous piece of each variable's flat (canonical) order: its shard
of the flat buffer at stages 1-2, its rows of the moved value at stage 3. Every whole-
tensor quantity is a sum over the elements, so it is the all-reduce sum of per-shard
partial sums: one all-reduce per step of ``[row sums of G, column sums of G, sum of w ** 2
per variable]`` (the rows and columns of every variable of rank >= 2, a vector of
``sum(R + C)`` over them: small), and one of ``sum of u ** 2 per variable`` (one scalar
per variable). ``r`` and ``c`` are then computed on every replica alike and kept
replicated (Keras's own variables ``_r``/``_c``, the same on every replica: the
all-reduce's result is), ``v`` is evaluated on the replica's elements only (from ``r``
and ``c`` by each element's row and column index, or from its own state), and the
replica updates its piece of the parameters. ``v`` is the partitioned slot ``velocity``
(Keras keeps one per variable; for a variable of rank >= 2 it holds the last evaluated
``v``, as Keras's does), so ``model.save`` and checkpoints hold Keras's layout.

Not bitwise Keras's: a sum over a tensor is summed in another order (partial sums per
shard, then across replicas), so ``r``, ``c`` and the two RMS differ from Keras's in the
last bits (docs/parity.md). Supported: optimizer states on the device
(``offload_optimizer='none'``; the states other than ``velocity`` are ``O(R + C)`` per
variable), every stage, gradient accumulation, EMA, clipping, loss scaling. Refused, when
built or traced, naming the fix: ``offload_optimizer`` 'cpu' or 'nvme' (the update needs
two collectives between reading and writing the states), ``overwrite_with_gradient``
variables, row-paged embedding tables (stage 3), and a step in which a variable has no
gradient at stages 1-2 (Keras leaves its ``r`` and ``c`` unchanged; here the step's
collectives cover every variable).
"""

from __future__ import annotations

import dataclasses
import functools

import keras
import numpy as np
import tensorflow as tf

from zero_runtime import comm
from zero_runtime.optim.partition import replica_pieces
from zero_runtime.optim.partitioned import _PartitionedUpdate, register_partitioned
from zero_runtime.optim.replica_context import local_copy, replica_id, unwrap


@dataclasses.dataclass(frozen=True)
class _Factored:
    """A variable of rank >= 2: its layout position, logical shape, the axis its
    canonical order leads with (``shard_dim``, stage 3; 0 at stages 1-2), and where its
    rows and columns start in the step's concatenated row and column sums."""

    index: int
    shape: tuple[int, ...]
    shard_dim: int
    row_offset: int
    col_offset: int

    @property
    def rows(self) -> int:
        """Elements of ``r``: ``prod(shape[:-1])``."""
        return int(np.prod(self.shape[:-1]))

    @property
    def cols(self) -> int:
        """Elements of ``c``: ``prod(shape[:-2]) * shape[-1]``."""
        return int(np.prod(self.shape[:-2])) * self.shape[-1]


def _row_col(k: tf.Tensor, f: _Factored) -> tuple[tf.Tensor, tf.Tensor]:
    """The row index (into ``r``, shape ``[..., R]`` flattened) and column index (into
    ``c``, ``[..., C]`` flattened) of canonical elements ``k`` (int64) of ``f``: the C
    order of the value moved so that ``shard_dim`` leads."""
    shape, d, n = f.shape, f.shard_dim, len(f.shape)
    moved = (shape[d],) + shape[:d] + shape[d + 1 :]
    index_moved = [None] * n
    rest = k
    for j in reversed(range(n)):
        index_moved[j] = rest % moved[j]
        rest = rest // moved[j]
    logical = index_moved[1 : d + 1] + [index_moved[0]] + index_moved[d + 1 :]
    row = tf.zeros_like(k)
    for j in range(n - 1):
        row = row * shape[j] + logical[j]
    col = tf.zeros_like(k)
    for j in [*range(n - 2), n - 1]:
        col = col * shape[j] + logical[j]
    return row, col


class Adafactor(_PartitionedUpdate, keras.optimizers.Adafactor):
    """Keras ``Adafactor`` with a partitioned update (module docstring), stages 1-3.

    Same constructor and behaviour as ``keras.optimizers.Adafactor``. State per replica
    on the device: ``velocity``, float32 ``[shard_size]`` (``4 P / N`` bytes), and the
    replicated ``r``/``c`` of each variable of rank >= 2 (``4 (R + C)`` bytes each).

    Raises:
        NotImplementedError: when built with ``offload_optimizer`` 'cpu'/'nvme', an
            ``overwrite_with_gradient`` variable or a row-paged embedding table; when a
            stage 1-2 step has a variable without a gradient.
    """

    _zero_slots = ("velocity",)

    def build(self, var_list: list) -> None:
        """:meth:`_PartitionedUpdate.build`, then Keras's ``_r`` and ``_c`` (made as
        ``Adafactor.build`` makes them: a variable of shape ``shape[:-1]`` and one of
        ``shape[:-2] + shape[-1:]`` per variable of rank >= 2, a scalar otherwise)."""
        if self.built:
            return
        super().build(var_list)
        if self._zero is None:  # the stock update (Keras's build ran)
            return
        variables = list(self._trainable_variables)
        for v in variables:
            if self._overwrite_variable_with_gradient(v) or getattr(v, "row_paged", False):
                raise NotImplementedError(
                    f"Adafactor at ZeRO stage {self._zero.stage}: variable {v.path!r} is "
                    + (
                        "a row-paged embedding table (raise embedding_row_paging_threshold)"
                        if getattr(v, "row_paged", False)
                        else "overwrite_with_gradient (Keras keeps no state for it)"
                    )
                )
        self._r, self._c = [], []
        for v in variables:
            shape = tuple(int(d) for d in v.shape)
            if len(shape) < 2:
                self._r.append(keras.Variable(0, name=v.name, trainable=False))
                self._c.append(keras.Variable(0, name=v.name, trainable=False))
            else:
                self._r.append(self.add_variable(shape[:-1], dtype="float32", name=v.name))
                self._c.append(
                    self.add_variable(shape[:-2] + shape[-1:], dtype="float32", name=v.name)
                )
        if self._zero.group is None:  # stage 3: the collectives of the update
            impl = getattr(self._distribution_strategy, "reduce_scatter_impl", None)
            seconds = self._zero.config.collective_timeout_seconds
            with tf.init_scope():
                self._zero.group = comm.CollectiveGroup.create(
                    self._zero.devices, impl, timeout_seconds=seconds
                )

    def _zero_make_store(self, config, layout, devices):
        """The device store (:meth:`_PartitionedUpdate._zero_make_store`).

        Raises:
            NotImplementedError: ``offload_optimizer`` other than 'none'.
        """
        if config.offload_optimizer != "none":
            raise NotImplementedError(
                f"Adafactor at ZeRO stage {config.stage} with "
                f"offload_optimizer={config.offload_optimizer!r}: its update needs two "
                "all-reduces between reading and writing the states, which the host and "
                "NVMe stores' update does not have; set offload_optimizer='none' (its "
                "states besides velocity are O(rows + columns) per variable)"
            )
        return super()._zero_make_store(config, layout, devices)

    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        """``[rho, beta]`` of the module docstring, float32, as Keras computes them."""
        lr = tf.cast(learning_rate, tf.float32)
        local_step = tf.cast(self._zero_step() + 1, tf.float32)
        if not callable(self._learning_rate) and self.relative_step:
            lr = tf.minimum(lr, 1 / tf.sqrt(local_step))
        rho = tf.minimum(lr, 1 / tf.sqrt(local_step))
        beta = 1 - tf.pow(local_step, tf.constant(self.beta_2_decay, tf.float32))
        return [rho, beta]

    def _zero_device_step(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        """The new parameter shard (module docstring), then the EMA's average if any.

        Raises:
            NotImplementedError: ``mask`` given (a variable without a gradient).
        """
        own, ema = self._zero_split_scalars(scalars)
        if mask is not None:
            raise NotImplementedError(
                "Adafactor at ZeRO stages 1-2: a variable has no gradient in this step; "
                "Keras leaves its factored statistics unchanged, which the partitioned "
                "update does not do: train only variables the loss reaches"
            )
        new = self._zero_factored_step(slots["velocity"], param, grad, *own)
        return new if ema is None else self._zero_ema_device(slots, new, ema)

    # -- the update --------------------------------------------------------------------
    @functools.cached_property
    def _zero_factored(self) -> tuple[_Factored, ...]:
        """The variables of rank >= 2, in layout order, with their row/column offsets."""
        out, rows, cols = [], 0, 0
        for i, v in enumerate(self._zero_layout_variables()):
            shape = tuple(int(d) for d in v.shape)
            if len(shape) >= 2:
                f = _Factored(i, shape, int(getattr(v, "shard_dim", 0)), rows, cols)
                out.append(f)
                rows, cols = rows + f.rows, cols + f.cols
        return tuple(out)

    def _zero_layout_variables(self) -> list:
        return self._zero3_variables if self._zero.stage == 3 else self._trainable_variables

    def _zero_segments(self, replica: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        """Per element of ``replica``'s shard (int64 ``[shard_size]`` each): its variable
        (the variable count for padding), its row and its column in the concatenated
        ``r`` and ``c`` (their totals for elements of variables of rank < 2 and for
        padding), and whether its variable has rank >= 2 (bool)."""
        layout = self._zero.layout
        variables = self._zero_layout_variables()
        sizes = [int(np.prod(tuple(v.shape))) for v in variables]
        factored = {f.index: f for f in self._zero_factored}
        last = self._zero_factored[-1] if self._zero_factored else None
        n_rows = last.row_offset + last.rows if last else 0
        n_cols = last.col_offset + last.cols if last else 0
        var_ids, row_ids, col_ids, is_factored = [], [], [], []

        def fill(count: int, var: int, row: int, col: int, flag: bool) -> None:
            var_ids.append(tf.fill([count], tf.constant(var, tf.int64)))
            row_ids.append(tf.fill([count], tf.constant(row, tf.int64)))
            col_ids.append(tf.fill([count], tf.constant(col, tf.int64)))
            is_factored.append(tf.fill([count], flag))

        at = 0
        for p in replica_pieces(layout, replica, sizes):
            if p.shard_offset > at:  # padding
                fill(p.shard_offset - at, len(sizes), n_rows, n_cols, False)
            f = factored.get(p.var)
            if f is None:
                fill(p.count, p.var, n_rows, n_cols, False)
            else:
                k = tf.range(p.start, p.start + p.count, dtype=tf.int64)
                row, col = _row_col(k, f)
                var_ids.append(tf.fill([p.count], tf.constant(p.var, tf.int64)))
                row_ids.append(row + f.row_offset)
                col_ids.append(col + f.col_offset)
                is_factored.append(tf.fill([p.count], True))
            at = p.shard_offset + p.count
        if layout.shard_size > at:
            fill(layout.shard_size - at, len(sizes), n_rows, n_cols, False)
        return tuple(tf.concat(x, axis=0) for x in (var_ids, row_ids, col_ids, is_factored))

    def _zero_factored_step(self, v_var, param, grad, rho, beta) -> tf.Tensor:
        """TensorFlow ops of one step on ``replica``'s shard: update the replicated
        ``r``/``c`` and the ``velocity`` slot ``v_var``, return the new parameters
        (float32 ``[shard_size]``; padding elements unchanged)."""
        zs = self._zero
        group = zs.group
        variables = self._zero_layout_variables()
        n_vars = len(variables)
        sizes = tf.constant([max(1, int(np.prod(tuple(v.shape)))) for v in variables], tf.float32)
        var_id, row_id, col_id, is_factored = self._zero_segments(replica_id())
        factored = self._zero_factored
        n_rows = factored[-1].row_offset + factored[-1].rows if factored else 0
        n_cols = factored[-1].col_offset + factored[-1].cols if factored else 0
        eps1 = tf.constant(self.epsilon_1, tf.float32)
        gsq = tf.square(grad) + eps1  # Keras: ops.add(ops.square(gradient), epsilon_1)
        # One all-reduce: the row and column sums of G, and sum(w ** 2) per variable.
        partial = tf.concat(
            [
                tf.math.unsorted_segment_sum(gsq, row_id, n_rows + 1)[:n_rows],
                tf.math.unsorted_segment_sum(gsq, col_id, n_cols + 1)[:n_cols],
                tf.math.unsorted_segment_sum(tf.square(param), var_id, n_vars + 1)[:n_vars],
            ],
            axis=0,
        )
        total = comm.all_reduce_sum_flat(partial, group)
        row_sum, col_sum, param_sq = tf.split(total, [n_rows, n_cols, n_vars])
        r_norm, c_all = [], []
        for f in factored:
            r_var = local_copy(unwrap(self._r[f.index]))
            c_var = local_copy(unwrap(self._c[f.index]))
            rows = row_sum[f.row_offset : f.row_offset + f.rows]
            cols = col_sum[f.col_offset : f.col_offset + f.cols]
            row_mean = tf.reshape(rows / f.shape[-1], f.shape[:-1])
            col_mean = tf.reshape(cols / f.shape[-2], f.shape[:-2] + f.shape[-1:])
            r = beta * r_var.read_value() + (1 - beta) * row_mean
            c = beta * c_var.read_value() + (1 - beta) * col_mean
            r_var.assign(r)
            c_var.assign(c)
            r_norm.append(tf.reshape(r / tf.reduce_mean(r, axis=-1, keepdims=True), [-1]))
            c_all.append(tf.reshape(c, [-1]))
        one = [tf.ones([1], tf.float32)]  # the entry of elements of rank < 2 and padding
        v_factored = tf.gather(tf.concat(r_norm + one, 0), row_id) * tf.gather(
            tf.concat(c_all + one, 0), col_id
        )
        v_own = beta * v_var.read_value() + (1 - beta) * gsq
        v = tf.where(is_factored, v_factored, v_own)
        v_var.assign(v)
        u = grad / tf.sqrt(v)
        # The second all-reduce: sum(u ** 2) per variable.
        u_sq = comm.all_reduce_sum_flat(
            tf.math.unsorted_segment_sum(tf.square(u), var_id, n_vars + 1)[:n_vars], group
        )
        rms_u = tf.sqrt(u_sq / sizes)
        rms_w = tf.sqrt(param_sq / sizes)
        eps2 = tf.constant(self.epsilon_2, tf.float32)
        alpha = tf.maximum(eps2, rms_w) * rho
        clip = tf.constant(self.clip_threshold, tf.float32)
        denominator = tf.maximum(tf.constant(1.0, tf.float32), rms_u / clip)
        # Padding (var_id == n_vars): alpha 0, denominator 1, so the element is unchanged.
        alpha = tf.concat([alpha, tf.zeros([1])], 0)
        denominator = tf.concat([denominator, tf.ones([1])], 0)
        u_hat = u / tf.gather(denominator, var_id)
        return param - tf.gather(alpha, var_id) * u_hat


register_partitioned(keras.optimizers.Adafactor, Adafactor, "adafactor", "Adafactor")
