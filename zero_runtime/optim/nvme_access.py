"""The NVMe optimizer store's states read and overwritten from outside a step.

A checkpoint writes each replica's slot shards (:func:`read_shard`) and loads them back
(:func:`write_shard`); ``slot_values`` gives one slot's whole unpadded buffer in variable
order. Each call first resolves uncommitted steps (``StateTransactions._access``: the
optimizer's ``before_access``), then reads the sub-groups where their pages are or
writes them sub-group by sub-group and moves them to NVMe, so the host holds no more
pages afterwards than before. Tensor ids and sub-groups are those of
:class:`~zero_runtime.optim.nvme_state.NvmeOptimizerState` (``store`` below), whose
methods of the same names call these.
"""

from __future__ import annotations

import numpy as np

from zero_runtime.optim.host_state import _checked_shard


def slot_values(store, slot: str) -> np.ndarray:
    """One slot's full (unpadded) flat buffer, in variable order, read from the pool:
    float32 ``[layout.total]``.

    Sub-groups never updated (only inactive variables) read as zeros.

    Args:
        store: the :class:`~zero_runtime.optim.nvme_state.NvmeOptimizerState`.
        slot: the slot name.

    Raises:
        KeyError: unknown slot.
    """
    if slot not in store.slot_names:
        raise KeyError(slot)
    store._access()
    shards = []
    for r in range(store.layout.num_shards):
        allocated = store._record(r).allocated
        parts = []
        for j in range(store.num_subgroups):
            if j in allocated:
                parts.append(store.pool.read(store.tensor_id(r, j, slot)))
            else:  # never updated (inactive variables only): zero state
                s, e = store.subgroup_range(j)
                parts.append(np.zeros(e - s, np.float32))
        shards.append(np.concatenate(parts))
    return store.layout.unshard(shards)


def read_shard(store, replica: int, slot: str) -> np.ndarray:
    """A copy of one slot of ``replica``'s shard, float32 ``[layout.shard_size]``,
    read from the pool where its pages are (``PagedBufferPool.read``: no page moves).

    Sub-groups never updated read as zeros and are not allocated by the read.

    Args:
        store: the :class:`~zero_runtime.optim.nvme_state.NvmeOptimizerState`.
        replica: the global replica id.
        slot: the slot name.

    Raises:
        ValueError: ``replica`` outside ``[0, layout.num_shards)``.
        KeyError: unknown slot name.
        zero_runtime.memory.PagingError: an NVMe read failed.
    """
    if slot not in store.slot_names:
        raise KeyError(f"unknown optimizer slot {slot!r}; slots: {store.slot_names}")
    store._access()
    allocated = store._record(replica).allocated
    out = np.zeros(store.layout.shard_size, np.float32)
    for j in sorted(allocated):
        s, e = store.subgroup_range(j)
        out[s:e] = store.pool.read(store.tensor_id(replica, j, slot))
    return out


def write_shard(store, replica: int, slot: str, values: np.ndarray) -> None:
    """Overwrite one slot of ``replica``'s shard, sub-group by sub-group.

    Every sub-group is allocated if needed, written, and moved to NVMe (as at the end
    of ``NvmeOptimizerState.update``), so the host holds no more pages afterwards than
    before.

    Args:
        store: the :class:`~zero_runtime.optim.nvme_state.NvmeOptimizerState`.
        replica: the global replica id.
        slot: the slot name.
        values: float32 ``[layout.shard_size]``.

    Raises:
        ValueError: ``replica`` out of range or ``values`` of the wrong shape.
        KeyError: unknown slot name.
        zero_runtime.memory.PagingError: an NVMe write failed (``NvmeFullError``).
    """
    values = _checked_shard(values, store.layout.shard_size, slot)
    if slot not in store.slot_names:
        raise KeyError(f"unknown optimizer slot {slot!r}; slots: {store.slot_names}")
    store._access()
    rec = store._record(replica)
    for j in range(store.num_subgroups):
        store._ensure_allocated(rec, replica, j)
        s, e = store.subgroup_range(j)
        tid = store.tensor_id(replica, j, slot)
        store.pool.write(tid, values[s:e])
        store.pool.evict([tid], "nvme")
