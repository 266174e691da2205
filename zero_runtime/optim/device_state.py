"""Optimizer state shards on the device: one resource variable per slot per replica.

ZeRO stages 1 and 2 without offload (Rajbhandari et al., SC20, section 5.1): replica
``r`` holds float32 ``[shard_size]`` buffers for each optimizer slot on its own device and
updates them with TensorFlow ops in the train step's graph. On this CPU-only machine the
"device" is the replica's logical CPU device (the device tier's stand-in).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from zero_runtime.optim.layout import FlatLayout


class DeviceOptimizerState:
    """Per-replica device variables holding the optimizer-state shards.

    Args:
        layout: the flat layout of the optimizer's trainable variables.
        slot_names: per-element state buffers (e.g. ``("momentum", "velocity")``).
        devices: one device per local replica, index = replica id.

    Create outside a ``tf.function`` trace or under ``tf.init_scope()``. The variables are
    plain resource variables on each device (not strategy variables), zero-initialised.
    """

    tier = "device"

    def __init__(
        self, layout: FlatLayout, slot_names: tuple[str, ...], devices: tuple[str, ...]
    ) -> None:
        self.layout = layout
        self.slot_names = tuple(slot_names)
        self.devices = tuple(devices)
        self._slots: list[dict[str, tf.Variable]] = []
        with tf.init_scope():
            for r, d in enumerate(self.devices):
                with tf.device(d):
                    self._slots.append(
                        {
                            s: resource_variable_ops.ResourceVariable(
                                tf.zeros([layout.shard_size], tf.float32),
                                trainable=False,
                                name=f"zero_{s}_r{r}",
                            )
                            for s in self.slot_names
                        }
                    )

    def slots(self, replica: int) -> dict[str, tf.Variable]:
        """Slot name -> float32 ``[shard_size]`` variable of ``replica``.

        Args:
            replica: the replica id in the sync group. Under MultiWorkerMirroredStrategy
                ids are global (``rank * local + i``) and this store holds the worker's
                local replicas only, so the record is ``replica % len(devices)`` (the
                identity in one process; as ``CollectiveGroup.token``).
        """
        return self._slots[replica % len(self._slots)]

    @property
    def state_bytes(self) -> int:
        """Device bytes of optimizer state over the local replicas."""
        return 4 * self.layout.shard_size * len(self.slot_names) * len(self.devices)

    @property
    def nbytes(self) -> int:
        """Host bytes held (none: the state is on the device)."""
        return 0

    def usage(self) -> dict[str, tuple[int, int]]:
        """``{"device": (state_bytes, 0)}``."""
        return {"device": (self.state_bytes, 0)}

    def slot_values(self, slot: str):
        """One slot's full (unpadded) flat buffer, in variable order (numpy float32).

        Raises:
            KeyError: unknown slot.
        """
        return self.layout.unshard([s[slot].numpy() for s in self._slots])

    def read_shard(self, replica: int, slot: str) -> np.ndarray:
        """A copy of one slot of ``replica``'s shard, float32 ``[layout.shard_size]``.

        Args:
            replica: the replica id (global under multi-worker; see :meth:`slots`).
            slot: the slot name.

        Raises:
            KeyError: unknown slot name.
        """
        if slot not in self.slot_names:
            raise KeyError(f"unknown optimizer slot {slot!r}; slots: {self.slot_names}")
        return np.array(self.slots(replica)[slot].numpy(), np.float32, copy=True)

    def write_shard(self, replica: int, slot: str, values: np.ndarray) -> None:
        """Overwrite one slot of ``replica``'s shard with float32 ``[layout.shard_size]``.

        Call outside a ``tf.function`` (an eager ``assign`` on the replica's device).

        Raises:
            ValueError: ``values`` of the wrong shape.
            KeyError: unknown slot name.
        """
        from zero_runtime.optim.host_state import _checked_shard

        values = _checked_shard(values, self.layout.shard_size, slot)
        if slot not in self.slot_names:
            raise KeyError(f"unknown optimizer slot {slot!r}; slots: {self.slot_names}")
        self.slots(replica)[slot].assign(values)

    def close(self) -> None:
        """Nothing to release (the variables go with the object)."""
