"""The paged buffer pool's placement hints and read-only views: mixins of
:class:`~zero_runtime.memory.pool.PagedBufferPool`, which provides the core (``_p``, a
:class:`~zero_runtime.memory.core.PoolCore`), ``_page_size``, ``closed`` and the checks
``_check_open``, ``_check_tier``, ``_entry``, ``_trace``. Every method takes the pool's
one lock (``_p.cond``), as the pool's own methods do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from zero_runtime.memory.counters import TierUsage
from zero_runtime.memory.page_table import TensorEntry
from zero_runtime.memory.placement import WAIT_SLICE_SECONDS
from zero_runtime.memory.reports import TensorInfo, describe, usage
from zero_runtime.memory.trace import StepTrace


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int when it is an integer (Python or numpy, not bool) >= ``minimum``.

    Raises:
        ValueError: otherwise, naming ``name``, the bound and the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class _PoolParts:
    """What the mixins read from the pool (declared for type checkers)."""

    _p: Any
    _page_size: int

    @property
    def closed(self) -> bool:  # the pool's
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    def _check_tier(self, tier: str, allowed: Sequence[str]) -> None:
        raise NotImplementedError

    def _entry(self, tensor_id: str) -> TensorEntry:
        raise NotImplementedError

    def _trace(self, *event: object) -> None:
        raise NotImplementedError


class PoolHints(_PoolParts):
    """Placement hints: prefetch, evict, pin/unpin, the step's access order, the device
    tier's budget, and waiting for the I/O they start."""

    def prefetch(self, tensor_ids: str | Iterable[str], tier: str = "host") -> None:
        """Schedule page-ins of tensors ahead of use; returns at once.

        A background thread moves the pages to ``tier`` without pinning them; a tensor
        acquired before the thread reaches the request was served by that acquire and is
        skipped (``memory.prefetch.PrefetchRequest``). It never
        evicts pinned pages or the tensors of this call, nor, when an access order is set,
        pages needed sooner than these tensors; when nothing can move it gives up
        quietly (``acquire`` then brings the rest).

        Args:
            tensor_ids: one id or several.
            tier: 'host' or 'device'.

        Raises:
            KeyError: an unknown tensor.
            ValueError: bad tier.
        """
        ids = (tensor_ids,) if isinstance(tensor_ids, str) else tuple(tensor_ids)
        with self._p.cond:
            self._check_open()
            self._check_tier(tier, ("host", "device"))
            for tid in ids:
                self._p.table.get(tid)
            self._p.prefetcher.submit(self._p.prefetcher.request(ids, tier))
            self._trace("P", ids, tier)

    def evict(self, tensor_ids: str | Iterable[str], to_tier: str = "nvme") -> None:
        """Move tensors' pages down to ``to_tier`` (pages already lower stay); waits.

        All the pages' I/O is issued before waiting, so evicting many tensors in one call
        keeps ``queue_depth`` writes in flight.

        Args:
            tensor_ids: one id or several.
            to_tier: 'host' or 'nvme'.

        Raises:
            KeyError: an unknown tensor.
            ValueError: bad tier, or a tensor is pinned or acquired.
            PoolOutOfMemoryError: ``to_tier`` is full and nothing can make room.
            NvmeFullError: the disk filled up; the page that failed stays on host.
        """
        ids = (tensor_ids,) if isinstance(tensor_ids, str) else tuple(tensor_ids)
        with self._p.cond:
            self._check_open()
            self._check_tier(to_tier, ("host", "nvme"))
            self._p.placement.evict([self._entry(tid) for tid in ids], to_tier)
            self._trace("E", ids, to_tier)

    def pin(self, tensor_id: str) -> None:
        """Keep a tensor's pages from being evicted until a matching :meth:`unpin`.

        Raises:
            KeyError: unknown tensor.
        """
        with self._p.cond:
            self._p.pin(self._entry(tensor_id))
            self._trace("N", tensor_id)

    def unpin(self, tensor_id: str) -> None:
        """Undo one :meth:`pin`.

        Raises:
            KeyError: unknown tensor.
            ValueError: the tensor is not pinned.
        """
        with self._p.cond:
            self._p.unpin(self._entry(tensor_id))
            self._trace("U", tensor_id)

    def set_access_order(self, tensor_ids: Sequence[str] | None) -> None:
        """Declare the order in which a step acquires tensors, for reuse-distance eviction.

        With an order, a full tier evicts first the pages of tensors absent from it, then
        the page whose tensor is next used furthest ahead (counting into the next step),
        ties broken by least recent use.
        The position advances with each ``acquire`` and restarts at ``step_boundary``.
        ``None`` or ``[]`` restores plain LRU.
        """
        with self._p.cond:
            self._p.policy.set_order(tensor_ids)
            self._trace("O", self._p.policy.order)

    def set_device_budget(self, capacity_bytes: int) -> int:
        """Change the device tier's capacity (e.g. a live ``device_budget_bytes`` change).

        Growing takes effect at once. Shrinking first moves the excess pages to the host
        by the eviction policy, counted as ``d2h`` moves and ``evictions``.

        Args:
            capacity_bytes: the new budget (bytes), rounded down to whole pages; >= one
                page (the tier cannot be disabled or enabled after construction).

        Returns:
            The number of pages moved down.

        Raises:
            ValueError: a budget below one page, or a pool built without a device tier.
            PoolOutOfMemoryError: shrinking needs more pages to move than are unpinned on
                the device (nothing is changed), or the host cannot take them.
        """
        ps = self._page_size
        new = check_int("capacity_bytes", capacity_bytes, ps) // ps
        with self._p.cond:
            self._check_open()
            self._check_tier("device", ("device",))
            moved = self._p.set_device_slots(new)
            self._trace("B", new)
            return moved

    def synchronize(self) -> None:
        """Wait until queued prefetches and all NVMe I/O have finished."""
        with self._p.cond:
            while not self.closed and (self._p.prefetcher.busy() or self._p.moves.io_busy()):
                self._p.cond.wait(WAIT_SLICE_SECONDS)


class PoolViews(_PoolParts):
    """Read-only views of the pool: per-tier usage, one tensor's pages, the tensor ids,
    and the access trace (:mod:`zero_runtime.memory.trace`)."""

    def usage(self) -> dict[str, TierUsage]:
        """Return each tier's use: ``{"device"|"host"|"nvme": TierUsage}`` (bytes).

        A disabled tier reports capacity 0; an unbounded NVMe tier capacity ``None``.
        """
        with self._p.cond:
            return usage(self._p.table, self._p.tiers, self._page_size)

    def describe(self, tensor_id: str) -> TensorInfo:
        """Return a tensor's metadata and where each of its pages is.

        Raises:
            KeyError: unknown tensor.
        """
        with self._p.cond:
            return describe(self._entry(tensor_id))

    def tensor_ids(self) -> list[str]:
        """Return the ids of the allocated tensors (allocation order)."""
        with self._p.cond:
            return [e.tensor_id for e in self._p.table.entries()]

    def take_trace_steps(self) -> list[StepTrace]:
        """The access trace's closed steps not taken yet (at most ``TRACE_STEPS``),
        oldest first (:mod:`zero_runtime.memory.trace`; the runtime writes them to the
        run's log directory)."""
        with self._p.cond:
            return self._p.trace.take_unwritten() if self._p.trace is not None else []

    @property
    def trace_steps(self) -> list[StepTrace]:
        """The access trace's last closed steps (a ring of ``TRACE_STEPS``), oldest first."""
        with self._p.cond:
            return list(self._p.trace.closed) if self._p.trace is not None else []

    def set_tracing(self, enabled: bool) -> None:
        """Turn the access trace on or off (off when the pool is made; the runtime turns
        it on for the first stage-3 engine's pool). Turned on, the open step's recording
        starts now, from a snapshot of the page table (call it between steps: then that
        is the step's start). Off, no event is kept and no step is closed (a step
        boundary costs nothing more than without a trace)."""
        with self._p.cond:
            trace = self._p.trace
            if trace is None:
                return
            if enabled and not trace.enabled:
                trace.begin(self._p.capture())
            trace.enabled = bool(enabled)
