"""Stages 1-2, partial optimizer offload (DeepSpeed's Twin-Flow ``ratio``): the update of a
shard whose optimizer states are split between the device and the host
(:class:`~zero_runtime.optim.split_state.SplitOptimizerState`); a mixin of
:class:`~zero_runtime.optim.flat_update.FlatShardUpdate`, which calls
:meth:`SplitShardUpdate._zero_split_step` for such a store and provides the rest
(``_zero``, ``_zero_host_compute``, ``_zero_device_delta``, ``_zero_gate_tokens``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf

from zero_runtime.lifecycle import host_function
from zero_runtime.optim import kernels
from zero_runtime.optim.split_state import SplitOptimizerState


class SplitShardUpdate:
    """The split (device + host) shard update of stages 1-2 (see the module docstring)."""

    _zero: Any = None

    def _zero_split_step(
        self,
        store: SplitOptimizerState,
        replica: int,
        param_shard: tf.Tensor,
        grad_shard: tf.Tensor,
        active: tuple[bool, ...],
        lr,
        scalars: list,
        step: tf.Tensor,
    ) -> tf.Tensor:
        """Partial offload (Twin-Flow, :mod:`.split_state`): the new parameter shard,
        float32 ``[shard_size]``, from the device update of elements ``[0, device_size)``
        and the host update of the rest, between a start and a finish host call (the
        finish after the device part). On an accelerator the two run at the same time (the
        host part on the store's worker thread, so no TensorFlow thread waits on it); on a
        CPU device the start call runs the host part itself, before the device part (the
        same cores; see split_state). AdamW's decay is applied to the whole shard first,
        in TensorFlow (Keras's ``v - v * wd * lr``), so a failed step leaves the weights as
        they were and neither part decays twice."""
        layout = self._zero.layout
        k = store.device_size
        decayed = tuple(
            on and self.weight_decay is not None and self._use_weight_decay(v)
            for on, v in zip(active, self._trainable_variables)
        )
        if any(decayed):
            m = np.zeros(layout.shard_size, bool)
            for s, e in layout.active_ranges(replica, decayed):
                m[s:e] = True
            wd = tf.cast(self.weight_decay, tf.float32)
            lr32 = tf.cast(lr, tf.float32)
            param_shard = tf.where(
                tf.constant(m), param_shard - param_shard * wd * lr32, param_shard
            )
        host_fn = functools.partial(
            self._zero_host_compute,
            replica=replica,
            active=active,
            decayed=(False,) * len(active),
        )
        # On a CPU device the host calls take the whole shards (a CPU tensor reaches numpy
        # as a view of its buffer), compute the host part straight into the output buffer
        # and copy the device part in front of it: no slice or concat copies. Elsewhere
        # only the host fraction crosses to the host and the parts are joined on the device.
        merge = store.device_on_cpu(replica)
        host_in = [grad_shard, param_shard] if merge else [grad_shard[k:], param_shard[k:]]
        # Accelerator: the host part runs on the store's worker thread (start returns at
        # once), so no inter-op thread waits on it while the device part runs; CPU: start
        # runs it. The finish call comes after the device part and collects the host part.
        started = host_function(
            functools.partial(
                self._zero_split_start,
                store=store,
                replica=replica,
                fn=host_fn,
                cut=k if merge else None,
            ),
            [step, *host_in, tf.constant(0.0), tf.cast(lr, tf.float32), *scalars],
            tf.int64,
            stateful=True,
            name="zero_host_update_start",
        )
        device_part = []
        if k:
            mask = None
            if not all(active):
                m = np.zeros(k, bool)
                for s, e in layout.active_ranges(replica, active):
                    m[min(s, k) : min(e, k)] = True
                mask = tf.constant(m)
            with tf.control_dependencies([started]):  # the host part starts first
                # The device part's decrement u (new = param - u): on a CPU device the
                # finish call writes param - u straight into the output buffer, in
                # front of the host part (no TensorFlow output to copy there).
                device_part.append(
                    self._zero_device_delta(
                        store.device.slots(replica), param_shard[:k], grad_shard[:k], scalars, mask
                    )
                )
        with tf.control_dependencies(device_part):
            finished = host_function(
                functools.partial(self._zero_split_finish, store=store, replica=replica),
                [started, *((device_part[0], param_shard) if merge and device_part else ())],
                tf.float32,
                stateful=True,
                name="zero_host_update",
            )
        self._zero_gate_tokens().append(finished)
        if merge or not device_part:
            finished.set_shape([layout.shard_size])
            return finished
        finished.set_shape([layout.shard_size - k])
        return tf.concat([param_shard[:k] - device_part[0], finished], axis=0)

    def _zero_split_start(
        self,
        step: np.ndarray,
        grad: np.ndarray,
        param: np.ndarray,
        *args: np.ndarray,
        store: SplitOptimizerState,
        replica: int,
        fn,
        cut: int | None,
    ) -> np.int64:
        """The start of a split update: hand the host part to the store's worker thread.

        ``cut`` None: ``grad`` and ``param`` are the host part. Else they are the whole
        shard, the host part ``[cut:]``; it is computed into the end of a new aligned
        ``[shard_size]`` buffer, which :meth:`_zero_split_finish` completes and returns."""
        if cut is None:
            store.start_update(replica, fn, step, grad, param, *args)
            return np.int64(step)
        full = kernels.aligned_empty(len(param))

        def job() -> tuple[np.ndarray, float]:
            _, seconds = fn(step, grad[cut:], param[cut:], *args, out=full[cut:])
            return full, seconds

        store.start_update(replica, job, inline=True)  # CPU device: no overlap (split_state)
        return np.int64(step)

    def _zero_split_finish(
        self, step: np.ndarray, *device_part: np.ndarray, store: SplitOptimizerState, replica: int
    ) -> np.ndarray:
        """The finish of a split update: wait for the host part; given the device part's
        decrement ``u`` (float32 ``[device_size]``) and the old whole shard, write
        ``shard[:device_size] - u`` in front of the host part (the device part's new
        parameters, bitwise TensorFlow's subtraction); report the step."""
        param, seconds = store.finish_update(replica)
        if device_part:
            delta, old = device_part
            np.subtract(old[: len(delta)], delta, out=param[: len(delta)])
        if self._zero.runtime is not None:
            self._zero.runtime.on_shard_updated(self, replica, int(step), seconds)
        return param
