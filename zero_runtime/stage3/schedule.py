"""The units path's read schedule: NVMe parameter prefetch along the recorded reads.

On the units path (:mod:`zero_runtime.stage3.units_path`) each use of a unit whose shards
live in pool pages reads them in one blocking host call (``gather._read_shards``; a tile
of a tiled unit, ``tiling._read_tile``). With ``offload_param='nvme'`` a page that is not
on the host makes that call wait for the disk. This module records the order of a traced
pass's reads on each replica, with the pool tensors (flat-space chunks,
``ShardedVariable.page_ids``) each one reads; from then on every read first queues
``pool.prefetch`` (NVMe -> host) of the pages of the reads that follow it, then reads. The
prefetch rides in the read's own host call: no host call is added, and the prefetch
thread pages in while the step computes.

The order is recorded when a pass is traced (the first step of a training, evaluate or
predict function; a retrace records its own), one :class:`PassReads` per replica and
pass, and each read's host call is bound to its position in it. Trace order is run
order: the forward's reads are chained by data (a unit's read waits for its input, the
previous unit's output; a tile's for the previous tile's output) and the backward, traced
by ``tape.gradient`` in reverse, re-gathers each unit after the gradient that reaches it.
A forward-only pass (evaluate, predict) has its own, shorter order. Units and tiles count
alike: a tile's read is a read of its kernel's pages (every tile of a row-major shard
touches all of them), its bias read another.

How far ahead, from read ``k``: the reads ``k+1, k+2, ...`` in order, each whose pages
are not already counted (the current read's, or an earlier one's) costing its shard
elements, while the sum stays within ``prefetch_bucket_size`` elements (0 disables
prefetch), and their new pages within half of what the replica's share of the pool's
host tier (its capacity over the local replicas) leaves beside the pages of the current
and the previous read (a read that does not fit: its first pages). The previous read's
pages stay because in backward its unit is updated after its reduce-scatter, which may
come after this read: the request names them first, so the prefetch thread does not
evict them (it never evicts the tensors it brings). Half, because the host tier is full
in a step that pages: each page brought in first writes a changed one back, and both
hold a slot until that write ends. Deeper requests were measured to evict, by LRU, pages
used before the ones they bring (``tests/test_stage3_units_nvme.py``: more page-ins than
without prefetch)."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Read:
    """One recorded host read of one replica.

    Attributes:
        ids: the pool tensor ids it acquires (flat-space chunks), in order.
        elements: float32 elements of the shards it reads (a tile's: its kernel's shard).
    """

    ids: tuple[str, ...]
    elements: int


class PassReads:
    """The reads of one traced pass on one replica, in run order, and the prefetch each
    read issues.

    Args:
        pool: the engine's :class:`~zero_runtime.memory.PagedBufferPool`.
        bucket: ``() -> int``, the ``prefetch_bucket_size`` in effect (elements; read at
            each prefetch, so a live change applies from the next one).
        window_pages: pool pages of the host tier this replica's prefetch may fill (>= 0).
    """

    def __init__(self, pool, bucket: Callable[[], int], window_pages: int) -> None:
        self.pool = pool
        self.reads: list[Read] = []
        self._bucket = bucket
        self._window = window_pages
        self._ahead: dict[tuple[int, int], tuple[str, ...]] = {}  # (k, bucket) -> ids

    def add(self, ids: tuple[str, ...], elements: int) -> Callable[[], None]:
        """Record the next read (trace time); returns its run-time hook, which queues the
        prefetch of the reads after it (:meth:`prefetch_after`)."""
        self.reads.append(Read(tuple(ids), int(elements)))
        return functools.partial(self.prefetch_after, len(self.reads) - 1)

    def ahead(self, k: int, bucket: int) -> tuple[str, ...]:
        """The pool tensor ids read k's prefetch asks for (see the module docstring),
        in read order, each once; empty for ``bucket`` 0 or the last read."""
        key = (k, bucket)
        ids = self._ahead.get(key)
        if ids is not None:
            return ids
        seen = set(self.reads[k].ids)
        # The previous read's pages stay too: in backward its unit is updated after its
        # reduce-scatter, which may come after this read (the update during backward).
        held = seen | set(self.reads[k - 1].ids if k else ())
        pages = (self._window - len(held)) // 2
        budget, out = bucket, []
        for read in self.reads[k + 1 :]:
            new = [t for t in dict.fromkeys(read.ids) if t not in seen]
            if not new:
                continue
            if read.elements > budget or pages <= 0:
                break
            budget -= read.elements
            new = new[:pages]  # a read that does not fit: its first pages
            pages -= len(new)
            seen.update(new)
            out += new
        ids = self._ahead[key] = tuple(out)
        return ids

    def prefetch_after(self, k: int) -> None:
        """Run time, in read ``k``'s host call, before it reads: queue the prefetch of
        :meth:`ahead` (returns at once; the pool's prefetch thread pages in)."""
        ids = self.ahead(k, self._bucket())
        if ids:
            # The previous read's pages first: already on the host, they are kept there
            # by this request (a prefetch never evicts the tensors it names) until their
            # next use, in backward the update of that read's unit.
            held = list(dict.fromkeys(self.reads[k - 1].ids)) if k else []
            self.pool.prefetch([*held, *ids])


class ReadSchedule:
    """Records each replica's reads per traced pass and hands each read its prefetch.

    Args:
        pool: the engine's pool (its host tier's capacity bounds how far ahead).
        tier: the parameter shards' tier; only ``'nvme'`` prefetches (host-tier pages are
            on the host already, device-tier shards have no host read).
        config: ``() -> ZeroConfig``, the config in effect (``prefetch_bucket_size``).
        local_replicas: the replicas whose pages this pool holds (they share its host
            tier).
    """

    def __init__(self, pool, tier: str, config: Callable, local_replicas) -> None:
        self.enabled = tier == "nvme"
        self.pool = pool
        self._config = config
        self._passes: dict[int, PassReads] = {}  # replica -> the pass being traced
        self._lock = threading.Lock()
        self.window_pages = 0
        if self.enabled:
            host = pool.usage()["host"].capacity_bytes or 0
            self.window_pages = host // pool.page_size // max(1, len(tuple(local_replicas)))

    def _bucket(self) -> int:
        return int(self._config().prefetch_bucket_size)

    def begin(self, replica: int) -> None:
        """Start recording a traced pass on ``replica`` (trace time)."""
        if self.enabled:
            with self._lock:
                self._passes[replica] = PassReads(self.pool, self._bucket, self.window_pages)

    def end(self, replica: int) -> PassReads | None:
        """End the replica's traced pass; returns its reads (None without prefetch)."""
        with self._lock:
            return self._passes.pop(replica, None)

    def read(self, replica: int, variables) -> Callable[[], None] | None:
        """Record a host read of ``variables``' shards on ``replica`` in the pass being
        traced (trace time); returns the hook its host call runs before reading, or None
        (not on NVMe, or outside a recorded pass)."""
        with self._lock:
            reads = self._passes.get(replica)
        if reads is None:
            return None
        ids = tuple(t for v in variables for t in v.page_ids(replica))
        return reads.add(ids, sum(v.shard_elements for v in variables))
