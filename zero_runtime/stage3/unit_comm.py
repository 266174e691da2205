"""The collectives of one unit use on one replica: its shards read, all-gathered and cut
into views; its view gradients reduce-scattered (the units path,
:mod:`zero_runtime.stage3.gather`; the tiles use the reduce-scatter).

Stateless functions, FSDP2-style: the caller (:class:`~zero_runtime.stage3.gather.UnitRunner`,
:mod:`~zero_runtime.stage3.tiling`) owns the step state and the order. Shapes: ``N``
replicas, ``E`` the unit's shard elements (float32, the sum of its originals'
``shard_elements``); a view has its original's logical shape.

**Host calls in a step are stateless** (``host_function(..., stateful=False)``), ordered
by data dependencies only. TensorFlow's automatic control dependencies run *stateful*
ops in program order, and the replicas of a MirroredStrategy step are traced one after
the other into one graph, so a stateful host call of replica 1 would wait for every
stateful op of replica 0, including the all-gathers that wait for replica 1 (a deadlock,
seen as a collective timeout). Each call takes a data-dependent input (the use's input,
and :func:`not_foldable`), so it is neither constant-folded nor merged, and runs when its
inputs exist; a call made for its side effect must feed a value that is used (Grappler
prunes control dependencies on stateless ops). The strategy the step is traced under
owns the function (:func:`zero_runtime.lifecycle.host_function`), so the graph does not
keep it alive.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from zero_runtime import comm
from zero_runtime.lifecycle import host_function
from zero_runtime.memory import staging


def gather_views(
    variables: tuple,
    replica: int,
    dep: tf.Tensor,
    group,
    num_shards: int,
    schedule=None,
    dtype: str | None = None,
) -> list[tf.Tensor]:
    """The views of ``variables`` (one unit's sharded originals) on ``replica``: one read
    of their shards (their device variables, or one host call for pool pages), one
    all-gather of the concatenated shards, the gathered ``(N, E)`` rows cut per original.

    Args:
        variables: the :class:`~zero_runtime.sharded_variable.ShardedVariable` originals.
        replica: the replica id (static).
        dep: a tensor the read waits for (the use's input: uses run in data order).
        group: the engine's :class:`~zero_runtime.comm.CollectiveGroup`.
        num_shards: N.
        schedule: the :class:`~zero_runtime.stage3.schedule.ReadSchedule` (NVMe: the read
            first prefetches the next reads' pages), or None (default).
        dtype: None (default) gathers float32; a 16-bit float dtype name (``"bfloat16"``,
            ``"float16"``) casts the replica's shard first, so the all-gather moves half
            the bytes (the float32 shards stay the master weights).

    Returns:
        One float32 tensor per original, of its logical shape.
    """
    e = sum(v.shard_elements for v in variables)
    shard = _device_shards(variables, replica)
    if shard is None:  # pool pages (host, NVMe): one host read
        # NVMe: the read first prefetches the next reads' pages (stage3/schedule.py).
        prefetch = schedule.read(replica, variables) if schedule else None
        shard = host_function(
            functools.partial(_read_shards, variables, replica, prefetch),
            [dep, not_foldable()],
            tf.float32,
            stateful=False,  # ordered by ``dep`` only (the module docstring)
            name="zero3_unit_shards",
        )
    shard.set_shape([e])
    if dtype is not None:
        shard = tf.cast(shard, dtype)
    full = comm.all_gather_flat(shard, group)  # (N * E,)
    rows = tf.reshape(full, [num_shards, e])  # (N, E)
    views, off = [], 0
    for v in variables:
        piece = rows[:, off : off + v.shard_elements]  # (N, R * prod(rest))
        off += v.shard_elements
        moved = tf.reshape(piece, [v.padded_rows, *v._moved_shape[1:]])  # noqa: SLF001
        moved = moved[: v._moved_shape[0]]  # noqa: SLF001  (D, *rest)
        if v.shard_dim:
            moved = tf.experimental.numpy.moveaxis(moved, 0, v.shard_dim)
        view = tf.reshape(moved, v.shape)
        # Float32 views of 16-bit gathered values (exact): the layer's autocast gives
        # the compute dtype back bitwise, and the views' gradients are float32 where
        # Keras's are (a tied weight's uses and an embedding's repeated rows are
        # summed in float32, as under MirroredStrategy).
        views.append(view if dtype is None else tf.cast(view, tf.float32))
    return views


def not_foldable() -> tf.Tensor:
    """A float32 scalar 0.0 read from a variable: an extra input of a host read that is
    stateless (``stateful=False``, ordered by its data input only).

    A stateless host call whose inputs are all constants (a use whose input is computed
    in the step from constants only, such as a GAN's noise from
    ``tf.random.stateless_normal`` with a static shape) is evaluated once by Grappler's
    constant folding when the function is instantiated: every later step would read the
    shards as they were then. A variable's read is never folded, and it adds no order
    between the replicas' ops (automatic control dependencies order only the reads and
    writes of one resource, and nothing writes this one; a stateful op without a resource
    input, such as ``tf.timestamp``, would be chained after every other such op of the
    step, across replicas: a deadlock of their collectives)."""
    global _FRESH
    with _FRESH_LOCK:
        if _FRESH is None:
            with tf.init_scope():  # created eagerly, outside any strategy's creator
                _FRESH = resource_variable_ops.ResourceVariable(
                    0.0, trainable=False, name="zero3_not_foldable"
                )
    return _FRESH.read_value()


_FRESH = None
_FRESH_LOCK = threading.Lock()


def _device_shards(variables: tuple, replica: int) -> tf.Tensor | None:
    """The replica's shards of ``variables`` read from their device variables and
    concatenated, float32 ``[sum(shard_elements)]`` (no host call; automatic control
    dependencies order each read after the previous step's assign of that variable), or
    None when a shard lives in pool pages (``ShardedVariable.device_shard``)."""
    shards = [v.device_shard(replica) for v in variables]
    if not shards or any(s is None for s in shards):
        return None
    reads = [s.read_value() for s in shards]
    return reads[0] if len(reads) == 1 else tf.concat(reads, axis=0)


def _read_shards(variables: tuple, replica: int, prefetch=None, *_) -> np.ndarray:
    """Host side of a gather: the replica's shards of ``variables``, concatenated (each
    copied once, into its slice of the result). ``prefetch``: None, or the read's
    :class:`~zero_runtime.stage3.schedule.PassReads` hook, run first (queues the next
    reads' pages, NVMe -> host)."""
    if prefetch is not None:
        prefetch()
    out = staging.empty(sum(v.shard_elements for v in variables))  # recycled, aligned
    off = 0
    for v in variables:
        v.read_shard_into(replica, out[off : off + v.shard_elements])
        off += v.shard_elements
    return out


def reduce_scatter_variables(variables, grads: list, group, raw: bool = False) -> tf.Tensor:
    """Reduce-scatter the full gradients of ``variables`` in one collective.

    Each gradient is laid out like its variable's shards (``shard_dim`` moved to axis 0,
    rows padded to ``N * R``), the N row blocks of all variables are concatenated, and
    one reduce-scatter leaves this replica the sum over replicas of its own block.

    Args:
        variables: ShardedVariables.
        grads: their full gradients (logical shapes).
        group: the :class:`~zero_runtime.comm.CollectiveGroup`.
        raw: with the group's ``'all_reduce'`` implementation, all-reduce through the
            group's raw ``CollectiveReduceV2`` (ordered by the replica's token like the
            all-gathers) rather than the strategy's ``merge_call``. Default False.

    Returns:
        float32 ``[E]``, ``E = sum(v.shard_elements)``: the replica's reduced shard of
        each variable, concatenated in order.
    """
    n = variables[0].num_shards
    cols = []
    for g, v in zip(grads, variables):
        g = tf.cast(g, tf.float32)
        if v.shape:
            g = tf.experimental.numpy.moveaxis(g, v.shard_dim, 0) if v.shard_dim else g
            g = tf.reshape(g, [v._moved_shape[0], -1])  # noqa: SLF001  (D, prod(rest))
        else:
            g = tf.reshape(g, [1, 1])
        pad = v.padded_rows - v._moved_shape[0]  # noqa: SLF001
        if pad:
            g = tf.pad(g, [[0, pad], [0, 0]])
        cols.append(tf.reshape(g, [n, v.shard_elements]))  # (N, R * prod(rest))
    flat = tf.reshape(tf.concat(cols, axis=1), [-1])  # (N * E,)
    if raw and group.reduce_scatter_impl == "all_reduce":
        total = comm.all_reduce_sum_flat(flat, group)  # (N * E,)
        shard = comm.shard_of(total, int(flat.shape[0]) // n)  # (E,)
    else:
        shard = comm.reduce_scatter_sum_flat(flat, group)  # (E,)
    if group.reduce_scatter_impl == "all_reduce":
        # A copy (see Stage3Engine._reduce_scatter): the slice would alias the whole sum.
        shard = tf.gather(tf.reshape(shard, [1, -1]), 0)
    return shard
