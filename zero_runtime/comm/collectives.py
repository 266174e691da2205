"""Collectives on flat buffers, called in replica context (inside ``strategy.run``).

Stateless functions only; the keys and ordering tokens of the raw collectives live in
:class:`~zero_runtime.comm.groups.CollectiveGroup`, bucket bookkeeping in
:mod:`zero_runtime.comm.buckets`, deadlines in :mod:`zero_runtime.comm.watchdog`: every
op is issued with ``timeout_seconds=0`` (TensorFlow's timeout costs an OS thread per op
for the whole timeout) and its group's ``timeout_seconds`` is enforced by the process's
one watchdog thread instead. Vocabulary:

- *flat buffer*: all of a partition group's tensors reshaped to 1-D and concatenated in a
  fixed order, then zero-padded to ``num_replicas * shard_size`` elements.
- *shard*: the contiguous slice ``[r * shard_size, (r + 1) * shard_size)`` that replica
  ``r`` owns (ZeRO, Rajbhandari et al., SC20, section 5.1: optimizer-state partitioning
  divides the flat state evenly across the data-parallel ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_collective_ops

from zero_runtime.comm.groups import CollectiveGroup, WorkerGroup
from zero_runtime.comm.watchdog import WATCHDOG, guard

log = logging.getLogger(__name__)


def all_reduce_sum_flat(flat: tf.Tensor, group: CollectiveGroup | None = None) -> tf.Tensor:
    """Sum a flat buffer across all replicas.

    Args:
        flat: float tensor ``[num_replicas * shard_size]`` (the padded flat buffer), or any
            shape (the sum is element-wise).
        group: None (default) for the strategy's own all-reduce (``ReplicaContext``), or
            the runtime's group for a raw ``CollectiveReduceV2``: needed inside
            ``tf.cond``, where the strategy's collectives (``merge_call``) are not allowed.

    Returns:
        The element-wise sum over replicas, same shape and dtype.

    Raises:
        RuntimeError: called outside replica context.
    """
    ctx = _replica_context()
    if group is not None and ctx.num_replicas_in_sync == 1:
        return tf.identity(flat)  # one replica: the sum; the strategy's call (merge_call)
        # would fail inside tf.cond (gradient accumulation's update on a one-replica job)
    if group is not None:
        return _raw(ctx, group, "all_reduce", flat, _reduce_v2)
    # tf.identity: a tf.function argument passed straight to all_reduce fails under
    # MultiWorkerMirroredStrategy ("destinations can not be empty", TF_NOTES section 1a).
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(flat))


def all_reduce_sum_of_squares(
    tensors: list[tf.Tensor], group: CollectiveGroup | None = None
) -> tf.Tensor:
    """The sum over replicas of the sum of squares of each replica's ``tensors``.

    ``||G||^2`` of a tensor ``G`` split across the replicas (each replica passes its own
    parts of it, every element in exactly one replica's parts; zero padding adds
    nothing): the square of the global norm of ``tf.clip_by_global_norm``
    (``sqrt(sum_t l2norm(t)^2)``, TensorFlow's ``clip_ops.global_norm``).

    Args:
        tensors: this replica's tensors, any shapes, float dtypes (squared in float32);
            at least one. Every replica calls it as many times, in the same order.
        group: as :func:`all_reduce_sum_flat` (None: the strategy's all-reduce).

    Returns:
        A float32 scalar, the same on every replica.

    Raises:
        ValueError: ``tensors`` is empty.
        RuntimeError: called outside replica context.
    """
    if not tensors:
        raise ValueError("all_reduce_sum_of_squares needs at least one tensor")
    local = tf.add_n([tf.reduce_sum(tf.square(tf.cast(t, tf.float32))) for t in tensors])
    return all_reduce_sum_flat(tf.reshape(local, [1]), group)[0]  # (1,) -> scalar


def shard_of(flat: tf.Tensor, shard_size: int) -> tf.Tensor:
    """This replica's shard of a flat buffer.

    Args:
        flat: tensor ``[num_replicas * shard_size]``.
        shard_size: elements per shard (int > 0, or an int32 scalar tensor when the
            length of ``flat`` is not known at trace time).

    Returns:
        ``flat[r * shard_size : (r + 1) * shard_size]`` for this replica ``r``.
    """
    ctx = _replica_context()
    start = tf.cast(ctx.replica_id_in_sync_group, tf.int32) * shard_size
    return tf.slice(flat, [start], [shard_size])


def reduce_scatter_sum_flat(flat: tf.Tensor, group: CollectiveGroup | None) -> tf.Tensor:
    """Sum a flat buffer across replicas and return only this replica's shard of the sum.

    ZeRO stage 2 (Rajbhandari et al., SC20, section 5.2, "P_os+g"): each replica keeps
    only the reduced gradients of the shard it updates. One function, three paths, chosen
    by ``group.reduce_scatter_impl``:

    - ``'nccl'`` (GPUs): ``CollectiveReduceScatterV2`` with NCCL.
    - ``'all_to_all'`` (CPU, where TF has no reduce-scatter kernel; TF_NOTES section 2):
      ``CollectiveAllToAllV2`` sends row ``j`` of ``flat`` viewed as ``[n, shard_size]``
      to replica ``j``; the replica sums the ``n`` rows it receives. Same bytes on the
      wire as a ring reduce-scatter, ``(n - 1) / n`` of the buffer per replica.
    - ``'all_reduce'`` (or ``group`` None): all-reduce the whole buffer and slice; the
      result, and what the replica keeps, is the same shard.

    Args:
        flat: float32 tensor ``[n * shard_size]``, n = replicas in sync.
        group: the runtime's collective group (keys, ordering tokens), or None for the
            all-reduce path.

    Returns:
        float32 ``[shard_size]``: ``sum_r flat_r[i * shard_size : (i + 1) * shard_size]``
        on replica ``i``.

    A buffer whose length is not known at trace time cannot be viewed as ``[n,
    shard_size]`` (all-to-all) nor given to the native kernel: it is all-reduced and
    sliced instead, the group records it (``group.fallback_impl = 'all_reduce'``, named by
    ``group.impl_used`` and the collective telemetry) and a warning is logged once per
    group. The partitioned optimizer never makes such a buffer: it flattens gradients to
    the variables' static sizes (zero_runtime/optim/flat_update.py).

    Raises:
        RuntimeError: called outside replica context.
        ValueError: the length of ``flat`` is static but not divisible by n.
    """
    ctx = _replica_context()
    n = ctx.num_replicas_in_sync
    length = flat.shape[0]
    if length is None:
        if group is not None and group.reduce_scatter_impl != "all_reduce":
            _note_fallback(group, "a flat buffer whose length is unknown at trace time")
        shard_size = tf.shape(flat)[0] // n
        return shard_of(all_reduce_sum_flat(flat), shard_size)
    if length % n:
        raise ValueError(f"flat buffer length {length} is not a static multiple of {n}")
    shard_size = length // n
    if group is None or group.reduce_scatter_impl == "all_reduce" or n == 1:
        return shard_of(all_reduce_sum_flat(flat), shard_size)
    if group.reduce_scatter_impl == "nccl":
        return _raw(ctx, group, "reduce_scatter", flat, _reduce_scatter_v2)
    rows = _raw(  # (n, shard_size): row j -> replica j
        ctx, group, "all_to_all", tf.reshape(flat, [n, shard_size]), _all_to_all_v2
    )
    return tf.reduce_sum(rows, axis=0)  # (shard_size,)


def _note_fallback(group: CollectiveGroup, why: str) -> None:
    """Record on ``group`` that a reduce-scatter ran as an all-reduce; log it once."""
    if group.fallback_impl is None:
        log.warning(
            "zero_runtime: reduce-scatter implementation %r (group %d) cannot serve %s; "
            "using 'all_reduce' plus a slice for it (same result, the whole buffer on "
            "every replica for the duration of the collective)",
            group.reduce_scatter_impl,
            group.group_key,
            why,
        )
    group.fallback_impl = "all_reduce"


def all_gather_flat(shard: tf.Tensor, group: CollectiveGroup | None = None) -> tf.Tensor:
    """Concatenate every replica's shard, in replica order.

    Args:
        shard: tensor ``[shard_size]``.
        group: None (default) for the strategy's all-gather, or the runtime's group for a
            raw ``CollectiveGatherV2`` (inside ``tf.cond``; see :func:`all_reduce_sum_flat`).

    Returns:
        Tensor ``[num_replicas * shard_size]``, identical on every replica.
    """
    ctx = _replica_context()
    if shard.dtype == tf.bfloat16:
        return _all_gather_bf16(shard, group)
    if group is not None and ctx.num_replicas_in_sync == 1:
        return tf.identity(shard)  # one replica: its shard is the whole (see all_reduce)
    if group is not None:
        return _raw(ctx, group, "all_gather", shard, gen_collective_ops.collective_gather_v2)
    return ctx.all_gather(tf.identity(shard), axis=0)


def _all_gather_bf16(shard: tf.Tensor, group: CollectiveGroup | None) -> tf.Tensor:
    """:func:`all_gather_flat` of a bfloat16 ``[E]`` shard (E static). TensorFlow's
    gather kernels take no bfloat16 (``CollectiveGatherV2``: float16/32/64, int32/64), so
    the shard's bytes travel as int32: pairs of bfloat16 bitcast to one int32 (E padded
    to even), the same bytes on the wire, bitcast back after the gather."""
    e = int(shard.shape[0])
    pad = e % 2
    if pad:
        shard = tf.concat([shard, tf.zeros([1], tf.bfloat16)], axis=0)
    words = tf.bitcast(tf.reshape(shard, [-1, 2]), tf.int32)  # (ceil(E / 2),)
    full = tf.bitcast(all_gather_flat(words, group), tf.bfloat16)  # (N * ceil(E / 2), 2)
    if pad:
        return tf.reshape(tf.reshape(full, [-1, e + 1])[:, :e], [-1])
    return tf.reshape(full, [-1])


def gather_local_shards(local: Mapping[int, np.ndarray], group: WorkerGroup) -> np.ndarray:
    """Every replica's shard on every worker, from host code between steps (eager).

    The multi-worker counterpart of reading all shards from one process's pool: with
    ``MultiWorkerMirroredStrategy`` a worker holds only its local replicas' shards, so
    ``ShardedVariable.gather_on_demand`` (``get_weights``, saving) all-gathers them: one
    eager ``CollectiveGatherV2`` over the workers (no ``tf.function``, so nothing is traced
    per variable shape). Every worker must call it, in the same order (as every
    collective).

    Args:
        local: ``{replica id in sync: float32 [E]}`` for exactly this worker's replicas
            (ids ``rank * local + i``, consecutive), E the same on every replica.
        group: the :class:`~zero_runtime.comm.groups.WorkerGroup` of the workers (one
            device each; TensorFlow orders the group's members by task, i.e. by rank).

    Returns:
        float32 ``[N, E]``, row r = replica r's shard, identical on every worker.

    Raises:
        RuntimeError: called inside a ``tf.function`` (it runs eagerly, between steps).
        tf.errors.DeadlineExceededError: a worker did not join within the group's timeout.
    """
    if tf.inside_function():
        raise RuntimeError("gather_local_shards runs eagerly, outside strategy.run")
    rows = np.stack([np.asarray(local[r], np.float32) for r in sorted(local)])  # (local, E)
    if group.group_size == 1:
        return rows
    instance = group.next_instance_key()
    what = f"all_gather (worker group {group.group_key}, instance {instance})"
    with tf.device(group.device), WATCHDOG.deadline(group.timeout_seconds, what):
        out = gen_collective_ops.collective_gather_v2(
            tf.constant(rows),
            group_size=group.group_size,
            group_key=group.group_key,
            instance_key=instance,
            ordering_token=[],
            timeout_seconds=0,  # the watchdog's deadline, not a TensorFlow timer thread
        )
        return out.numpy()  # (N, E): the workers' rows in rank order


def broadcast_bytes(payload: bytes | None, group: WorkerGroup, max_bytes: int) -> bytes:
    """The root's bytes on every worker: an eager sum all-reduce where only the root
    contributes (the others pass None).

    Issued from host code (eager), also from a host callback inside a running step (the
    runtime's step boundary; measured to complete there under MultiWorkerMirroredStrategy,
    since the step's own collectives use other group keys). Every worker must call it the
    same number of times, in the same order.

    Layout on the wire: float32 ``[1 + max_bytes]``, element 0 the payload's length and
    element 1 + i its byte i (exact: a float32 holds integers up to 2**24, and all but one
    contribution are 0). Cost: one all-reduce of ``4 * (1 + max_bytes)`` bytes.

    Args:
        payload: the root's bytes (``len <= max_bytes``), or None on every other worker.
        group: the :class:`~zero_runtime.comm.groups.WorkerGroup` of the workers.
        max_bytes: the fixed payload capacity, bytes (the same on every worker).

    Returns:
        The root's payload (``b""`` when it sent an empty one).

    Raises:
        ValueError: ``payload`` longer than ``max_bytes``.
        tf.errors.DeadlineExceededError: a worker did not join within the group's timeout.
    """
    buf = np.zeros(1 + max_bytes, np.float32)
    if payload is not None:
        if len(payload) > max_bytes:
            raise ValueError(f"payload of {len(payload)} bytes exceeds max_bytes={max_bytes}")
        buf[0] = len(payload)
        buf[1 : 1 + len(payload)] = np.frombuffer(payload, np.uint8)
    if group.group_size == 1:
        out = buf
    else:
        instance = group.next_instance_key()
        what = f"broadcast (worker group {group.group_key}, instance {instance})"
        with tf.device(group.device), WATCHDOG.deadline(group.timeout_seconds, what):
            out = gen_collective_ops.collective_reduce_v2(
                tf.constant(buf),
                group_size=group.group_size,
                group_key=group.group_key,
                instance_key=instance,
                ordering_token=[],
                merge_op="Add",
                final_op="Id",
                timeout_seconds=0,  # the watchdog's deadline, not a TensorFlow timer thread
            ).numpy()
    length = int(out[0])
    return bytes(out[1 : 1 + length].astype(np.uint8))


def _raw(
    ctx: tf.distribute.ReplicaContext, group: CollectiveGroup, kind: str, flat: tf.Tensor, op
) -> tf.Tensor:
    """``op(flat, **keys)``, a raw V2 collective of ``group``, under the group's deadline."""
    replica = _static_replica_id(ctx)
    group.record(kind, flat)
    instance = group.next_instance_key(replica)
    args = dict(
        group_size=ctx.num_replicas_in_sync,
        group_key=group.group_key,
        instance_key=instance,
        ordering_token=[group.token(replica)],
        timeout_seconds=0,  # the watchdog's deadline, not a TensorFlow timer thread
    )
    what = f"{kind} (group {group.group_key}, instance {instance}, replica {replica})"
    return guard(
        lambda x: op(x, **args),
        flat,
        group.timeout_seconds,
        what,
        token=group.token_variable(replica),
    )


def _reduce_v2(flat: tf.Tensor, **args) -> tf.Tensor:
    return gen_collective_ops.collective_reduce_v2(flat, merge_op="Add", final_op="Id", **args)


def _reduce_scatter_v2(flat: tf.Tensor, **args) -> tf.Tensor:
    return gen_collective_ops.collective_reduce_scatter_v2(
        flat, merge_op="Add", final_op="Id", communication_hint="nccl", **args
    )


def _all_to_all_v2(flat: tf.Tensor, **args) -> tf.Tensor:
    return gen_collective_ops.collective_all_to_all_v2(flat, **args)


def _static_replica_id(ctx: tf.distribute.ReplicaContext) -> int:
    rid = tf.get_static_value(ctx.replica_id_in_sync_group)
    if rid is None:
        raise RuntimeError("the replica id must be static to pick the collective's token")
    return int(rid)


def _replica_context() -> tf.distribute.ReplicaContext:
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError(
            "zero_runtime collectives must be called in replica context "
            "(inside strategy.run or a Keras train step), not in cross-replica context"
        )
    return ctx
