"""Gradient accumulation at ZeRO stage 3: a per-replica accumulator of gradient *shards*.

Vocabulary as in :mod:`zero_runtime.stage3.engine`: each block's gradients are
reduce-scattered as soon as its backward finishes, so after a micro-step a replica holds
only its *reduced gradient shard* (summed over replicas) of every variable, concatenated in
the optimizer's order: float32 ``[shard_size]`` (``FlatLayout.shard_size`` of
:func:`zero_runtime.optim.layout.layout_from_sharded`). With
``ZeroConfig.gradient_accumulation_steps`` = N > 1 the N micro-steps' shards are summed
into one buffer of that size per local replica, and the optimizer applies
``(acc + g) / N`` on the N-th micro-step (Keras's own accumulation formula,
``keras.optimizers.Optimizer._backend_apply_gradients``), counting optimizer steps as
``iterations // N``. No replica ever holds a full gradient (ZeRO-2's and ZeRO-3's memory
contract, Rajbhandari et al., SC20, section 5.2): the accumulator costs 4 * shard_size
bytes per replica, i.e. 4 Psi / N_d.

Where the buffer lives follows the optimizer's tier (``offload_optimizer``): a device
``tf.Variable`` for 'none' (its update is in the step's graph), a host numpy buffer for
'cpu' and 'nvme' (the optimizer's update runs on the host and reads the gradient there).
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from zero_runtime.lifecycle import host_function

ACCUMULATOR_TIER = {"none": "device", "cpu": "host", "nvme": "host"}  # offload_optimizer ->


class ShardAccumulator:
    """Sums a replica's reduced gradient shards over N micro-steps.

    Args:
        shard_size: elements of one replica's gradient shard (float32).
        steps: N, micro-steps per optimizer step (``gradient_accumulation_steps`` >= 2).
        devices: the local replicas' device names (one buffer per local replica; the
            buffer of global replica ``r`` is ``r % len(devices)``).
        offload_optimizer: 'none' (device buffers) or 'cpu' / 'nvme' (host numpy buffers).

    Attributes:
        tier: 'device' or 'host' (:data:`ACCUMULATOR_TIER`).
        nbytes: bytes of all local buffers (4 * shard_size per local replica).

    Raises:
        ValueError: ``steps`` < 2 or ``shard_size`` < 0.
    """

    def __init__(
        self, shard_size: int, steps: int, devices: tuple[str, ...], offload_optimizer: str
    ) -> None:
        if steps < 2 or shard_size < 0:
            raise ValueError(f"need steps >= 2 and shard_size >= 0, got {steps}, {shard_size}")
        self.shard_size = int(shard_size)
        self.steps = int(steps)
        self.tier = ACCUMULATOR_TIER[offload_optimizer]
        self._lock = threading.Lock()
        self._host: list[np.ndarray] = []
        self._device: list[tf.Variable] = []
        with tf.init_scope():
            for d in devices:
                if self.tier == "device":
                    with tf.device(d):
                        self._device.append(
                            resource_variable_ops.ResourceVariable(
                                tf.zeros([self.shard_size], tf.float32), trainable=False
                            )
                        )
                else:
                    self._host.append(np.zeros(self.shard_size, np.float32))
        self.nbytes = 4 * self.shard_size * len(devices)

    def step(self, replica: int, grad: tf.Tensor, is_update: tf.Tensor) -> tf.Tensor:
        """One micro-step of ``replica`` (graph side, replica context).

        Args:
            replica: the global replica id.
            grad: float32 ``[shard_size]``, this micro-step's reduced gradient shard.
            is_update: bool scalar, True on the N-th micro-step.

        Returns:
            float32 ``[shard_size]``: ``(acc + grad) / N`` when ``is_update`` (and the
            buffer is zeroed), else zeros (and ``grad`` is added to the buffer).
        """
        n = float(self.steps)
        if self.tier == "device":
            acc = self._device[replica % len(self._device)]
            total = (acc.read_value() + grad) / n  # as Keras: (g + acc_g) / steps
            with tf.control_dependencies([total]):
                new = tf.where(is_update, tf.zeros_like(grad), acc.read_value() + grad)
                write = acc.assign(new)
            with tf.control_dependencies([write]):
                return tf.where(is_update, total, tf.zeros_like(total))
        # Stateless, ordered by data only (unit_comm's docstring explains why: a stateful host
        # call of replica 1 would wait for replica 0's collectives); its output is used.
        out = host_function(
            functools.partial(self._host_step, replica % len(self._host)),
            [grad, is_update],
            tf.float32,
            stateful=False,
            name="zero3_accumulate",
        )
        out.set_shape([self.shard_size])
        return out

    def _host_step(self, index: int, grad: np.ndarray, is_update: np.ndarray) -> np.ndarray:
        with self._lock:
            acc = self._host[index]
            if bool(is_update):
                total = (acc + grad) / np.float32(self.steps)
                acc[:] = 0.0
                return total.astype(np.float32, copy=False)
            acc += grad
            return np.zeros_like(acc)

    def pending(self, replica: int) -> np.ndarray:
        """A copy of ``replica``'s accumulated sum (float32 ``[shard_size]``), eager."""
        if self.tier == "device":
            return self._device[replica % len(self._device)].numpy().copy()
        with self._lock:
            return self._host[replica % len(self._host)].copy()
