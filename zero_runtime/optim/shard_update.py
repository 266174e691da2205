"""Stage 3: the ZeRO update of ShardedVariables' shards (a mixin of the partitioned
optimizer, :mod:`zero_runtime.optim.partitioned`).

Each replica reads its shards of every densely updated variable from the pool, updates
them with its optimizer-state shard and writes them back; nothing is all-gathered (ZeRO,
SC20, section 5.3). The update in backward (:mod:`.backward_update`) uses the same reads
and writes one block at a time. With NVMe states the shards a step writes are journalled
(:mod:`.transaction`), so a failed step is rolled back.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf

from zero_runtime.lifecycle import host_function
from zero_runtime.memory import staging
from zero_runtime.optim import kernels
from zero_runtime.optim.device_state import DeviceOptimizerState
from zero_runtime.optim.host_state import HostOptimizerState
from zero_runtime.optim.replica_context import replica_id
from zero_runtime.sharded_variable import ShardState


class ShardedUpdate:
    """The stage-3 update; mixed into the partitioned optimizer (which provides ``_zero``,
    ``_trainable_variables``, ``_iterations``, the subclass hooks and, from
    :class:`~zero_runtime.optim.transaction.TransactionalUpdate`, the step journals)."""

    _zero: Any = None

    @property
    def _zero3_variables(self) -> list:
        """Stage 3: the ShardedVariables this optimizer updates densely (row-paged
        embedding tables, ``row_paged``, update their touched rows themselves:
        zero_runtime/stage3/embedding.py)."""
        return [v for v in self._trainable_variables if not getattr(v, "row_paged", False)]

    def apply_shard_gradients(
        self, grads: dict[int, tf.Tensor], count: bool = True, clock: bool = True
    ) -> tf.Tensor:
        """Stage 3: update this replica's parameter shards with its reduced gradient shards.

        Runs in replica context (inside the stage-3 train step). The parameters stay
        partitioned: each replica reads its shards from the pool, updates them with the
        optimizer state on the ``offload_optimizer`` tier, and writes them back; nothing
        is all-gathered (ZeRO, SC20, section 5.3). Learning-rate schedules and AdamW's
        decoupled weight decay behave as Keras's (same operation order); the iteration
        counter is Keras's.

        Clipping is not done here: the stage-3 train step clips the reduced shards
        first (:func:`zero_runtime.stage3.clipping.clip_shards`).

        Args:
            grads: ``{id(variable): float32 [shard_elements]}``, the replica's reduced
                (summed over replicas) gradient shard of every trainable variable.
            count: increment ``iterations`` here (default True). False inside
                ``tf.cond`` (gradient accumulation), where the caller increments it after
                the cond (a mirrored variable's update is a ``merge_call``).
            clock: with parameter shards and states on the device, trace the runtime's
                step clock (a host call, ``on_shard_updated``) after the update (default
                True). False when the caller reports the step from Python after the call
                (:mod:`zero_runtime.stage3.step_clock`): the update then has no host call.

        Returns:
            An int64 scalar, the optimizer step, that exists once the shards are written.
        """
        zs = self._zero
        replica = replica_id()
        order = self._zero3_variables
        grad_shard = tf.concat([grads[id(v)] for v in order], axis=0)  # (shard_size,)
        lr = self._zero_learning_rate()
        scalars = self._zero_step_scalars(lr)  # with the EMA's (ema.py)
        step = self._zero_step()
        wd = tf.cast(self.weight_decay if self.weight_decay else 0.0, tf.float32)
        lr32 = tf.cast(lr, tf.float32)
        shards = [v.device_shard(replica) for v in order]
        on_device = bool(shards) and all(s is not None for s in shards)
        if isinstance(zs.store, DeviceOptimizerState) and on_device:
            done = self._zero3_device_update(
                order, shards, replica, grad_shard, scalars, step, wd, lr32
            )
            if clock:  # the runtime's on_shard_updated (FlatShardUpdate)
                done = self._zero_tick_op(replica, done)
        elif isinstance(zs.store, DeviceOptimizerState):
            param = host_function(
                functools.partial(self._zero3_read, replica=replica, decay=True),
                [wd, lr32],
                tf.float32,
                stateful=True,
                name="zero3_read_shards",
            )
            param.set_shape([zs.layout.shard_size])
            new = self._zero_device_step(zs.store.slots(replica), param, grad_shard, scalars, None)
            done = host_function(
                functools.partial(self._zero3_write, replica=replica),
                [step, new],
                tf.int64,
                stateful=True,
                name="zero3_write_shards",
            )
        else:
            done = host_function(
                functools.partial(self._zero3_host_update, replica=replica),
                [step, grad_shard, wd, lr32, *scalars],
                tf.int64,
                stateful=True,
                name="zero3_host_update",
            )
        if not count:
            return done
        with tf.control_dependencies([done]):
            self._iterations.assign_add(1)
        return self._zero_commit_op(replica, done)

    def _zero3_device_update(
        self,
        variables: list,
        shards: list,
        replica: int,
        grad: tf.Tensor,
        scalars: list,
        step: tf.Tensor,
        wd: tf.Tensor,
        lr: tf.Tensor,
    ) -> tf.Tensor:
        """The update with parameter shards and optimizer states both on the device: TF
        ops only, no host call.

        Reads every variable's shard variable (float32 ``[shard_elements]``), applies
        Keras's decoupled weight decay ``v - v * wd * lr`` to those it applies to
        (``_use_weight_decay``), runs ``_zero_device_step`` on the concatenation
        (float32 ``[shard_size]``, ``grad`` the same shape) and assigns the pieces back.
        The step clock (the runtime's ``on_shard_updated``) is left to the caller.

        Args:
            variables: the ShardedVariables, in the optimizer's order.
            shards: their ``device_shard(replica)`` variables, same order.
            replica: the replica id.
            grad: float32 ``[shard_size]``, the reduced gradient shards concatenated.
            scalars: ``_zero_step_scalars`` (e.g. Adam's alpha; the EMA's).
            step: int64 scalar, the optimizer step (read before the increment).
            wd: float32 scalar, the weight decay (0 without).
            lr: float32 scalar, the learning rate of the step.

        Returns:
            The optimizer step (int64 scalar) once every shard variable is assigned.
        """
        zs = self._zero
        params = [s.read_value() for s in shards]
        if self.weight_decay:
            params = [
                p - p * wd * lr if self._use_weight_decay(v) else p
                for p, v in zip(params, variables)
            ]
        param = params[0] if len(params) == 1 else tf.concat(params, axis=0)
        new = self._zero_device_step(zs.store.slots(replica), param, grad, scalars, None)
        pieces = tf.split(new, [v.shard_elements for v in variables]) if len(shards) > 1 else [new]
        assigns = [s.assign(p, read_value=False) for s, p in zip(shards, pieces)]
        with tf.control_dependencies(assigns):
            return tf.identity(tf.cast(step, tf.int64))

    def _zero3_read_shards(self, variables, replica: int, wd=None, lr=None) -> np.ndarray:
        """``replica``'s shards of ``variables`` (ShardedVariables), concatenated: float32
        ``[sum(v.shard_elements)]``. With ``wd`` and ``lr`` given (and a weight decay set)
        Keras's decoupled weight decay ``v - v * wd * lr`` is applied first to the
        variables it applies to (``_use_weight_decay``). Used by the end-of-step update
        (every variable) and the update in backward (one block's, backward_update.py)."""
        param = staging.empty(sum(v.shard_elements for v in variables))  # recycled
        off = 0
        for v in variables:  # each shard copied once, into its slice (no concatenate)
            v.read_shard_into(replica, param[off : off + v.shard_elements])
            off += v.shard_elements
        journals = self._zero.journals
        if journals is not None:  # the step writes these shards: keep their old values
            journals.record_params(replica, tuple(variables), param)  # copied
        if wd is not None and self.weight_decay:
            off = 0
            for v in variables:
                end = off + v.shard_elements
                if self._use_weight_decay(v):  # Keras: v - v * wd * lr
                    kernels.weight_decay(param[off:end], wd, lr)
                off = end
        return param

    def _zero3_write_shards(self, variables, replica: int, param: np.ndarray) -> None:
        """Write ``param`` (as :meth:`_zero3_read_shards` returned it, updated) back to
        ``replica``'s shards of ``variables``; a persistent gathered copy, now stale, is
        released first."""
        off = 0
        for v in variables:
            if v.state(replica) is ShardState.GATHERED:  # persistent copies go stale
                v.release(replica)
            v.write_shard(replica, param[off : off + v.shard_elements])
            off += v.shard_elements

    def _zero3_read(self, wd, lr, replica: int, decay: bool) -> np.ndarray:
        if not decay:
            return self._zero3_read_shards(self._zero3_variables, replica)
        return self._zero3_read_shards(self._zero3_variables, replica, wd, lr)

    def _zero3_write(self, step, param: np.ndarray, replica: int) -> np.int64:
        self._zero3_write_shards(self._zero3_variables, replica, param)
        if self._zero.runtime is not None:
            self._zero.runtime.on_shard_updated(self, replica, int(step), 0.0)
        return np.int64(step)

    def _zero3_host_update(self, step, grad, wd, lr, *scalars, replica: int) -> np.int64:
        zs = self._zero
        variables = self._zero3_variables
        if (
            zs.journals is None
            and isinstance(zs.store, HostOptimizerState)
            and all(v.tier == "host" for v in variables)
        ):
            self._zero3_host_update_in_place(variables, replica, grad, wd, lr, scalars)
            if zs.runtime is not None:
                zs.runtime.on_shard_updated(self, replica, int(step), 0.0)
            return np.int64(step)
        self._zero_begin(replica, int(step))
        try:
            param = self._zero3_read(wd, lr, replica=replica, decay=True)
            step_fn = functools.partial(self._zero_tile_step, scalars=scalars)
            zs.store.update(
                replica, ((0, zs.layout.shard_size),), param, grad, step_fn, step=int(step)
            )
            return self._zero3_write(step, param, replica)
        except BaseException:
            self._zero_rollback(replica)
            raise

    def _zero3_host_update_in_place(
        self, variables: list, replica: int, grad: np.ndarray, wd, lr, scalars
    ) -> None:
        """Host states, host-tier shards, no journal: update each variable's shard where
        its pages are (``ShardedVariable.update_shard_in_place``), Keras's decoupled
        weight decay first, then the optimizer's host step over its range of the states;
        bitwise the same as reading, updating and writing the whole shard (element-wise
        kernels), without the two copies.

        Args:
            variables: the ShardedVariables (the optimizer's order).
            replica: the replica id.
            grad: float32 ``[shard_size]``, the reduced gradient shards concatenated.
            wd: the weight decay (float32 scalar, 0 without).
            lr: the learning rate of the step (float32 scalar).
            scalars: ``_zero_step_scalars``'s values (the subclass's, the EMA's).
        """
        store = self._zero.store
        step_fn = functools.partial(self._zero_tile_step, scalars=scalars)
        wd, lr = np.float32(wd), np.float32(lr)
        off = 0
        for i, v in enumerate(variables):
            end = off + v.shard_elements
            decay = bool(self.weight_decay) and self._use_weight_decay(v)
            last = i == len(variables) - 1

            def update(param: np.ndarray, off=off, end=end, decay=decay, last=last) -> None:
                if decay:  # Keras: v - v * wd * lr
                    kernels.weight_decay(param, wd, lr)
                store.update(
                    replica,
                    ((off, end),),
                    param,
                    grad[off:end],
                    step_fn,
                    offset=off,
                    count=last,
                )

            if v.state(replica) is ShardState.GATHERED:  # a persistent copy goes stale
                v.release(replica)
            v.update_shard_in_place(replica, update)
            off = end
