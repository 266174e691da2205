"""The prefetcher: one background thread that brings tensors' pages up ahead of use.

``PagedBufferPool.prefetch`` queues ``(tensor ids, tier)``; the thread runs the same
placement loop as ``acquire`` (:meth:`Placement.settle
<zero_runtime.memory.placement.Placement.settle>`) in advisory mode: it never pins, never
evicts pinned pages or the tensors it brings in, nor (with an access order) pages needed
sooner than them; it steps aside while a blocking caller is short of slots (``starved``)
and resumes the interrupted request afterwards; it never raises.

A request is for the next use of its tensors: a tensor acquired after the request was
queued and before the thread reached it was served by that acquire, and the thread skips
it (:class:`PrefetchRequest`). Without that rule a thread that runs late (a loaded CPU)
reads back a tensor that was used and written behind to NVMe meanwhile, and the
write-behind then writes it again.

States (:class:`PrefetcherState`), one transition per method: IDLE (no thread yet) ->
RUNNING (:meth:`Prefetcher.submit` started the thread) -> STOPPED (:meth:`Prefetcher.stop`
joined it; from IDLE too).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading
from collections.abc import Callable

from zero_runtime.memory.errors import PoolClosedError
from zero_runtime.memory.page_table import PageTable
from zero_runtime.memory.placement import WAIT_SLICE_SECONDS, Placement
from zero_runtime.memory.policy import EvictionPolicy
from zero_runtime.memory.wakeups import PoolCondition

logger = logging.getLogger(__name__)


class PrefetcherState(enum.Enum):
    """IDLE: no thread, nothing queued yet. RUNNING: the thread serves the queue.
    STOPPED: terminal; the thread has ended (the pool closed)."""

    IDLE = "idle"
    RUNNING = "running"
    STOPPED = "stopped"


@dataclasses.dataclass(frozen=True)
class PrefetchRequest:
    """One queued prefetch: tensors to bring to a tier before their next use.

    Attributes:
        ids: the tensor ids, in the caller's order.
        tier: 'host' or 'device'.
        seen: each tensor's ``TensorEntry.acquisitions`` when the request was queued; a
            tensor acquired since then was served by that acquire and is skipped.
    """

    ids: tuple[str, ...]
    tier: str
    seen: tuple[int, ...]

    def pending(self, table: PageTable) -> tuple[str, ...]:
        """The ids still to bring: allocated, and not acquired since the request."""
        return tuple(
            t
            for t, n in zip(self.ids, self.seen, strict=True)
            if t in table and table.get(t).acquisitions == n
        )


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
        cond: PoolCondition,
        closed: Callable[[], bool],
        on_run: Callable[[tuple[str, ...], str], None] | None = None,
    ) -> None:
        self._table = table
        self._on_run = on_run
        self._placement = placement
        self._policy = policy
        self._cond = cond
        self._closed = closed
        self._queue: collections.deque[PrefetchRequest] = collections.deque()
        self._working = False  # a request is being placed now
        self._thread: threading.Thread | None = None
        self.state = PrefetcherState.IDLE

    def busy(self) -> bool:
        """True while a request is queued or being placed (lock held)."""
        return bool(self._queue) or self._working

    def request(self, ids: tuple[str, ...], tier: str) -> PrefetchRequest:
        """A request for ``ids`` as of now (lock held). A tensor not allocated yet counts
        as never acquired (the what-if simulator re-derives requests that may name one)."""
        table = self._table
        seen = tuple(table.get(t).acquisitions if t in table else 0 for t in ids)
        return PrefetchRequest(ids, tier, seen)

    def submit(self, request: PrefetchRequest) -> None:
        """Queue a request (lock held); IDLE -> RUNNING on the first one."""
        self._queue.append(request)
        if self.state is PrefetcherState.IDLE:
            self._start()
        self._cond.notify_plain()  # the prefetch thread; placements do not wait for this

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

    def place(self, request: PrefetchRequest) -> bool:
        """Place one request's pages on its tier, advisory (lock held): tensors freed or
        acquired meanwhile are skipped (:meth:`PrefetchRequest.pending`); with an access
        order, only pages used later than the furthest of its tensors may be evicted.
        Returns True when every page is placed. Never raises but ``PoolClosedError`` (a
        failure is logged and counts as done).

        The prefetch thread runs it; so does the what-if simulator
        (:mod:`zero_runtime.memory.simulate`) at the points the thread ran.
        """
        ids, tier = request.pending(self._table), request.tier
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
                    self._cond.notify_plain()  # synchronize() waits for an idle prefetcher
                    self._cond.wait(WAIT_SLICE_SECONDS)
                    continue
                request = self._queue.popleft()
                self._working = True
                if self._on_run is not None:
                    self._on_run(request.ids, request.tier)
                try:
                    done = self.place(request)
                except PoolClosedError:
                    break
                if not done and self._placement.starved and not self._closed():
                    self._queue.appendleft(request)  # resume after the caller
            self._working = False
            self._cond.notify_all()
