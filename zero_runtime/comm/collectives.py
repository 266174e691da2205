"""Collectives on flat buffers, called in replica context (inside ``strategy.run``).

Stateless functions only; bookkeeping (buckets, timings) lives elsewhere. Vocabulary:

- *flat buffer*: all of a partition group's tensors reshaped to 1-D and concatenated in a
  fixed order, then zero-padded to ``num_replicas * shard_size`` elements.
- *shard*: the contiguous slice ``[r * shard_size, (r + 1) * shard_size)`` that replica
  ``r`` owns (ZeRO, Rajbhandari et al., SC20, section 5.1: optimizer-state partitioning
  divides the flat state evenly across the data-parallel ranks).
"""

from __future__ import annotations

import tensorflow as tf


def all_reduce_sum_flat(flat: tf.Tensor) -> tf.Tensor:
    """Sum a flat buffer across all replicas.

    Args:
        flat: float tensor ``[num_replicas * shard_size]`` (the padded flat buffer).

    Returns:
        The element-wise sum over replicas, same shape and dtype.

    Raises:
        RuntimeError: called outside replica context.
    """
    ctx = _replica_context()
    # tf.identity: a tf.function argument passed straight to all_reduce fails under
    # MultiWorkerMirroredStrategy ("destinations can not be empty", TF_NOTES section 1a).
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(flat))


def shard_of(flat: tf.Tensor, shard_size: int) -> tf.Tensor:
    """This replica's shard of a flat buffer.

    Args:
        flat: tensor ``[num_replicas * shard_size]``.
        shard_size: elements per shard (int > 0).

    Returns:
        ``flat[r * shard_size : (r + 1) * shard_size]`` for this replica ``r``.
    """
    ctx = _replica_context()
    start = tf.cast(ctx.replica_id_in_sync_group, tf.int32) * shard_size
    return tf.slice(flat, [start], [shard_size])


def all_gather_flat(shard: tf.Tensor) -> tf.Tensor:
    """Concatenate every replica's shard, in replica order.

    Args:
        shard: tensor ``[shard_size]``.

    Returns:
        Tensor ``[num_replicas * shard_size]``, identical on every replica.
    """
    ctx = _replica_context()
    return ctx.all_gather(tf.identity(shard), axis=0)


def _replica_context() -> tf.distribute.ReplicaContext:
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError(
            "zero_runtime collectives must be called in replica context "
            "(inside strategy.run or a Keras train step), not in cross-replica context"
        )
    return ctx
