"""The paged buffer pool: fixed-size pages over device, host and NVMe tiers.

Public API::

    from zero_runtime.memory import PagedBufferPool

    with PagedBufferPool(host_budget_bytes=1 << 30, nvme_path="/mnt/nvme") as pool:
        pool.allocate("w", (4096, 1024), "float32", kind="param")
        pool.write("w", weights)
        pool.evict("w", "nvme")
        pool.prefetch(["w"])
        w = pool.acquire("w")          # np.ndarray, read-only, pinned
        pool.release("w")
        counters = pool.step_boundary(step)   # PageCounters

Modules, one owner each: :mod:`.page_table` (pages, states, the one record and its
state machine), :mod:`.transitions` (every page move between tiers), :mod:`.placement`
(the placement loop, victims, out-of-memory), :mod:`.io` (slab files, the I/O
scheduler), :mod:`.prefetch` (the prefetch queue and thread), :mod:`.access` (bytes in
and out of pages), :mod:`.tiers` (slots and storage), :mod:`.policy` (victim ranking),
:mod:`.reports` (placement, usage, OOM snapshots), :mod:`.counters`, :mod:`.errors`,
:mod:`.trace` (the access trace: a ring of the last steps' operations),
:mod:`.flat_store` (many small shards packed into page-sized chunks),
:mod:`.shard_storage` (where one variable's shards live: pages, a range, device variables);
:mod:`.core` wires them and holds every operation's policy path, and :mod:`.pool` is the
façade over it. :mod:`.simulate` replays a recorded trace through the same core over the
slot-only tiers of :mod:`.sim_tiers` (what-if, ``docs/tuning.md``). See
``docs/design/paging.md``.
"""

from zero_runtime.memory.counters import PageCounters, PoolTotals, TierUsage
from zero_runtime.memory.errors import (
    Holder,
    NvmeFullError,
    NvmePathError,
    OomSnapshot,
    PageChecksumError,
    PageStateError,
    PagingError,
    PoolClosedError,
    PoolOutOfMemoryError,
)
from zero_runtime.memory.flat_store import FlatRange, FlatShardSpace
from zero_runtime.memory.page_table import KINDS, PageState
from zero_runtime.memory.pool import (
    DEFAULT_PAGE_SIZE,
    MIN_PAGE_SIZE,
    PagedBufferPool,
    PageInfo,
    TensorInfo,
)
from zero_runtime.memory.shard_storage import ShardStorage
from zero_runtime.memory.tiers import DeviceTier

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "KINDS",
    "MIN_PAGE_SIZE",
    "DeviceTier",
    "FlatRange",
    "FlatShardSpace",
    "Holder",
    "NvmeFullError",
    "NvmePathError",
    "OomSnapshot",
    "PageChecksumError",
    "PageCounters",
    "PageInfo",
    "PageState",
    "PageStateError",
    "PagedBufferPool",
    "PagingError",
    "PoolClosedError",
    "PoolOutOfMemoryError",
    "PoolTotals",
    "ShardStorage",
    "TensorInfo",
    "TierUsage",
]
