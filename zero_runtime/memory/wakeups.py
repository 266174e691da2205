"""The pool's lock and condition variable, with targeted wake-ups for NVMe completions.

Every pool method holds one lock and waits on one condition (:mod:`.pool`). A plain
``notify_all`` after each finished NVMe job would wake every waiter for every page: on the
1B-parameter stage-3 step (~44,000 jobs) the prefetcher and the optimizer's update threads
then wake thousands of times each to find nothing to do, about a fifth of the step's CPU
time (``bench/profile_step.py``, docs/stages/tiling.md). A waiter in the placement loop
says what it waits for (:meth:`PoolCondition.wait_io`): its pages, and whether it
waits for room in a tier. A finished job (:meth:`PoolCondition.notify_io`) wakes only the
waiters for its page, and those waiting for room when the job gave some: a finished write
frees a host slot; a finished read gives a page that can be a victim again, which matters
only to a waiter that found too few victims, as does a release or an unpin
(:meth:`PoolCondition.notify_victims`; the executors release a shard ~43,000 times per
1B step). A prefetch request, the prefetcher going idle and a starved caller leaving
wake only the plain waiters (:meth:`PoolCondition.notify_plain`: the prefetch thread,
``synchronize``). Everything else that changes the pool (free, fork, close, a resize)
still wakes every waiter, and every wait still ends after its timeout, so a missed
wake-up costs latency, never a hang.

Several conditions over one lock, each notified for its own event, is how TensorFlow's
``ClusterCoordinator`` closure queue waits (``_queue_lock`` with
``_closures_queued_condition``, ``_queue_free_slot_condition``, ...,
tensorflow/python/distribute/coordinator/cluster_coordinator.py); here the events are
per waiter, keyed by page.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from zero_runtime.memory.page_table import PageRecord


class _Waiter:
    """One thread's targeted wait: a condition on the pool's lock and what wakes it."""

    __slots__ = ("cond", "pages", "room", "victims")

    def __init__(self, cond: threading.Condition) -> None:
        self.cond = cond
        self.pages: set[int] = set()  # id() of the PageRecords waited for
        self.room = False  # woken when a finished write frees a host slot
        self.victims = False  # ... and when a finished read gives a possible victim


class PoolCondition(threading.Condition):
    """A ``threading.Condition`` over a ``threading.Lock`` whose NVMe completions wake
    only the waiters they concern.

    ``wait`` / ``notify`` / ``notify_all`` behave as ``threading.Condition``'s, except that
    ``notify_all`` also wakes the targeted waiters. Targeted waits share the lock (one
    ``threading.Condition`` per thread over it, made once), so holding ``with cond:`` is
    all the locking there is. Not for a simulation (``SimCondition`` has the same methods).
    """

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self._targeted: list[_Waiter] = []
        self._mine = threading.local()
        self.targeted_wakeups = 0  # wake-ups notify_io sent (a figure for the profiler)

    def wait_io(
        self,
        pages: Iterable[PageRecord],
        timeout: float,
        *,
        room: bool = False,
        victims: bool = False,
    ) -> bool:
        """Wait (lock held, released meanwhile) until an NVMe job of one of ``pages``
        finishes, a write frees a host slot (``room``), a read gives a possible victim
        (``victims``), anything else calls :meth:`notify_all`, or ``timeout`` seconds
        pass. Returns False on timeout, as ``threading.Condition.wait``.

        Raises:
            RuntimeError: the lock is not held (as ``threading.Condition.wait``).
        """
        waiter = getattr(self._mine, "waiter", None)
        if waiter is None:
            waiter = _Waiter(threading.Condition(self._lock))
            self._mine.waiter = waiter
        waiter.pages = {id(p) for p in pages}
        waiter.room = room
        waiter.victims = victims
        self._targeted.append(waiter)
        try:
            return waiter.cond.wait(timeout)
        finally:
            self._targeted.remove(waiter)

    def notify_io(self, page: PageRecord, freed: bool, idle: bool) -> None:
        """Wake the waiters an NVMe job on ``page`` concerns (lock held): those waiting
        for ``page``; when the job ``freed`` a host slot (a write, or a failed read) those
        waiting for room; else (a read) those short of victims. With ``idle`` (no job
        left) wake everybody: ``synchronize`` and ``shutdown`` wait for that.

        Raises:
            RuntimeError: the lock is not held.
        """
        if idle:
            self.notify_all()
            return
        key = id(page)
        for waiter in self._targeted:
            if key in waiter.pages or (waiter.room if freed else waiter.victims):
                waiter.cond.notify()
                self.targeted_wakeups += 1

    def notify_victims(self) -> None:
        """Wake the waiters short of victims (lock held): a release or an unpin made a
        tensor's pages movable. Nobody else waits for that: plain waiters wait for the
        prefetch queue, the I/O going idle or a broadcast.

        Raises:
            RuntimeError: the lock is not held.
        """
        for waiter in self._targeted:
            if waiter.victims:
                waiter.cond.notify()
                self.targeted_wakeups += 1

    def notify_plain(self) -> None:
        """Wake the plain waiters only (lock held): the prefetch thread waiting for a
        request or for a starved caller to leave, ``synchronize`` waiting for the
        prefetcher to go idle. A placement in progress does not wait for those.

        Raises:
            RuntimeError: the lock is not held.
        """
        super().notify_all()

    def notify_all(self) -> None:
        """Wake every waiter, plain and targeted (lock held).

        Raises:
            RuntimeError: the lock is not held.
        """
        super().notify_all()
        for waiter in self._targeted:
            waiter.cond.notify()
