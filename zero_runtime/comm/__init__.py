"""Every collective the runtime issues, in one place (see :mod:`.collectives`)."""

from zero_runtime.comm.collectives import all_gather_flat, all_reduce_sum_flat, shard_of

__all__ = ["all_gather_flat", "all_reduce_sum_flat", "shard_of"]
