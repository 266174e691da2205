"""Read-only reports over the page table: placement, tier usage, out-of-memory snapshots.

Functions of the page table and the tiers (terms in :mod:`.page_table`); they change
nothing, and the pool calls them under its lock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from zero_runtime.memory.counters import TierUsage
from zero_runtime.memory.errors import Holder, OomSnapshot
from zero_runtime.memory.page_table import (
    HOLDS,
    KINDS,
    TIER_ORDER,
    PageState,
    PageTable,
    TensorEntry,
)
from zero_runtime.memory.tiers import SlotTier

MAX_HOLDERS = 10  # holders listed per tier in an OomSnapshot


@dataclasses.dataclass(frozen=True)
class PageInfo:
    """Where one page is, as reported by :meth:`PagedBufferPool.describe`.

    Attributes:
        index: page index within the tensor.
        state: its :class:`~zero_runtime.memory.page_table.PageState`.
        tier: the tier it is in (the source tier while in flight).
        slot: its slot in that tier (the NVMe slot is at ``slot * page_size`` in the slab).
        payload: tensor bytes in the page.
        checksum: CRC-32C of its last NVMe copy, or ``None``.
        last_use_step: step of its last use.
    """

    index: int
    state: PageState
    tier: str | None
    slot: int | None
    payload: int
    checksum: int | None
    last_use_step: int


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A tensor's metadata and page placement (:meth:`PagedBufferPool.describe`).

    Attributes:
        tensor_id, shape, dtype, kind: as given to ``allocate``.
        nbytes: ``prod(shape) * itemsize`` (bytes).
        pinned: pinned or acquired.
        pages: one :class:`PageInfo` per page.
    """

    tensor_id: str
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str
    nbytes: int
    pinned: bool
    pages: tuple[PageInfo, ...]


def describe(entry: TensorEntry) -> TensorInfo:
    """The :class:`TensorInfo` of one tensor entry."""
    pages = tuple(
        PageInfo(
            p.index,
            p.state,
            p.tier,
            p.slots.get(p.tier) if p.tier else None,
            p.payload,
            p.checksum,
            p.last_use_step,
        )
        for p in entry.pages
    )
    return TensorInfo(
        entry.tensor_id, entry.shape, entry.dtype, entry.kind, entry.nbytes, entry.pinned, pages
    )


def usage(table: PageTable, tiers: Mapping[str, SlotTier], page_size: int) -> dict[str, TierUsage]:
    """Each tier's use, ``{"device"|"host"|"nvme": TierUsage}`` (bytes, whole pages);
    pages in flight count on both tiers they hold."""
    by_kind = {name: dict.fromkeys(KINDS, 0) for name in TIER_ORDER}
    for name in TIER_ORDER:
        for kind, pages in table.pages_by_kind(name).items():
            by_kind[name][kind] += pages * page_size
    return {
        name: TierUsage(
            used_bytes=tier.used * page_size,
            capacity_bytes=tier.capacity_bytes,
            peak_bytes=tier.peak * page_size,
            bytes_by_kind=by_kind[name],
            pages=tier.used,
        )
        for name, tier in tiers.items()
    }


def oom_snapshot(
    table: PageTable,
    tiers: Mapping[str, SlotTier],
    page_size: int,
    request: tuple[int, str, str],
    reason: str,
) -> OomSnapshot:
    """The :class:`OomSnapshot` of a failed request ``(bytes, tensor_id, tier)``: each
    tier's capacity and use and its :data:`MAX_HOLDERS` largest holders."""
    nbytes, tensor_id, tier = request
    holders: dict[str, dict[str, list[int]]] = {name: {} for name in TIER_ORDER}
    kinds = {}
    for entry in table.entries():
        kinds[entry.tensor_id] = entry.kind
        for page in entry.pages:
            for name in HOLDS[page.state]:
                holders[name].setdefault(entry.tensor_id, [0])[0] += 1
    return OomSnapshot(
        request_bytes=nbytes,
        request_tensor_id=tensor_id,
        request_tier=tier,
        tiers={
            name: {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used * page_size}
            for name, t in tiers.items()
        },
        holders={
            name: tuple(
                Holder(tid, kinds[tid], n[0] * page_size, n[0])
                for tid, n in sorted(held.items(), key=lambda kv: -kv[1][0])[:MAX_HOLDERS]
            )
            for name, held in holders.items()
        },
        reason=reason,
    )
