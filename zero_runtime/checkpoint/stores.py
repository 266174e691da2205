"""Read and write one replica's optimizer-state shard on whichever tier holds it.

The partitioned optimizers keep their states in one of three stores
(``zero_runtime.optim``): :class:`HostOptimizerState` (numpy buffers per global replica),
:class:`DeviceOptimizerState` (resource variables per *local* replica) and
:class:`NvmeOptimizerState` (sub-groups of pages in the paged pool, per global replica).
This module is the one place that knows how to copy a whole ``[shard_size]`` float32
slot shard out of and into each of them. The NVMe store has no public "load a shard"
method, so its sub-groups are allocated here through its own ``_record`` /
``_ensure_allocated`` helpers (the only private use; see docs/checkpoint.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zero_runtime.optim.device_state import DeviceOptimizerState
from zero_runtime.optim.host_state import HostOptimizerState
from zero_runtime.optim.nvme_state import NvmeOptimizerState


def read_slot_shard(store: Any, replica: int, local: int, slot: str) -> np.ndarray:
    """A copy of one slot of one replica's shard, float32 ``[shard_size]``.

    Args:
        store: the optimizer's state store.
        replica: the global replica id (host and NVMe stores index by it).
        local: the replica's index on this worker (the device store indexes by it).
        slot: the slot name (e.g. ``"momentum"``).

    Raises:
        TypeError: an unknown store type.
        KeyError: an unknown slot.
    """
    n = store.layout.shard_size
    if isinstance(store, HostOptimizerState):
        return np.array(store.shard(replica).slots[slot], np.float32, copy=True)
    if isinstance(store, DeviceOptimizerState):
        return np.asarray(store.slots(local)[slot].numpy(), np.float32)
    if isinstance(store, NvmeOptimizerState):
        if slot not in store.slot_names:
            raise KeyError(slot)
        allocated = store._record(replica).allocated
        parts = []
        for j in range(store.num_subgroups):
            if j in allocated:
                parts.append(store.pool.read(store.tensor_id(replica, j, slot)))
            else:  # never updated: zero state
                s, e = store.subgroup_range(j)
                parts.append(np.zeros(e - s, np.float32))
        out = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        if out.shape != (n,):
            raise ValueError(f"NVMe slot {slot!r} of replica {replica}: {out.shape} != ({n},)")
        return out
    raise TypeError(f"unknown optimizer-state store {type(store).__name__}")


def write_slot_shard(store: Any, replica: int, local: int, slot: str, values: np.ndarray) -> None:
    """Overwrite one slot of one replica's shard with ``values`` (float32 ``[shard_size]``).

    Raises:
        TypeError: an unknown store type.
        ValueError: ``values`` of the wrong length.
        KeyError: an unknown slot.
    """
    values = np.asarray(values, np.float32)
    if values.shape != (store.layout.shard_size,):
        raise ValueError(
            f"slot {slot!r} shard has {values.shape} elements, store expects "
            f"({store.layout.shard_size},)"
        )
    if isinstance(store, HostOptimizerState):
        store.shard(replica).slots[slot][:] = values
    elif isinstance(store, DeviceOptimizerState):
        store.slots(local)[slot].assign(values)
    elif isinstance(store, NvmeOptimizerState):
        if slot not in store.slot_names:
            raise KeyError(slot)
        rec = store._record(replica)
        for j in range(store.num_subgroups):
            store._ensure_allocated(rec, replica, j)
            s, e = store.subgroup_range(j)
            store.pool.write(store.tensor_id(replica, j, slot), values[s:e])
    else:
        raise TypeError(f"unknown optimizer-state store {type(store).__name__}")
