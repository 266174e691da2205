"""Stages 1-2: the ZeRO update of a flat parameter buffer (a mixin of the partitioned
optimizer, :mod:`zero_runtime.optim.partitioned`).

The replica's gradients are flattened bucket by bucket (:mod:`.layout`) and reduced
(stage 1 all-reduce, stage 2 reduce-scatter: :mod:`zero_runtime.comm`), its shard is
updated on the optimizer-state tier (device ops, or a host call for 'cpu'/'nvme' states),
and the new shards are all-gathered into the replicated variables. Gradient accumulation
is done here (:meth:`FlatShardUpdate._backend_apply_gradients`).

A host update's output gates Keras's ``iterations.assign_add(1)``
(:func:`iteration_gate`): a step whose update raised is not counted, and its NVMe states
roll back (:mod:`.transaction`). AdamW's decoupled weight decay is applied inside the host
update for the same reason (the variables change only when the step's shards are assigned).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from zero_runtime import comm
from zero_runtime.lifecycle import host_function
from zero_runtime.optim import kernels
from zero_runtime.optim.device_state import DeviceOptimizerState
from zero_runtime.optim.replica_context import local_copy, replica_id, unwrap
from zero_runtime.optim.split_state import SplitOptimizerState
from zero_runtime.optim.split_update import SplitShardUpdate

#: Per thread (each replica's function is traced on its own thread): the gate tokens of
#: the step being traced and the control-dependency scopes opened on them.
_GATES = threading.local()


def _open_gates() -> list:
    return _GATES.__dict__.setdefault("open", [])


@contextlib.contextmanager
def iteration_gate() -> Iterator[None]:
    """Around Keras's ``apply``: the control-dependency scopes the update opened on its
    host calls (:meth:`FlatShardUpdate._zero_open_gate`) are closed on the way out, after
    Keras's ``iterations.assign_add(1)`` was traced inside them."""
    gates = _open_gates()
    depth = len(gates)
    try:
        yield
    finally:
        while len(gates) > depth:
            gates.pop().__exit__(None, None, None)


class FlatShardUpdate(SplitShardUpdate):
    """The stage 1-2 update; mixed into the partitioned optimizer (which provides
    ``_zero``, ``_zero_step``, ``_zero_learning_rate``, the subclass hooks
    ``_zero_scalars``/``_zero_host_step``/``_zero_device_step`` and, from
    :class:`~zero_runtime.optim.transaction.TransactionalUpdate`, ``_zero_begin``). The
    partial-offload update of a split store is :class:`~.split_update.SplitShardUpdate`'s."""

    _zero: Any = None

    def _zero_gate_tokens(self) -> list:
        """Tensors that must exist before Keras increments ``iterations`` this step (the
        host updates' outputs): :meth:`_zero_open_gate` makes the increment wait for them."""
        return _GATES.__dict__.setdefault("tokens", [])

    def _zero_open_gate(self) -> None:
        """Enter a control-dependency scope on this step's gate tokens; :meth:`apply`
        leaves it after Keras's ``iterations.assign_add(1)``, so a step whose host update
        raised does not count (and its states roll back, nvme_state.StepTransaction)."""
        tokens = self._zero_gate_tokens()
        if not tokens or not tf.inside_function():
            tokens.clear()
            return
        gate = tf.control_dependencies(list(tokens))
        tokens.clear()
        gate.__enter__()
        _open_gates().append(gate)

    def _backend_apply_gradients(self, grads: list, trainable_variables: list) -> None:
        zs = self._zero
        self._zero_gate_tokens().clear()
        if zs is None or self.gradient_accumulation_steps:  # stock, or Keras's own
            super()._backend_apply_gradients(grads, trainable_variables)
            self._zero_open_gate()
            return
        if zs.accumulation_steps == 1:
            # Keras's _backend_apply_gradients without its EMA block: a partitioned
            # average is advanced by the shard update itself (ema.py).
            grads = self._clip_gradients(grads)
            self._apply_weight_decay(trainable_variables)
            self._backend_update_step(grads, trainable_variables, self.learning_rate)
            self._zero_open_gate()
            return
        n_acc = zs.accumulation_steps
        lr = self._zero_learning_rate()
        by_pos = self._zero_by_pos(grads, trainable_variables)
        active = tuple(g is not None for g in by_pos)
        replica = replica_id()
        acc = zs.accumulators[replica % len(zs.accumulators)]  # global id -> local record
        is_update = tf.equal((self._iterations + 1) % n_acc, 0)
        if zs.stage >= 2:
            addend = self._zero_reduce(self._zero_bucket_flats(by_pos), by_pos)

            def apply_total(total):
                total = self._zero_clip_shard(total)
                self._zero_weight_decay(trainable_variables, lr)
                self._zero_apply_shard(total, active, lr, in_cond=True)

        else:
            addend = tf.concat(self._zero_bucket_flats(by_pos), axis=0)  # (padded_total,)

            def apply_total(total):
                grads_now = self._zero_unflatten(total, active)
                clipped = self._clip_gradients([g for g in grads_now if g is not None])
                it = iter(clipped)
                grads_now = [next(it) if g is not None else None for g in grads_now]
                self._zero_weight_decay(trainable_variables, lr)
                flats = self._zero_bucket_flats(grads_now)
                shard = self._zero_reduce(flats, grads_now, raw=True)
                self._zero_apply_shard(shard, active, lr, in_cond=True)

        def update():
            apply_total((addend + acc) / n_acc)  # as Keras: (g + acc_g) / steps
            acc.assign(tf.zeros_like(acc))
            return tf.constant(1)

        def accumulate():
            acc.assign_add(addend)
            return tf.constant(0)

        stepped = tf.cond(is_update, update, accumulate)
        tokens = self._zero_gate_tokens()
        tokens.clear()  # made inside the cond: the cond's output stands for them
        tokens.append(stepped)
        self._zero_open_gate()

    def _backend_update_step(self, grads: list, trainable_variables: list, learning_rate) -> None:
        if self._zero is None:
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        by_pos = self._zero_by_pos(grads, trainable_variables)
        active = tuple(g is not None for g in by_pos)
        group = self._zero.group
        # The step's raw collectives on this replica's token (stage 2's reduce-scatter and
        # the all-gather) share one watchdog deadline: two host callbacks, not four.
        span = (
            comm.one_deadline(group.token_variable(replica_id()))
            if group is not None
            else contextlib.nullcontext()
        )
        with span:
            shard = self._zero_reduce(self._zero_bucket_flats(by_pos), by_pos)
            self._zero_apply_shard(shard, active, learning_rate)

    def _zero_by_pos(self, grads: list, trainable_variables: list) -> list:
        """Gradients in layout order (None for variables without one), densified."""
        index = {id(unwrap(v)): i for i, v in enumerate(self._trainable_variables)}
        by_pos: list[Any] = [None] * len(self._zero.layout.sizes)
        for g, v in zip(grads, trainable_variables):
            if g is not None:
                # Sparse gradients (tf.IndexedSlices from embedding lookups) are densified
                # per replica: the dense update of the summed gradient (see docs/parity.md).
                by_pos[index[id(unwrap(v))]] = (
                    tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                )
        return by_pos

    def _zero_bucket_flats(self, by_pos: list) -> list[tf.Tensor]:
        """One padded float32 ``[n * piece_size_b]`` buffer per bucket, in bucket order.

        Each gradient is reshaped to its variable's element count from the layout (the
        variables' static shapes), not ``[-1]``: a gradient's shape may be unknown at
        trace time (a ``Dense`` on 3-D input with a batch or sequence length of None),
        and the collectives need a static buffer length."""
        layout = self._zero.layout
        flats = []
        for b in layout.buckets:
            parts = [
                tf.reshape(tf.cast(by_pos[i], tf.float32), [layout.sizes[i]])
                if by_pos[i] is not None
                else tf.zeros([layout.sizes[i]], tf.float32)
                for i in range(b.var_start, b.var_end)
            ]
            pad = b.padded_size(layout.num_shards) - b.size
            if pad:
                parts.append(tf.zeros([pad], tf.float32))
            flats.append(tf.concat(parts, axis=0) if len(parts) > 1 else parts[0])
        return flats

    def _zero_param_shard(self, variables: list, shard: int) -> tf.Tensor:
        """Shard ``shard`` of the parameters, float32 ``[shard_size]``: the pieces of the
        padded flat buffer that shard owns, read from only the variables they cover.

        Equal to slicing the flat buffer of every variable (:meth:`_zero_bucket_flats`)
        but copies ``shard_size`` elements instead of the whole ``padded_total``."""
        layout = self._zero.layout
        parts = []
        for b in layout.buckets:
            lo = b.flat_offset + shard * b.piece_size
            hi = lo + b.piece_size
            for i in range(b.var_start, b.var_end):
                begin = layout.offsets[i]
                start, end = max(lo, begin), min(hi, begin + layout.sizes[i])
                if start >= end:
                    continue
                flat = tf.reshape(tf.cast(variables[i], tf.float32), [layout.sizes[i]])
                if end - start < layout.sizes[i]:
                    flat = flat[start - begin : end - begin]
                parts.append(flat)
            pad = b.piece_size - max(0, min(hi, b.flat_offset + b.size) - lo)
            if pad:
                parts.append(tf.zeros([pad], tf.float32))
        return tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]

    def _zero_unflatten(self, flat: tf.Tensor, active: tuple[bool, ...]) -> list:
        """Per-variable tensors (None where inactive) from a padded flat buffer."""
        layout = self._zero.layout
        return [
            tf.reshape(flat[off : off + size], shape) if on else None
            for off, size, shape, on in zip(layout.offsets, layout.sizes, layout.shapes, active)
        ]

    def _zero_reduce(
        self, bucket_flats: list[tf.Tensor], by_pos: list, raw: bool = False
    ) -> tf.Tensor:
        """Reduce the buckets (backward order) and return this replica's gradient shard,
        float32 ``[shard_size]`` (``raw``: the runtime's own collectives, inside tf.cond)."""
        zs = self._zero
        pieces = comm.reduce_buckets(
            list(reversed(bucket_flats)),
            scatter=zs.stage >= 2,
            group=zs.group,
            overlap=zs.config.overlap_comm,
            wait_for=[g for g in by_pos if g is not None],
            raw=raw,
        )
        pieces.reverse()  # bucket order == shard order
        return tf.concat(pieces, axis=0) if len(pieces) > 1 else pieces[0]

    def _zero_clip_shard(self, shard: tf.Tensor) -> tf.Tensor:
        """Clip a reduced gradient shard as Keras clips a gradient list, norms across shards.

        Used at stage 2 with accumulation, where no replica holds a full gradient: the
        global norm is ``sqrt(all_reduce(sum(shard ** 2)))`` (of the summed gradient, not
        of each replica's gradient as stock Keras under MirroredStrategy).

        Raises:
            NotImplementedError: ``clipnorm`` (per-variable norms across shards).
        """
        if self.clipnorm and self.clipnorm > 0:
            raise NotImplementedError(
                "clipnorm with stage 2 and gradient accumulation is not supported; "
                "use global_clipnorm or clipvalue"
            )
        if self.global_clipnorm and self.global_clipnorm > 0:
            sq = comm.all_reduce_sum_flat(
                tf.reshape(tf.reduce_sum(tf.square(shard)), [1]), self._zero.group
            )
            use_norm = tf.sqrt(sq[0])
            clip = tf.cast(self.global_clipnorm, tf.float32)
            scale = clip * tf.minimum(1.0 / use_norm, 1.0 / clip) + (use_norm - use_norm)
            return shard * scale
        if self.clipvalue and self.clipvalue > 0:
            return tf.clip_by_value(shard, -self.clipvalue, self.clipvalue)
        return shard

    def _zero_decays_in_update(self) -> bool:
        """True when the host update applies the weight decay itself (states on the host
        or NVMe, stages 1-2): Keras's own decay of the variables is then skipped."""
        zs = self._zero
        return zs is not None and zs.stage < 3 and not isinstance(zs.store, DeviceOptimizerState)

    def _apply_weight_decay(self, variables):
        if self._zero_decays_in_update():
            return  # in the update (_zero_host_update)
        return super()._apply_weight_decay(variables)

    def _zero_weight_decay(self, variables: list, learning_rate) -> None:
        """Keras's decoupled weight decay (``TFOptimizer._apply_weight_decay``:
        ``v -= v * wd * lr``) with the learning rate of the optimizer step rather than of
        the micro-step. Runs inside ``tf.cond``, where ``merge_call`` is not allowed, so
        each replica updates its own copy of the (mirrored) variable. Skipped when the
        host update applies it (:meth:`_zero_decays_in_update`)."""
        if self.weight_decay is None or self._zero_decays_in_update():
            return
        for variable in variables:
            variable = unwrap(variable)
            if self._use_weight_decay(variable):
                local = local_copy(variable)
                lr = tf.cast(learning_rate, local.dtype)
                wd = tf.cast(self.weight_decay, local.dtype)
                local.assign_sub(local * wd * lr)

    def _zero_apply_shard(
        self, grad_shard: tf.Tensor, active: tuple[bool, ...], lr, in_cond: bool = False
    ) -> None:
        """Update this replica's parameter shard with ``grad_shard``, all-gather the shards
        and assign the active variables (each replica its own copy when ``in_cond``:
        ``merge_call`` is not allowed inside ``tf.cond``; the values are identical)."""
        zs = self._zero
        layout = zs.layout
        n = layout.num_shards
        all_vars = [unwrap(v) for v in self._trainable_variables]
        replica = replica_id()
        param_shard = self._zero_param_shard(all_vars, replica)
        scalars = self._zero_step_scalars(lr)  # with the EMA's (ema.py)
        step = self._zero_step()
        if isinstance(zs.store, DeviceOptimizerState):
            mask = None
            if not all(active):
                m = np.zeros(layout.shard_size, bool)
                for s, e in layout.active_ranges(replica, active):
                    m[s:e] = True
                mask = tf.constant(m)
            new_shard = self._zero_device_step(
                zs.store.slots(replica), param_shard, grad_shard, scalars, mask
            )
            with tf.control_dependencies([new_shard]):
                self._zero_tick_op(replica, step)
        elif isinstance(zs.store, SplitOptimizerState):
            new_shard = self._zero_split_step(
                zs.store, replica, param_shard, grad_shard, active, lr, scalars, step
            )
        else:
            # AdamW's decoupled weight decay is applied here, in the update (not by Keras
            # on the variables first), so a step that fails leaves the weights untouched.
            decayed = tuple(
                on and self.weight_decay is not None and self._use_weight_decay(v)
                for on, v in zip(active, self._trainable_variables)
            )
            host_fn = functools.partial(
                self._zero_host_update, replica=replica, active=active, decayed=decayed
            )
            wd = tf.cast(self.weight_decay if self.weight_decay else 0.0, tf.float32)
            new_shard = host_function(
                host_fn,
                [step, grad_shard, param_shard, wd, tf.cast(lr, tf.float32), *scalars],
                tf.float32,
                stateful=True,
                name="zero_host_update",
            )
            self._zero_gate_tokens().append(new_shard)
        new_shard.set_shape([layout.shard_size])
        gathered = comm.all_gather_flat(new_shard, zs.group)  # raw: one collective
        rows = tf.reshape(gathered, [n, layout.shard_size])
        chosen = []
        assigned = self._zero_assigned(active)  # all on EMA overwrite steps (ema.py)
        for b in layout.buckets:
            bucket = tf.reshape(rows[:, b.shard_offset : b.shard_offset + b.piece_size], [-1])
            for i in range(b.var_start, b.var_end):
                if assigned[i]:
                    off = layout.offsets[i] - b.flat_offset
                    value = tf.reshape(bucket[off : off + layout.sizes[i]], layout.shapes[i])
                    chosen.append((value, all_vars[i]))
        if not chosen:
            return
        if in_cond:
            for value, var in chosen:
                local = local_copy(var)
                local.assign(tf.cast(value, local.dtype))
            return

        def _assign(distribution, values_and_vars):
            for value, var in values_and_vars:
                distribution.extended.update(
                    var, lambda a, b: a.assign(tf.cast(b, a.dtype)), args=(value,), group=False
                )

        tf.__internal__.distribute.interim.maybe_merge_call(
            _assign, self._distribution_strategy, chosen
        )

    def _zero_tick_op(self, replica: int, step: tf.Tensor) -> tf.Tensor:
        """Graph: the step clock, a host call telling the runtime that ``replica``
        finished optimizer step ``step`` (int64 scalar, returned once it ran)."""
        return host_function(
            functools.partial(self._zero_tick, replica=replica),
            [step],
            tf.int64,
            stateful=True,
            name="zero_step_clock",
        )

    def _zero_tick(self, step: np.ndarray, replica: int) -> np.int64:
        if self._zero.runtime is not None:
            self._zero.runtime.on_shard_updated(self, replica, int(step), 0.0)
        return np.int64(step)

    def _zero_host_update(self, step: np.ndarray, *args: np.ndarray, **kw) -> np.ndarray:
        """The whole-shard host update as one host call: :meth:`_zero_host_compute` (same
        arguments), then the step reported to the runtime."""
        param, seconds = self._zero_host_compute(step, *args, **kw)
        if self._zero.runtime is not None:
            self._zero.runtime.on_shard_updated(self, kw["replica"], int(step), seconds)
        return param

    def _zero_host_compute(
        self,
        step: np.ndarray,
        grad: np.ndarray,
        param: np.ndarray,
        wd: np.ndarray,
        lr: np.ndarray,
        *scalars: np.ndarray,
        replica: int,
        active: tuple[bool, ...],
        decayed: tuple[bool, ...],
        out: np.ndarray | None = None,
    ) -> tuple[np.ndarray, float]:
        """The host update of ``replica``'s shard on the store's tier: the new parameter
        elements (float32, ``param``'s shape, in ``out`` if given, else in a new
        :func:`~.kernels.aligned_empty` buffer, which TensorFlow takes as the host call's
        output without a copy; ``param`` is not written) and the seconds it took."""
        start = time.perf_counter()
        zs = self._zero
        if out is None:
            out = kernels.aligned_empty(len(param))
        np.copyto(out, param)
        param = out
        if any(decayed):  # Keras: v - v * wd * lr, before the update
            for s, e in zs.layout.active_ranges(replica, decayed):
                kernels.weight_decay(param[s:e], wd, lr)
        self._zero_begin(replica, int(step))
        self._zero_store_update(replica, active, param, grad, scalars, int(step))  # ema.py
        return param, time.perf_counter() - start
