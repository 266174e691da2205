"""Partitioned Keras optimizers: each replica updates only its shard, on the host.

These are Keras 3 optimizers (subclasses of ``keras.optimizers.Adam``/``AdamW``/``SGD``)
whose per-step update is replaced, through Keras's ``_backend_update_step`` hook
(TF_NOTES section 4), by ZeRO stage 1:

1. the replica's gradients are flattened into one padded flat buffer and summed across
   replicas (all-reduce);
2. the replica takes its shard of the summed gradient and of the current parameters;
3. a host (numpy) kernel updates the shard with optimizer states that live only on the
   host (``HostOptimizerState``), never on the device;
4. the updated shards are all-gathered and assigned to the replicated variables.

Everything else Keras does around the update (loss scaling, clipping, weight decay,
learning-rate schedules, gradient accumulation, EMA, the iteration counter) is Keras's
own code, so behaviour matches the stock optimizer; the update math matches it bit for
bit (``zero_runtime.optim.kernels``).

Vocabulary (flat buffer, shard) as in :mod:`zero_runtime.optim.layout`.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from zero_runtime import comm
from zero_runtime.optim import kernels
from zero_runtime.optim.host_state import HostOptimizerState
from zero_runtime.optim.layout import FlatLayout

_BaseOptimizer = keras.optimizers.Optimizer


class _PartitionedUpdate:
    """Mixin holding the ZeRO stage-1 update; combine with a Keras optimizer class.

    Subclasses define ``_zero_slots`` (names of host state buffers) and
    ``_zero_host_step(shard, param, grad, scalars)``.
    """

    _zero_slots: tuple[str, ...] = ()

    # -- building ------------------------------------------------------------------------
    def build(self, variables: list) -> None:
        """Create the iteration counter etc. (Keras's base ``build``) and the host state.

        Unlike the stock optimizer, no per-variable slot variable is created on the
        device: the optimizer states are host shards of ``4 * shard_size`` bytes per slot.
        """
        if self.built:
            return
        _BaseOptimizer.build(self, variables)
        with tf.init_scope():
            strategy = self._distribution_strategy
            num_shards = strategy.num_replicas_in_sync
            self._zero_layout = FlatLayout.from_variables(self._trainable_variables, num_shards)
            self._zero_state = HostOptimizerState(self._zero_layout, self._zero_slots)
            self._zero_runtime = getattr(strategy, "runtime", None)
            if self._zero_runtime is not None:
                self._zero_runtime.register_optimizer(self)

    @property
    def host_state(self) -> HostOptimizerState:
        """The host-resident optimizer state (raises AttributeError before ``build``)."""
        return self._zero_state

    @property
    def flat_layout(self) -> FlatLayout:
        """The flat layout of the trainable variables (available after ``build``)."""
        return self._zero_layout

    # -- the step ------------------------------------------------------------------------
    def _backend_update_step(self, grads: list, trainable_variables: list, learning_rate) -> None:
        variables = [v.value if isinstance(v, keras.Variable) else v for v in trainable_variables]
        layout = self._zero_layout
        index = {id(v): i for i, v in enumerate(self._trainable_variables)}
        by_pos: list[Any] = [None] * len(layout.sizes)
        for g, v in zip(grads, trainable_variables):
            if g is not None:
                by_pos[index[id(v)]] = g
        active = tuple(g is not None for g in by_pos)
        all_vars = [
            v.value if isinstance(v, keras.Variable) else v for v in self._trainable_variables
        ]

        # Sparse gradients (tf.IndexedSlices from embedding lookups) are densified per
        # replica and summed with the rest: the dense Adam update of the true gradient.
        # (Keras's own Adam applies IndexedSlices with duplicate indices as separate
        # scatter updates, which is not Adam on the summed gradient; see docs/parity.md.)
        flat_grad = _flatten(
            [
                g if g is not None else tf.zeros(s, tf.float32)
                for g, s in zip(by_pos, layout.shapes)
            ],
            layout.padded_total,
        )
        summed = comm.all_reduce_sum_flat(flat_grad)
        flat_param = _flatten([tf.cast(v, tf.float32) for v in all_vars], layout.padded_total)
        grad_shard = comm.shard_of(summed, layout.shard_size)
        param_shard = comm.shard_of(flat_param, layout.shard_size)
        ctx = tf.distribute.get_replica_context()
        replica = tf.cast(ctx.replica_id_in_sync_group, tf.int32)
        scalars = self._zero_scalars(learning_rate)
        host_fn = functools.partial(self._zero_host_update, active=active)
        new_shard = tf.numpy_function(
            host_fn,
            [replica, self._iterations, grad_shard, param_shard, *scalars],
            Tout=tf.float32,
            stateful=True,
            name="zero_host_update",
        )
        new_shard.set_shape([layout.shard_size])
        new_flat = comm.all_gather_flat(new_shard)
        pieces = [
            tf.reshape(new_flat[off : off + size], shape)
            for off, size, shape in zip(layout.offsets, layout.sizes, layout.shapes)
        ]
        chosen = [(p, v) for p, v, on in zip(pieces, all_vars, active) if on]
        del variables
        if not chosen:
            return

        def _assign(distribution, values_and_vars):
            for value, var in values_and_vars:
                distribution.extended.update(
                    var, lambda a, b: a.assign(tf.cast(b, a.dtype)), args=(value,), group=False
                )

        tf.__internal__.distribute.interim.maybe_merge_call(
            _assign, self._distribution_strategy, chosen
        )

    def _zero_host_update(
        self,
        replica: np.ndarray,
        iterations: np.ndarray,
        grad: np.ndarray,
        param: np.ndarray,
        *scalars: np.ndarray,
        active: tuple[bool, ...],
    ) -> np.ndarray:
        start = time.perf_counter()
        replica = int(replica)
        param = np.array(param, dtype=np.float32, copy=True)
        shard = self._zero_state.begin_update(replica)
        try:
            ranges = self._zero_layout.active_ranges(replica, active)
            if len(ranges) == 1 and ranges[0] == (0, self._zero_layout.shard_size):
                self._zero_host_step(shard.slots, shard.scratch, param, grad, scalars)
            else:
                for s, e in ranges:
                    view = {k: a[s:e] for k, a in shard.slots.items()}
                    scratch = (shard.scratch[0][s:e], shard.scratch[1][s:e])
                    self._zero_host_step(view, scratch, param[s:e], grad[s:e], scalars)
        finally:
            self._zero_state.end_update(shard)
        if self._zero_runtime is not None:
            self._zero_runtime.on_shard_updated(
                self, replica, int(iterations), time.perf_counter() - start
            )
        return param

    # Subclass hooks ---------------------------------------------------------------------
    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        raise NotImplementedError

    def _zero_host_step(self, slots, scratch, param, grad, scalars) -> None:
        raise NotImplementedError


def _flatten(tensors: list, padded_total: int) -> tf.Tensor:
    """Concatenate tensors (``tf.IndexedSlices`` densified) as 1-D float32, zero-padded to
    ``padded_total`` elements."""
    dense = [tf.convert_to_tensor(t) if isinstance(t, tf.IndexedSlices) else t for t in tensors]
    flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in dense], axis=0)
    pad = padded_total - int(flat.shape[0])
    if pad:
        flat = tf.concat([flat, tf.zeros([pad], tf.float32)], axis=0)
    return flat


class _AdamHost(_PartitionedUpdate):
    _zero_slots = ("momentum", "velocity")

    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        # Exactly Keras's Adam.update_step: alpha = lr * sqrt(1 - b2^t) / (1 - b1^t).
        if self.amsgrad:
            raise NotImplementedError("amsgrad=True is not supported by the partitioned Adam")
        lr = tf.cast(learning_rate, tf.float32)
        local_step = tf.cast(self.iterations + 1, tf.float32)
        beta_1_power = tf.pow(tf.cast(self.beta_1, tf.float32), local_step)
        beta_2_power = tf.pow(tf.cast(self.beta_2, tf.float32), local_step)
        alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        return [alpha]

    def _zero_host_step(self, slots, scratch, param, grad, scalars) -> None:
        (alpha,) = scalars
        kernels.adam_update(
            param,
            grad,
            slots["momentum"],
            slots["velocity"],
            np.float32(alpha),
            np.float32(1 - self.beta_1),
            np.float32(1 - self.beta_2),
            np.float32(self.epsilon),
            scratch[0],
            scratch[1],
        )


@keras.saving.register_keras_serializable(package="zero_runtime")
class Adam(_AdamHost, keras.optimizers.Adam):
    """Keras ``Adam`` with ZeRO stage-1 partitioned state on the host.

    Same constructor and behaviour as ``keras.optimizers.Adam`` (Kingma & Ba, ICLR 2015)
    except ``amsgrad=True`` (raises ``NotImplementedError`` at the first step). Each
    replica holds ``2 * 4 * ceil(P / N)`` bytes of state on the host for P float32
    parameters over N replicas, and none on the device.
    """


@keras.saving.register_keras_serializable(package="zero_runtime")
class AdamW(_AdamHost, keras.optimizers.AdamW):
    """Keras ``AdamW`` (Loshchilov & Hutter, ICLR 2019) with partitioned host state.

    Decoupled weight decay is applied by Keras to the variables before the update, as in
    the stock optimizer.
    """


@keras.saving.register_keras_serializable(package="zero_runtime")
class SGD(_PartitionedUpdate, keras.optimizers.SGD):
    """Keras ``SGD`` (optionally with momentum / Nesterov) with partitioned host state.

    With ``momentum == 0`` no state is held; otherwise one float32 momentum buffer per
    shard (``4 * ceil(P / N)`` bytes per replica).
    """

    @property
    def _zero_slots(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum",) if self.momentum != 0 else ()

    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        return [tf.cast(learning_rate, tf.float32)]

    def _zero_host_step(self, slots, scratch, param, grad, scalars) -> None:
        (lr,) = scalars
        lr = np.float32(lr)
        if self.momentum != 0:
            kernels.sgd_momentum_update(
                param,
                grad,
                slots["momentum"],
                lr,
                np.float32(self.momentum),
                bool(self.nesterov),
                scratch[0],
                scratch[1],
            )
        else:
            kernels.sgd_update(param, grad, lr, scratch[0])


#: Keras optimizer identifiers that the strategy maps to partitioned optimizers.
PARTITIONED_BY_NAME: dict[str, type] = {
    "adam": Adam,
    "Adam": Adam,
    "adamw": AdamW,
    "AdamW": AdamW,
    "sgd": SGD,
    "SGD": SGD,
}
