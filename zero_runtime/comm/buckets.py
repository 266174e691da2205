"""Bucketed gradient reduction: one collective per bucket, issued in backward order.

ZeRO stage 2 (Rajbhandari et al., SC20, section 5.2) reduces gradients bucket by bucket
as the backward pass produces them, so communication overlaps the rest of the backward
pass (DeepSpeed's ``overlap_comm`` and ``reduce_bucket_size``).

Inside a Keras train step the optimizer hook sees every gradient at once, but it only
*builds* the graph: each bucket's collective depends only on its own gradients, so
TensorFlow's executor can start it as soon as those exist, while the backward ops of
earlier layers still run. With ``overlap=False`` every collective also waits for all
gradients (a control dependency), i.e. the reductions are issued at the end.

Trace order and the replica barrier. ``MirroredStrategy`` traces its replicas one after
another in the same graph, each up to its next ``merge_call``; the strategy's own
collectives are merge calls, the runtime's raw ones (stage 2's reduce-scatter) are not.
``tf.function``'s automatic control dependencies chain every stateful op that has no
resource input (``Assert``, ``tf.print``, host callbacks) in that trace order, across
replicas. Without a barrier, replica 0's ops after its reduce-scatter (its shard update's
host callback) were traced before replica 1's forward pass, so the ``Assert`` that
``tf.nn.sparse_softmax_cross_entropy_with_logits`` adds when a shape is unknown at trace
time (any transformer fed a batch or sequence length of ``None``) waited for replica 0's
update, which waited for replica 0's all-to-all, which waited for replica 1's forward
pass: a deadlock (the watchdog's ``DeadlineExceededError`` after
``collective_timeout_seconds``). :func:`replica_barrier` (a no-op ``merge_call`` before
the raw collectives) makes every replica trace its gradients before any replica traces
what follows its reduce-scatter, so that chain never points from one replica's
post-collective ops back into another replica's pre-collective ones.
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
            inside ``tf.cond``, where the strategy's own collectives cannot run). False
            (default) means "not inside ``tf.cond``": a reduce-scatter is then preceded
            by :func:`replica_barrier`.

    Returns:
        One float32 ``[piece_size_b]`` tensor per bucket, same order as ``buckets``.

    Raises:
        RuntimeError: called outside replica context.
    """
    n = tf.distribute.get_replica_context().num_replicas_in_sync
    if scatter and not raw:
        replica_barrier()
    barrier = [] if overlap else [t for t in wait_for if t is not None]
    pieces = []
    for flat in buckets:
        with tf.control_dependencies(barrier):
            flat = tf.identity(flat)
            if scatter:
                pieces.append(reduce_scatter_sum_flat(flat, group))
            else:
                summed = all_reduce_sum_flat(flat, group if raw else None)
                size = flat.shape[0]  # static from the optimizer's layout
                pieces.append(shard_of(summed, (size or tf.shape(flat)[0]) // n))
    return pieces


def replica_barrier() -> None:
    """Trace-time barrier of the replicas (a no-op ``merge_call``); nothing runs at step time.

    Every replica's ops built before the call are traced before any replica's ops built
    after it (see the module docstring for why stage 2 needs this before its raw
    collectives). Not allowed inside ``tf.cond`` (a ``merge_call`` is not); without
    merge calls (a strategy that does not support them) it does nothing.

    Raises:
        RuntimeError: called outside replica context.
    """
    if tf.distribute.get_replica_context() is None:
        raise RuntimeError("replica_barrier must be called in replica context")
    tf.__internal__.distribute.interim.maybe_merge_call(
        lambda _strategy: None, tf.distribute.get_strategy()
    )
