"""The pool's core: its parts wired together, and every operation's policy path.

:class:`PoolCore` holds the parts (page table, eviction policy, transitions, placement,
prefetcher, page access; one owner each, see ``docs/design/paging.md``) over one lock and one
counter accumulator, and implements each operation's decisions: what is checked, which
pages are brought where, what is pinned, what the policy is told. The
:class:`~zero_runtime.memory.pool.PagedBufferPool` façade calls these methods with real
tiers and bytes; the what-if simulator (:mod:`zero_runtime.memory.simulate`) calls the
very same methods over tiers that only count slots (``access`` None: no bytes are
copied), so a replay takes exactly the decisions the pool takes.

Every method is called with the lock (``cond``) held.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from zero_runtime.memory.access import PageAccess
from zero_runtime.memory.counters import CounterAccumulator, PageCounters
from zero_runtime.memory.errors import OomSnapshot
from zero_runtime.memory.page_table import PageState as S
from zero_runtime.memory.page_table import PageTable, TensorEntry
from zero_runtime.memory.placement import WAIT_SLICE_SECONDS, Placement
from zero_runtime.memory.policy import EvictionPolicy
from zero_runtime.memory.prefetch import Prefetcher
from zero_runtime.memory.reports import oom_snapshot
from zero_runtime.memory.tiers import DeviceTier, HostTier, NvmeTier, SlotTier
from zero_runtime.memory.trace import AccessTrace, capture
from zero_runtime.memory.transitions import SnapshotFn, TierTransitions
from zero_runtime.memory.wakeups import PoolCondition

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class PoolCore:
    """The pool's parts, each the one owner of its concern, wired to one lock (``cond``)
    and one counter accumulator, and the operations over them.

    Attributes:
        access: bytes in and out of pages; None in a simulation (nothing is copied).
        trace: the access trace the façade appends to; None in a simulation.
        outside_device: ``{"gathered_bytes", "reserved_bytes"}`` of the device tier held
            outside the pool (a stage-3 step's gathered units; the budget's share kept
            for them and frozen weights), as its owner last reported them at a step
            boundary; empty when the owner reports none. Traced with each step, so a
            replay predicts the whole device tier.
    """

    cond: PoolCondition
    counters: CounterAccumulator
    tiers: dict[str, SlotTier]
    nvme: NvmeTier | None
    table: PageTable
    policy: EvictionPolicy
    moves: TierTransitions
    placement: Placement
    access: PageAccess | None
    prefetcher: Prefetcher
    snapshot: SnapshotFn  # (nbytes, tensor_id, tier, reason) -> OomSnapshot
    trace: AccessTrace | None = None
    outside_device: dict = dataclasses.field(default_factory=dict)

    @property
    def device(self) -> DeviceTier:
        """The device tier."""
        return self.tiers["device"]  # type: ignore[return-value]

    @property
    def host(self) -> HostTier:
        """The host tier."""
        return self.tiers["host"]  # type: ignore[return-value]

    @classmethod
    def assemble(
        cls,
        tiers: dict[str, SlotTier],
        nvme: NvmeTier | None,
        cond: PoolCondition,
        check_open: Callable[[], None],
        closed: Callable[[], bool],
        *,
        copies_bytes: bool = True,
        traced: bool = True,
    ) -> PoolCore:
        """Wire the parts over ``tiers``.

        Args:
            tiers: ``{"device", "host", "nvme"}`` -> tier (a 0-slot NVMe stand-in without
                an NVMe tier).
            nvme: the NVMe tier (its I/O is attached by the caller), or None.
            cond: the lock and condition every part waits on.
            check_open: raises ``PoolClosedError`` once the pool is closed.
            closed: True once the pool is closing.
            copies_bytes: False for a simulation: no :class:`PageAccess`.
            traced: keep an :class:`AccessTrace` (False for a simulation).
        """
        counters = CounterAccumulator()
        table = PageTable(tiers, counters)
        policy = EvictionPolicy()
        ps = tiers["host"].page_size

        def snapshot(nbytes: int, tensor_id: str, tier: str, reason: str) -> OomSnapshot:
            return oom_snapshot(table, tiers, ps, (nbytes, tensor_id, tier), reason)

        moves = TierTransitions(table, tiers, nvme, counters, cond, snapshot)
        placement = Placement(
            table, tiers, nvme is not None, moves, policy, cond, check_open, snapshot, counters
        )
        access = (
            PageAccess(table, tiers["device"], tiers["host"], moves)  # type: ignore[arg-type]
            if copies_bytes
            else None
        )
        trace = AccessTrace(ps, nvme is not None) if traced else None
        on_run = None if trace is None else (lambda ids, tier: trace.add("X", ids, tier))
        prefetcher = Prefetcher(table, placement, policy, cond, closed, on_run)
        core = cls(
            cond, counters, tiers, nvme, table, policy, moves, placement, access, prefetcher,
            snapshot, trace,
        )  # fmt: skip
        if trace is not None:
            trace.begin(core.capture())
        return core

    def capture(self) -> dict:
        """The page table's state now (:func:`zero_runtime.memory.trace.capture`)."""
        return capture(self.table, self.policy, self.tiers)

    # --- operations (lock held) -----------------------------------------------------------
    def allocate(self, entry: TensorEntry, tier: str) -> None:
        """Register ``entry`` and place its pages on ``tier`` (zero-filled), making room.

        Raises:
            ValueError: duplicate id.
            PoolOutOfMemoryError: the pages cannot be placed (nothing is allocated).
        """
        self.table.add(entry)
        try:
            self.placement.check_fits(entry, tier)
            self.placement.settle(entry.pages, tier, {entry.tensor_id}, advisory=False)
        except BaseException:
            self.moves.free(entry)
            self.cond.notify_all()  # its slots are free again
            raise
        self.touch(entry)

    def fork(self, source: TensorEntry, entry: TensorEntry) -> bool:
        """Register ``entry`` (same pages as ``source``) holding ``source``'s bytes: the
        host copies of ``source``'s pages, brought to the host first (a read of what is
        on NVMe only, waited for as by an acquire), are handed over to ``entry``
        (:meth:`TierTransitions.hand_over`) and ``source`` keeps its NVMe copies.

        Returns:
            True when forked; False, with nothing changed (``entry`` not registered),
            when a page of ``source`` has no current NVMe copy (written on the host since
            it was read: a fork would need a write) or ``source`` is acquired.

        Raises:
            ValueError: duplicate id, or the two differ in page count.
            PoolOutOfMemoryError: ``source`` cannot be brought to the host.
        """
        if len(entry.pages) != len(source.pages):
            raise ValueError(
                f"fork {source.tensor_id!r} -> {entry.tensor_id!r}: {len(source.pages)} "
                f"pages vs {len(entry.pages)}"
            )
        if source.acquire_count:
            return False
        self.placement.check_fits(source, "host")
        PageAccess.count_acquire(source, "host")
        self.table.note_pins(source)
        try:
            self.placement.bring(source, "host")
        finally:
            PageAccess.drop_acquire(source)
            self._note_unpin(source)
        if any(p.state is not S.ON_HOST_CLEAN for p in source.pages):
            return False
        self.table.add(entry)
        for page, new in zip(source.pages, entry.pages):
            self.moves.hand_over(page, new)
        self.touch(entry)
        self.cond.notify_all()
        return True

    def free(self, entry: TensorEntry) -> None:
        """Free ``entry``'s pages (waiting for its I/O in flight).

        Raises:
            ValueError: the tensor is pinned or acquired.
        """
        if entry.pinned:
            raise ValueError(
                f"tensor {entry.tensor_id!r} is pinned ({entry.pin_count}) or acquired "
                f"({entry.acquire_count}); unpin/release it before free"
            )
        self.placement.wait_settled(entry)
        self.moves.free(entry)
        self.cond.notify_all()

    def use(self, entry: TensorEntry, copy: Callable[[], object] | None = None) -> object:
        """A read or write where the pages are: wait until none is in flight, run ``copy``
        (the bytes, None in a simulation), stamp the pages used. Returns ``copy()``."""
        self.placement.wait_settled(entry)
        result = copy() if copy is not None else None
        self.touch(entry)
        return result

    def touch(self, entry: TensorEntry) -> None:
        """Stamp each of ``entry``'s pages as used now (LRU order)."""
        for page in entry.pages:
            self.table.touch(page)

    def acquire(
        self, entry: TensorEntry, tier: str, writable: bool, as_pages: bool = False
    ) -> object:
        """Bring ``entry``'s pages to ``tier`` and pin them (counted as prefetch hits or
        misses, waits as stall); the policy advances past the tensor. Returns the
        materialised tensor, or with ``as_pages`` its pages' host views (None in a
        simulation).

        Raises:
            ValueError: ``writable`` on the device, acquired on the other tier, or
                acquired the other way (array / page views).
            PoolOutOfMemoryError: the tensor cannot be placed on ``tier``.
        """
        PageAccess.check_acquire(entry, tier, writable, as_pages)
        self.placement.check_fits(entry, tier)
        PageAccess.count_acquire(entry, tier, as_pages)
        self.table.note_pins(entry)
        try:
            self.placement.bring(entry, tier)
            if self.access is None:
                result = None
            elif as_pages:
                result = self.access.page_views(entry, writable)
            else:
                result = self.access.materialise(entry, tier, writable)
        except BaseException:
            PageAccess.drop_acquire(entry)
            self._note_unpin(entry)
            raise
        if writable:  # the array may be written: clean pages' NVMe copies go stale
            for page in entry.pages:
                self.moves.dirty(page)
        entry.acquisitions += 1  # serves the prefetch requests queued before it
        self.policy.advance(entry.tensor_id)
        self.touch(entry)
        return result

    def release(self, entry: TensorEntry) -> None:
        """Undo one acquire; at the last, write back a writable copy and unpin.

        Raises:
            ValueError: the tensor is not acquired.
        """
        if entry.acquire_count == 0:
            raise ValueError(f"tensor {entry.tensor_id!r} is not acquired")
        if (
            self.access is not None
            and entry.acquire_count == 1
            and entry.writable
            and len(entry.pages) > 1
        ):
            self.access.write_back(entry)
        PageAccess.drop_acquire(entry)
        self._note_unpin(entry)

    def _note_unpin(self, entry: TensorEntry) -> None:
        """Record ``entry``'s pins after one was dropped; once none is left its pages
        can be victims, which wakes the waiters short of victims."""
        self.table.note_pins(entry)
        if not entry.pinned:
            self.cond.notify_victims()

    def pin(self, entry: TensorEntry) -> None:
        """Keep ``entry``'s pages from being evicted until a matching :meth:`unpin`."""
        entry.pin_count += 1
        self.table.note_pins(entry)

    def unpin(self, entry: TensorEntry) -> None:
        """Undo one :meth:`pin`.

        Raises:
            ValueError: the tensor is not pinned.
        """
        if entry.pin_count == 0:
            raise ValueError(f"tensor {entry.tensor_id!r} is not pinned")
        entry.pin_count -= 1
        self._note_unpin(entry)

    def figures(self) -> dict[str, dict[str, int]]:
        """``{"peak_bytes", "used_bytes"}``, each ``{"device"|"host"|"nvme": bytes}``: the
        tiers' peak since the step began and their use now (whole pages)."""
        ps = self.tiers["host"].page_size
        return {
            "peak_bytes": {n: t.peak * ps for n, t in self.tiers.items()},
            "used_bytes": {n: t.used * ps for n, t in self.tiers.items()},
        }

    def set_device_slots(self, slots: int) -> int:
        """Resize the device tier to ``slots`` pages, moving the excess down first.
        Returns the pages moved (see ``Placement.shrink_device``)."""
        moved = self.placement.shrink_device(slots)
        self.cond.notify_all()
        return moved

    def close_step(self, step: int) -> PageCounters:
        """The step's counters, zeroed after; peaks and the access order restart; pages
        used afterwards are stamped ``step + 1``; the trace closes the step."""
        snapshot = self.counters.snapshot()
        traced = self.trace is not None and self.trace.enabled
        if traced:
            measured = {**dataclasses.asdict(snapshot), **self.figures()}
            if self.outside_device:
                measured["outside_device"] = dict(self.outside_device)
        self.counters.reset()
        for tier in self.tiers.values():
            tier.reset_peak()
        self.table.step = int(step) + 1
        self.policy.restart()
        if traced:
            self.trace.close(step, measured, self.capture())
        return snapshot

    # --- life ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the prefetcher, wait for outstanding I/O, stop the I/O threads (the pool
        is CLOSING; called without the lock)."""
        self.prefetcher.stop()
        with self.cond:
            while self.moves.io_busy():
                self.cond.wait(WAIT_SLICE_SECONDS)
        if self.moves.io is not None:
            self.moves.io.shutdown()

    def release_all(self) -> None:
        """Free every page, drop the device pages, unmap the host memory and the staging
        buffer (lock held; after :meth:`shutdown`)."""
        for entry in self.table.entries():
            self.moves.free(entry)
        self.device.close()
        self.host.close()
        self.moves.close()
