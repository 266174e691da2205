"""Bucketed gradient reduction: one collective per bucket, issued in backward order.

ZeRO stage 2 (Rajbhandari et al., SC20, section 5.2) reduces gradients bucket by bucket
as the backward pass produces them, so communication overlaps the rest of the backward
pass (DeepSpeed's ``overlap_comm`` and ``reduce_bucket_size``).

Inside a Keras train step the optimizer hook sees every gradient at once, but it only
*builds* the graph: each bucket's collective depends only on its own gradients, so
TensorFlow's executor can start it as soon as those exist, while the backward ops of
earlier layers still run. With ``overlap=False`` every collective also waits for all
gradients (a control dependency), i.e. the reductions are issued at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from zero_runtime.comm.collectives import (
    all_reduce_sum_flat,
    reduce_scatter_sum_flat,
    shard_of,
)
from zero_runtime.comm.groups import CollectiveGroup


def reduce_buckets(
    buckets: Sequence[tf.Tensor],
    *,
    scatter: bool,
    group: CollectiveGroup | None,
    overlap: bool = True,
    wait_for: Sequence[tf.Tensor] = (),
    raw: bool = False,
) -> list[tf.Tensor]:
    """Reduce padded bucket buffers across replicas; return this replica's piece of each.

    Args:
        buckets: float32 tensors ``[n * piece_size_b]`` in reduction order (the order the
            backward pass makes them ready), n = replicas in sync.
        scatter: True for a reduce-scatter (ZeRO-2: the replica only ever holds the
            reduced piece), False for an all-reduce then a slice (ZeRO-1: the reduced
            bucket exists in full on every replica, then the piece is taken).
        group: the runtime's collective group for reduce-scatter (None: all-reduce path).
        overlap: True (default) to issue each bucket's collective as soon as its inputs
            exist; False to make every collective wait for ``wait_for``.
        wait_for: tensors that must exist before any collective starts when
            ``overlap=False`` (all the step's gradients).
        raw: issue the all-reduce path with ``group``'s raw collectives too (required
            inside ``tf.cond``, where the strategy's own collectives cannot run).

    Returns:
        One float32 ``[piece_size_b]`` tensor per bucket, same order as ``buckets``.

    Raises:
        RuntimeError: called outside replica context.
    """
    n = tf.distribute.get_replica_context().num_replicas_in_sync
    barrier = [] if overlap else [t for t in wait_for if t is not None]
    pieces = []
    for flat in buckets:
        with tf.control_dependencies(barrier):
            flat = tf.identity(flat)
            if scatter:
                pieces.append(reduce_scatter_sum_flat(flat, group))
            else:
                summed = all_reduce_sum_flat(flat, group if raw else None)
                pieces.append(shard_of(summed, int(flat.shape[0]) // n))
    return pieces
