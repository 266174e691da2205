"""ShardStorage: where one variable's shards live, and the copies in and out of them.

A stage-3 variable (:class:`~zero_runtime.sharded_variable.ShardedVariable`, whose
module docstring defines the vocabulary) is split into N *shards*, replica ``r``'s a
float32 ``[elements]`` array. This process stores the shards of its local replicas in
one of three ways, chosen once at construction:

- a *device variable*: a float32 ``[elements]`` resource variable on the replica's
  device (tier 'device' with ``devices``), read and assigned inside a step with no host
  call; the pool holds a reservation of its pages (``PagedBufferPool.reserve``: counted,
  pinned, no bytes);
- a *range* of a :class:`~zero_runtime.memory.FlatShardSpace` (tier 'host' or 'nvme'),
  the same on every replica, packed with other variables' shards into page-sized chunks;
- its own pool tensor of kind 'param' on ``tier`` (``shard_ids[r]``), whole pages.

The storage knows no lifecycle: its owner checks that a shard may be read or written
(the ``ShardState`` of ``zero_runtime/sharded_variable.py``) and holds its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from zero_runtime.memory.flat_store import (
    FlatRange,
    FlatShardSpace,
    column_band_rows,
    copy_columns,
)
from zero_runtime.memory.pool import PagedBufferPool


class ShardStorage:
    """The local replicas' shards of one variable, where they live (see the module).

    Args:
        pool: the :class:`~zero_runtime.memory.PagedBufferPool` holding the pages (or the
            device variables' reservations).
        tier: 'device', 'host' or 'nvme'.
        elements: elements of one shard (int >= 0).
        shard_ids: the pool tensor id of every replica's shard, ``num_shards`` of them
            (only the local replicas' are allocated; unused with a ``space``).
        local_replicas: the replica ids whose shards this process holds.
        name: the variable's name; replica ``r``'s device variable is
            ``"{name}_shard_r{r}"``.
        devices: with ``tier='device'``, the local replicas' devices (replica ``r``'s is
            ``devices[r % len(devices)]``): each local shard is then a device variable.
            Default None: pool pages on ``tier``.
        space: a :class:`~zero_runtime.memory.FlatShardSpace` on ``tier`` over
            ``local_replicas`` (the owner checks both): each shard is then a range of the
            replica's flat space. Default None.

    Raises:
        PoolOutOfMemoryError: the pool cannot hold the shards.
    """

    def __init__(
        self,
        pool: PagedBufferPool,
        tier: str,
        elements: int,
        shard_ids: Sequence[str],
        local_replicas: Sequence[int],
        name: str,
        devices: Sequence[str] | None = None,
        space: FlatShardSpace | None = None,
    ) -> None:
        self.pool = pool
        self.tier = tier
        self.elements = int(elements)
        self.shard_ids = tuple(shard_ids)
        self.space = space
        #: Replica -> its device variable, float32 ``[elements]``, or None.
        self.variables: list[tf.Variable | None] = [None] * len(self.shard_ids)
        self.range: FlatRange | None = None
        if space is not None:
            # One range, the same on every replica (allocates the chunks it enters).
            self.range = space.reserve(self.elements)
            return
        for r in local_replicas:  # a worker allocates only its own replicas' shards
            sid = self.shard_ids[r]
            if tier == "device" and devices:
                pool.reserve(sid, (self.elements,), np.float32, "param")
                self.variables[r] = _device_variable(
                    self.elements, devices[r % len(devices)], f"{name}_shard_r{r}"
                )
            else:
                pool.allocate(sid, (self.elements,), np.float32, "param", tier)

    def device_variable(self, replica: int) -> tf.Variable | None:
        """``replica``'s device variable, float32 ``[elements]``, or None (pool pages)."""
        return self.variables[replica]

    def page_ids(self, replica: int) -> tuple[str, ...]:
        """The pool tensor ids holding ``replica``'s shard, in order: the chunks of the
        flat space its range overlaps (shared with other variables; empty for an empty
        shard), or its own tensor (a device variable's reservation) without a space."""
        if self.space is not None:
            return self.space.page_ids(replica, self.range)
        return (self.shard_ids[replica],)

    def read(self, replica: int) -> np.ndarray:
        """A copy of ``replica``'s shard, float32 ``[elements]`` (pages it in).

        Raises:
            zero_runtime.memory.PagingError: a page-in from NVMe failed.
        """
        variable = self.variables[replica]
        if variable is not None:
            return np.array(variable.numpy(), np.float32, copy=True)
        if self.space is not None:
            return self.space.read(replica, self.range)
        sid = self.shard_ids[replica]
        if self.tier == "device":
            out = self.pool.acquire(sid, "device")
            try:
                return np.array(out.numpy(), np.float32)
            finally:
                self.pool.release(sid)
        out = self.pool.acquire(sid, "host")
        try:
            return np.array(out, np.float32, copy=True)
        finally:
            self.pool.release(sid)

    def read_into(self, replica: int, out: np.ndarray) -> None:
        """Copy ``replica``'s shard into ``out`` (float32 ``[elements]``, e.g. a slice of a
        unit's concatenated shards): one copy, from its pages (paged in to the host) or
        its device variable.

        Raises:
            zero_runtime.memory.PagingError: a page-in from NVMe failed.
        """
        if self.variables[replica] is not None or self.tier == "device":
            out[:] = self.read(replica)
            return
        if self.space is not None:
            self.space.read_into(replica, self.range, out)
            return
        sid = self.shard_ids[replica]
        out[:] = self.pool.acquire(sid, "host")
        self.pool.release(sid)

    def read_columns_into(
        self, replica: int, width: int, lo: int, hi: int, out: np.ndarray
    ) -> None:
        """Copy columns ``[lo, hi)`` of ``replica``'s shard, seen as a row-major float32
        ``[elements // width, width]`` matrix, into ``out`` (float32 ``[rows, hi - lo]``):
        a column tile of a kernel shard (``zero_runtime/stage3/tiling.py``). From pool
        pages only the band is copied (page by page, no copy of the whole shard first).

        Raises:
            ValueError: ``width`` does not divide the shard, bad columns or ``out`` shape.
            zero_runtime.memory.PagingError: a page-in from NVMe failed.
        """
        rows = column_band_rows(self.elements, width, lo, hi, out)
        if self.variables[replica] is not None or self.tier == "device":
            out.reshape(rows, -1)[...] = self.read(replica).reshape(rows, width)[:, lo:hi]
            return
        if self.space is not None:
            self.space.read_columns_into(replica, self.range, width, lo, hi, out)
            return
        sid = self.shard_ids[replica]
        pages = self.pool.acquire_pages(sid)
        try:
            first = 0
            for page in pages:
                copy_columns(page, first, width, lo, hi, out.reshape(rows, -1))
                first += page.size
        finally:
            self.pool.release(sid)

    def update_in_place(self, replica: int, fn: Callable[[np.ndarray], None]) -> None:
        """Run ``fn`` on ``replica``'s host-tier shard: ``fn`` gets a writable float32
        ``[elements]`` array (the page itself for a one-page shard or a range inside one
        chunk; a copy written back after ``fn`` otherwise) and updates it in place."""
        if self.space is not None:
            self.space.update_in_place(replica, self.range, fn)
            return
        sid = self.shard_ids[replica]
        view = self.pool.acquire(sid, "host", writable=True)
        try:
            fn(view)
        finally:
            self.pool.release(sid)

    def write(self, replica: int, flat: np.ndarray) -> None:
        """Store ``replica``'s shard, float32 ``[elements]``, where it lives (its device
        variable, its range of the flat space, or its pages).

        Raises:
            ValueError: ``flat`` of another size (the space's or the pool's check).
            zero_runtime.memory.PagingError: an NVMe write failed.
        """
        variable = self.variables[replica]
        if variable is not None:
            variable.assign(flat)
        elif self.space is not None:
            self.space.write(replica, self.range, flat)
        else:
            self.pool.write(self.shard_ids[replica], flat)

    def free(self) -> None:
        """Free every shard page (the device variables are dropped); with a ``space``,
        give the range back (chunks no other shard uses are freed). Idempotent."""
        for sid in self.shard_ids:
            if self.space is None and sid in self.pool.tensor_ids():
                self.pool.free(sid)
        self.variables = [None] * len(self.shard_ids)
        if self.space is not None and self.range is not None:
            self.space.release(self.range)
            self.range = None


def _device_variable(elements: int, device: str, name: str) -> tf.Variable:
    """A zero float32 ``[elements]`` resource variable on ``device``, made outside any
    trace and outside the strategy's variable creator (a plain per-replica variable, as
    ``zero_runtime.optim.device_state``'s)."""
    with tf.init_scope(), tf.device(device):
        return resource_variable_ops.ResourceVariable(
            tf.zeros([elements], tf.float32), trainable=False, name=name.replace(":", "_")
        )
