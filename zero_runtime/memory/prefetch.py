"""The prefetcher: one background thread that brings tensors' pages up ahead of use.

``PagedBufferPool.prefetch`` queues ``(tensor ids, tier)``; the thread runs the same
placement loop as ``acquire`` (:meth:`Placement.settle
<zero_runtime.memory.placement.Placement.settle>`) in advisory mode: it never pins, never
evicts pinned pages or the tensors it brings in, nor (with an access order) pages needed
sooner than them; it steps aside while a blocking caller is short of slots (``starved``)
and resumes the interrupted request afterwards; it never raises.

States (:class:`PrefetcherState`), one transition per method: IDLE (no thread yet) ->
RUNNING (:meth:`Prefetcher.submit` started the thread) -> STOPPED (:meth:`Prefetcher.stop`
joined it; from IDLE too).
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
from collections.abc import Callable

from zero_runtime.memory.errors import PoolClosedError
from zero_runtime.memory.page_table import PageTable
from zero_runtime.memory.placement import WAIT_SLICE_SECONDS, Placement
from zero_runtime.memory.policy import EvictionPolicy

logger = logging.getLogger(__name__)


class PrefetcherState(enum.Enum):
    """IDLE: no thread, nothing queued yet. RUNNING: the thread serves the queue.
    STOPPED: terminal; the thread has ended (the pool closed)."""

    IDLE = "idle"
    RUNNING = "running"
    STOPPED = "stopped"


class Prefetcher:
    """Owner of the prefetch queue and its thread.

    Args:
        table: the page table (requests name tensors in it).
        placement: the placement loop it runs (advisory).
        policy: the eviction policy (reuse distances limit what a prefetch may evict).
        cond: the pool's condition variable; every method but :meth:`stop` is called
            with its lock held.
        closed: True once the pool is closing (the thread then ends).
        on_run: called with ``(ids, tier)`` when the thread starts placing a request
            (the access trace's ``X`` event); None for none.
    """

    def __init__(
        self,
        table: PageTable,
        placement: Placement,
        policy: EvictionPolicy,
        cond: threading.Condition,
        closed: Callable[[], bool],
        on_run: Callable[[tuple[str, ...], str], None] | None = None,
    ) -> None:
        self._table = table
        self._on_run = on_run
        self._placement = placement
        self._policy = policy
        self._cond = cond
        self._closed = closed
        self._queue: collections.deque[tuple[tuple[str, ...], str]] = collections.deque()
        self._working = False  # a request is being placed now
        self._thread: threading.Thread | None = None
        self.state = PrefetcherState.IDLE

    def busy(self) -> bool:
        """True while a request is queued or being placed (lock held)."""
        return bool(self._queue) or self._working

    def submit(self, ids: tuple[str, ...], tier: str) -> None:
        """Queue a request (lock held); IDLE -> RUNNING on the first one."""
        self._queue.append((ids, tier))
        if self.state is PrefetcherState.IDLE:
            self._start()
        self._cond.notify_all()

    def _start(self) -> None:
        assert self.state is PrefetcherState.IDLE, self.state
        self._thread = threading.Thread(target=self._loop, name="zr-prefetch", daemon=True)
        self._thread.start()
        self.state = PrefetcherState.RUNNING

    def stop(self) -> None:
        """-> STOPPED: join the thread (lock *not* held; the pool is already closing,
        so the loop ends at its next wake-up). Idempotent."""
        if self.state is PrefetcherState.STOPPED:
            return
        if self._thread is not None:
            self._thread.join()
        self.state = PrefetcherState.STOPPED

    def place(self, ids: tuple[str, ...], tier: str) -> bool:
        """Place one request's pages on ``tier``, advisory (lock held): tensors freed
        meanwhile are skipped; with an access order, only pages used later than the
        furthest of ``ids`` may be evicted. Returns True when every page is placed.
        Never raises but ``PoolClosedError`` (a failure is logged and counts as done).

        The prefetch thread runs it; so does the what-if simulator
        (:mod:`zero_runtime.memory.simulate`) at the points the thread ran.
        """
        ids = tuple(t for t in ids if t in self._table)
        pages = [p for t in ids for p in self._table.get(t).pages]
        limit = None
        if self._policy.ordered and ids:
            limit = max(self._policy.distance(t) for t in ids)
        try:
            return self._placement.settle(pages, tier, set(ids), advisory=True, limit=limit)
        except PoolClosedError:
            raise
        except Exception as exc:  # noqa: BLE001 - prefetch is advisory
            logger.warning("prefetch of %s failed: %s", ids, exc)
            return True

    def _loop(self) -> None:
        with self._cond:
            while not self._closed():
                if not self._queue or self._placement.starved:
                    self._working = False
                    self._cond.notify_all()
                    self._cond.wait(WAIT_SLICE_SECONDS)
                    continue
                ids, tier = self._queue.popleft()
                self._working = True
                if self._on_run is not None:
                    self._on_run(ids, tier)
                try:
                    done = self.place(ids, tier)
                except PoolClosedError:
                    break
                if not done and self._placement.starved and not self._closed():
                    self._queue.appendleft((ids, tier))  # resume after the caller
            self._working = False
            self._cond.notify_all()
