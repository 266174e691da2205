"""Keras's model-weight EMA (``use_ema``) as a partitioned optimizer state, at stages 1-3.

Keras 3 (``keras/src/optimizers/base_optimizer.py``) keeps, with ``use_ema=True``, one
``"average"`` variable per trainable variable and after every update step computes

    momentum = float32(iterations != 0) * ema_momentum        # 0 on the first step
    average  = momentum * average + (1 - momentum) * variable  # the updated variable

(``_update_model_variables_moving_average``, ``iterations`` read before its increment);
with ``ema_overwrite_frequency`` = F it then assigns ``variable = average`` when
``(iterations + 1) % F == 0`` (``_overwrite_model_variables_with_average_value``), and
``finalize_variable_values``, which ``fit`` calls when training ends, assigns every
variable its average.

Here the average is one more slot of the optimizer-state store, :data:`EMA_SLOT`
(``"average"``: Keras's own name, so ``model.save`` writes it where the stock optimizer
keeps ``_model_variables_moving_average``, :mod:`.keras_saving`): each replica keeps the
average of the parameter elements its shard updates, on the tier ``offload_optimizer``
selects (device variables, host buffers or NVMe pages), checkpointed with the other slots
(:mod:`.training_state`). The average is advanced inside the shard update, right after
the optimizer's own step on the same elements, with Keras's operations in Keras's order
(host: :func:`~zero_runtime.optim.kernels.ema_update`; device: :meth:`ShardEma.
_zero_ema_device`), so it is bitwise Keras's wherever the parameter update is. On an
overwrite step the updated shard becomes the average before it is written (stage 3) or
all-gathered and assigned (stages 1-2, where every variable is then assigned, also those
without a gradient this step). With ``ZeroConfig.gradient_accumulation_steps`` = N the
average advances once per optimizer step and ``iterations`` above counts optimizer steps
(``iterations // N``): N micro-batches equal one step on the N-times-larger batch.

Not supported (raised when the optimizer is built, naming the fix): row-paged embedding
tables at stage 3 (only touched rows are updated; the average of every row moves every
step), partial optimizer offload (``offload_optimizer_ratio`` < 1), variables with
``overwrite_with_gradient``, and, at stages 1-2, several worker processes
(``finalize_variable_values`` gathers the averages in one process).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import tensorflow as tf

from zero_runtime.optim import kernels
from zero_runtime.optim.replica_context import local_replicas, unwrap

#: The slot holding the average (Keras's ``add_optimizer_variables(variables, "average")``).
EMA_SLOT = "average"
#: Scalars the EMA appends to the optimizer's own (:meth:`ShardEma._zero_step_scalars`):
#: ``momentum``, ``1 - momentum`` and ``overwrite`` (1.0 on an overwrite step, else 0.0).
EMA_SCALARS = 3


def ema_scalars(step: tf.Tensor, ema_momentum: float, overwrite_frequency: int | None) -> list:
    """The EMA's scalars of optimizer step ``step``, as Keras computes them.

    Args:
        step: int64 scalar, the optimizer step before its increment (Keras's
            ``iterations``; ``iterations // N`` with gradient accumulation).
        ema_momentum: Keras's ``ema_momentum`` (float in [0, 1]).
        overwrite_frequency: Keras's ``ema_overwrite_frequency`` (int >= 1) or None.

    Returns:
        float32 scalars ``[momentum, 1 - momentum, overwrite]``: ``momentum =
        float32(step != 0) * ema_momentum`` and ``1 - momentum`` in float32 (Keras's
        ``ops.multiply(ops.cast(not_first_step, dtype), ema_momentum)`` and
        ``ops.subtract(1, momentum)``); ``overwrite`` 1.0 when ``(step + 1) % F == 0``,
        else 0.0 (always 0.0 without a frequency).
    """
    not_first = tf.cast(tf.not_equal(step, 0), tf.float32)
    momentum = not_first * tf.constant(ema_momentum, tf.float32)
    rest = tf.constant(1.0, tf.float32) - momentum
    if overwrite_frequency:
        overwrite = tf.cast(tf.equal((step + 1) % overwrite_frequency, 0), tf.float32)
    else:
        overwrite = tf.constant(0.0, tf.float32)
    return [momentum, rest, overwrite]


class ShardEma:
    """The EMA of the partitioned optimizer (module docstring); mixed into
    ``_PartitionedUpdate`` (zero_runtime/optim/partitioned.py), which provides ``_zero``,
    ``_zero_step``, the subclass hooks (``_zero_scalars``, ``_zero_host_step``) and the
    stage-3 shard writes (``_zero3_write_shards``)."""

    _zero: Any = None

    # -- build -------------------------------------------------------------------------
    def _zero_store_slots(self) -> tuple[str, ...]:
        """The store's slots: the optimizer's own (``_zero_slots``), then :data:`EMA_SLOT`
        with ``use_ema``."""
        return tuple(self._zero_slots) + ((EMA_SLOT,) if self.use_ema else ())

    def _zero_keras_build(self, build, variables: list) -> None:
        """Keras's ``BaseOptimizer.build`` (``build``, unbound) without its replicated
        ``_model_variables_moving_average``: the average is a partitioned slot here."""
        ema = self.use_ema
        self.use_ema = False
        try:
            build(self, variables)
        finally:
            self.use_ema = ema

    def _zero_ema_refuse(self, variables: list, config: Any, stage: int, workers: int) -> None:
        """Raise when the EMA cannot be kept partitioned for this build (module docstring).

        Args:
            variables: the trainable variables the optimizer is built on.
            config: the active ``ZeroConfig``.
            stage: 1, 2 or 3.
            workers: worker processes in the job.

        Raises:
            NotImplementedError: naming the cause and the fix.
        """
        if not self.use_ema:
            return
        cause = None
        paged = [v for v in variables if getattr(v, "row_paged", False)]
        overwritten = [v for v in variables if self._overwrite_variable_with_gradient(v)]
        if paged:
            cause = (
                f"the row-paged embedding table {paged[0].path!r} updates only the rows a "
                "step touches, and the average of every row moves every step; raise "
                "embedding_row_paging_threshold above its size"
            )
        elif overwritten:
            cause = (
                f"variable {overwritten[0].path!r} has overwrite_with_gradient (Keras keeps "
                "no average of it)"
            )
        elif config.offload_optimizer_ratio < 1.0 and config.offload_optimizer == "cpu":
            cause = "partial optimizer offload keeps no average; set offload_optimizer_ratio=1.0"
        elif stage < 3 and workers > 1:
            cause = (
                f"finalize_variable_values gathers the averages in one process, and the "
                f"shards are on {workers} workers; use stage 3 (each replica writes its own)"
            )
        if cause is not None:
            raise NotImplementedError(
                f"{type(self).__name__}(use_ema=True) at ZeRO stage {stage}: {cause}, or "
                "pass use_ema=False"
            )

    # -- the step ----------------------------------------------------------------------
    def _zero_step_scalars(self, learning_rate) -> list[tf.Tensor]:
        """The scalars of one update: the optimizer's (``_zero_scalars``), then with
        ``use_ema`` the :data:`EMA_SCALARS` of :func:`ema_scalars`. Each path hands them
        to :meth:`_zero_tile_step` (host) or ``_zero_device_step`` (device)."""
        scalars = list(self._zero_scalars(learning_rate))
        if not self.use_ema:
            return scalars
        ema = ema_scalars(self._zero_step(), self.ema_momentum, self.ema_overwrite_frequency)
        return scalars + ema

    def _zero_split_scalars(self, scalars) -> tuple[list, list | None]:
        """``(the optimizer's scalars, the EMA's or None)`` of :meth:`_zero_step_scalars`."""
        scalars = list(scalars)
        if not self.use_ema:
            return scalars, None
        return scalars[:-EMA_SCALARS], scalars[-EMA_SCALARS:]

    def _zero_tile_step(self, slots, scratch, param, grad, scalars) -> None:
        """The host step of one tile (``host_state.StepFn`` with ``scalars`` bound): the
        optimizer's ``_zero_host_step``, then the average of the updated elements
        (:func:`~zero_runtime.optim.kernels.ema_update`; on an overwrite step ``param``
        becomes the average)."""
        own, ema = self._zero_split_scalars(scalars)
        self._zero_host_step(slots, scratch, param, grad, own)
        if ema is not None:
            _ema_tile(slots, scratch, param, ema)

    def _zero_ema_tile(self, slots, scratch, param, grad, scalars) -> None:
        """The average alone of one tile (a variable without a gradient this step: Keras
        averages every trainable variable every step); ``grad`` is not read."""
        del grad
        _, ema = self._zero_split_scalars(scalars)
        _ema_tile(slots, scratch, param, ema)

    def _zero_store_update(
        self, replica: int, active: tuple[bool, ...], param, grad, scalars, step: int
    ) -> None:
        """Stages 1-2, host and NVMe states: update ``replica``'s shard over the active
        variables' ranges (:meth:`_zero_tile_step`) and, with ``use_ema``, average the
        inactive ones' elements too (:meth:`_zero_ema_tile`, a second pass of the same
        step over the other ranges).

        Args:
            replica: the replica id.
            active: per variable, whether it has a gradient this step.
            param: float32 ``[shard_size]`` parameter shard, updated in place.
            grad: float32 ``[shard_size]`` reduced gradient shard.
            scalars: :meth:`_zero_step_scalars`'s values.
            step: the optimizer step (the store's transaction).
        """
        zs = self._zero
        ranges = zs.layout.active_ranges(replica, active)
        step_fn = functools.partial(self._zero_tile_step, scalars=scalars)
        rest = ()
        if self.use_ema and not all(active):
            rest = zs.layout.active_ranges(replica, tuple(not a for a in active))
        if not rest:
            zs.store.update(replica, ranges, param, grad, step_fn, step=step)
            return
        zs.store.update(replica, ranges, param, grad, step_fn, count=False, step=step)
        ema_fn = functools.partial(self._zero_ema_tile, scalars=scalars)
        zs.store.update(replica, rest, param, grad, ema_fn, step=step)

    def _zero_assigned(self, active: tuple[bool, ...]) -> tuple[bool, ...]:
        """Stages 1-2: the variables assigned from the all-gathered shards: the active
        ones, or every one when an overwrite step may write the averages
        (``ema_overwrite_frequency``; the others' gathered values are unchanged then)."""
        if self.use_ema and self.ema_overwrite_frequency:
            return (True,) * len(active)
        return active

    def _zero_ema_device(self, slots, new: tf.Tensor, ema: list) -> tf.Tensor:
        """TensorFlow ops on a device shard: ``average = momentum * average + (1 -
        momentum) * new`` (Keras's order) assigned to the slot; returns the shard to write,
        float32 like ``new``: ``new``, or the average on an overwrite step."""
        momentum, rest, overwrite = ema
        average_var = slots[EMA_SLOT]
        average = momentum * average_var.read_value() + rest * new
        assign = average_var.assign(average)
        if not self.ema_overwrite_frequency:
            return new
        with tf.control_dependencies([assign]):
            return tf.where(overwrite > 0, average, new)

    # -- placement ---------------------------------------------------------------------
    def zero_ema_rows(self, optimizer_tier: str) -> list[dict]:
        """The placement rows of the averages (``strategy.runtime.placement()``): one per
        trainable variable with ``use_ema``, none without.

        Args:
            optimizer_tier: where the partitioned states live ('device', 'host', 'nvme').

        Returns:
            Rows of the placement table's fields, named ``"<variable> (EMA average)"``:
            ``bytes`` the whole average's (float32), ``shard_bytes_per_replica`` what one
            replica holds (its shard, or the whole average when unpartitioned: stage 0
            and the stock update below ``mirrored_fallback_bytes``), ``optimizer_tier``
            where it lives, ``param_tier`` and ``grad_tier`` 'none' (an optimizer state).
        """
        if not self.use_ema:
            return []
        zs = self.zero_state
        layout = zs.layout
        n = layout.num_shards
        stage = getattr(zs, "stage", 0)
        rows = []
        for name, shape, b in zip(layout.names, layout.shapes, _pieces(layout)):
            size = math.prod(shape)
            if self._zero is None:  # Keras's own average, on every replica's device
                text, shard, tier = "Keras's use_ema average, replicated", 4 * size, "device"
            else:
                text = f"Keras's use_ema average, sharded 1/{n} with the optimizer states"
                text += f" (ZeRO-{stage})"
                shard = 4 * (b if stage == 3 else -(-size // n))
                tier = optimizer_tier
            rows.append(
                {
                    "name": f"{name} (EMA average)",
                    "shape": list(shape),
                    "dtype": "float32",
                    "bytes": 4 * size,
                    "partitioning": text,
                    "shard_bytes_per_replica": shard,
                    "param_tier": "none",
                    "grad_tier": "none",
                    "optimizer_tier": tier,
                }
            )
        return rows

    # -- Keras's hooks -----------------------------------------------------------------
    def _update_model_variables_moving_average(self, trainable_variables) -> None:
        """Keras's per-step average; partitioned, it is advanced in the shard update."""
        if self._zero is None:
            super()._update_model_variables_moving_average(trainable_variables)

    def _overwrite_model_variables_with_average_value(self, trainable_variables) -> None:
        """Assign each of ``trainable_variables`` its average (Keras's
        ``finalize_variable_values`` calls this when ``fit`` ends).

        Partitioned, it runs eagerly: at stage 3 each local replica writes its averages
        into its own parameter shards (no gather); at stages 1-2 the averages are
        gathered from the shards and assigned to the replicated variables. The overwrite
        of ``ema_overwrite_frequency`` is done by the shard update itself.

        Raises:
            RuntimeError: called inside a ``tf.function``.
            ValueError: a variable this optimizer does not update.
        """
        if self._zero is None:
            super()._overwrite_model_variables_with_average_value(trainable_variables)
            return
        if tf.inside_function():
            raise RuntimeError(
                f"{type(self).__name__}.finalize_variable_values: the averages live in the "
                "optimizer's shards; call it eagerly, outside tf.function"
            )
        positions = self._zero_ema_positions(trainable_variables)
        settle = getattr(self, "zero_settle", None)
        if settle is not None:
            settle()  # a failed step rolled back before its states are read
        zs = self._zero
        replicas = local_replicas(self._distribution_strategy, len(zs.devices))
        if zs.stage == 3:
            variables = self._zero3_variables
            for replica in replicas:
                average = zs.store.read_shard(replica, EMA_SLOT)
                for i in positions:
                    b = zs.layout.buckets[i]
                    self._zero3_write_shards(
                        [variables[i]], replica, average[b.shard_offset :][: b.piece_size]
                    )
            return
        n = zs.layout.num_shards
        flat = zs.layout.unshard([zs.store.read_shard(r, EMA_SLOT) for r in range(n)])
        starts = np.cumsum((0,) + zs.layout.sizes)
        for i in positions:
            value = flat[starts[i] : starts[i + 1]].reshape(zs.layout.shapes[i])
            self._trainable_variables[i].assign(value)

    def _zero_ema_positions(self, variables) -> list[int]:
        """Layout positions of ``variables`` (each must be one the optimizer updates)."""
        trainable = self._zero3_variables if self._zero.stage == 3 else self._trainable_variables
        index = {id(unwrap(v)): i for i, v in enumerate(trainable)}
        positions = []
        for v in variables:
            i = index.get(id(unwrap(v)))
            if i is None:
                raise ValueError(
                    f"{type(self).__name__}: variable {getattr(v, 'path', v)!r} is not one "
                    "this optimizer keeps an average of"
                )
            positions.append(i)
        return positions


def _pieces(layout) -> list[int]:
    """Per variable, the elements of its piece in the bucket holding it (stage 3: one
    bucket per variable, the piece its shard)."""
    out = [0] * len(layout.sizes)
    for b in layout.buckets:
        for i in range(b.var_start, b.var_end):
            out[i] = b.piece_size
    return out


def _ema_tile(slots, scratch, param, ema) -> None:
    momentum, rest, overwrite = (np.float32(s) for s in ema)
    kernels.ema_update(
        slots[EMA_SLOT], param, momentum, rest, bool(overwrite), scratch[0], scratch[1]
    )
