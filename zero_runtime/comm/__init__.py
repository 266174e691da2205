"""Every collective the runtime issues, in one place (see :mod:`.collectives`)."""

from zero_runtime.comm.buckets import reduce_buckets
from zero_runtime.comm.collectives import (
    all_gather_flat,
    all_reduce_sum_flat,
    all_reduce_sum_of_squares,
    broadcast_bytes,
    gather_local_shards,
    reduce_scatter_sum_flat,
    shard_of,
)
from zero_runtime.comm.groups import REDUCE_SCATTER_IMPLS, CollectiveGroup, WorkerGroup
from zero_runtime.comm.watchdog import (
    WATCHDOG,
    CollectiveWatchdog,
    WatchdogState,
    guard_strategy_collectives,
    one_deadline,
)

__all__ = [
    "REDUCE_SCATTER_IMPLS",
    "WATCHDOG",
    "CollectiveGroup",
    "CollectiveWatchdog",
    "WatchdogState",
    "WorkerGroup",
    "all_gather_flat",
    "all_reduce_sum_flat",
    "all_reduce_sum_of_squares",
    "broadcast_bytes",
    "gather_local_shards",
    "guard_strategy_collectives",
    "one_deadline",
    "reduce_buckets",
    "reduce_scatter_sum_flat",
    "shard_of",
]
