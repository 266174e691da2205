"""Bytes each collective kind moves per optimizer step, from the optimizer's flat buffers.

Counted where the partitioned optimizer issues its collectives (``zero_runtime.optim``):
the *input* buffer of each call, per replica, summed over the local replicas, in bytes
(float32, 4 bytes per element). With ``N`` = ``gradient_accumulation_steps``:

- stage 1: one ``all_reduce`` per bucket of the padded flat gradient, ``4 * padded_total``
  (once per optimizer step);
- stage 2: one ``reduce_scatter`` per bucket, ``4 * padded_total`` per micro-batch, so
  ``N * 4 * padded_total`` per optimizer step (an ``all_reduce`` instead when the group's
  implementation is, or fell back to, 'all_reduce': ``CollectiveGroup.impl_used``);
- both: one ``all_gather`` of the updated shard, ``4 * shard_size``.

The scalar all-reduce of the gradient norm (stage 2 with accumulation and
``global_clipnorm``) is not counted (4 bytes).
"""

from __future__ import annotations

from typing import Any

#: Columns of the per-step collective vector: bytes then calls per kind.
COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather")


def collective_bytes(zero_state: Any, local_replicas: int) -> dict[str, float]:
    """Per-step bytes and calls per collective kind for one optimizer's ZeRO state.

    Args:
        zero_state: a ``ZeroOptimizerState`` (``layout``, ``stage``, ``group``,
            ``accumulation_steps``), or a stage-0 ``MirroredOptimizerState`` (the stock
            update: one all-reduce per gradient, ``4 * total`` bytes per replica).
        local_replicas: replicas in this process.

    Returns:
        ``{"<kind>_bytes": float, "<kind>_calls": float}`` for each kind of
        :data:`COLLECTIVE_KINDS`.
    """
    layout = zero_state.layout
    n = layout.num_shards
    buckets = max(1, len(layout.buckets))
    padded = sum(b.padded_size(n) for b in layout.buckets) or n * layout.shard_size
    acc = max(1, int(zero_state.accumulation_steps))
    out = {f"{k}_{u}": 0.0 for k in COLLECTIVE_KINDS for u in ("bytes", "calls")}
    if zero_state.stage == 0:  # mirrored: one all-reduce of every gradient, no all-gather
        out["all_reduce_bytes"] += 4.0 * layout.total * local_replicas
        out["all_reduce_calls"] += float(len(layout.sizes) * local_replicas)
        return out
    if zero_state.stage >= 2:
        impl = getattr(zero_state.group, "impl_used", "all_reduce")
        kind = (
            "all_reduce" if impl == "all_reduce" or zero_state.group is None else "reduce_scatter"
        )
        out[f"{kind}_bytes"] += 4.0 * padded * acc * local_replicas
        out[f"{kind}_calls"] += float(buckets * acc * local_replicas)
    else:
        out["all_reduce_bytes"] += 4.0 * padded * local_replicas
        out["all_reduce_calls"] += float(buckets * local_replicas)
    out["all_gather_bytes"] += 4.0 * layout.shard_size * local_replicas
    out["all_gather_calls"] += float(local_replicas)
    return out
