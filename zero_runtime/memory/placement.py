"""Placement: bringing pages to a target tier, making room by moving victims down.

Terms in :mod:`.page_table`. :meth:`Placement.settle` is the one placement loop behind
the pool's ``allocate``, ``acquire``, ``evict``, ``prefetch`` and ``set_device_budget``:
it moves each page one hop at a time toward its target (NVMe <-> host <-> device) through
:class:`~zero_runtime.memory.transitions.TierTransitions`; when the next tier has no
free slot, it moves *victims* (unpinned pages of other tensors, ranked by
:class:`~zero_runtime.memory.policy.EvictionPolicy`) one tier down. When nothing can move
and no I/O is pending, a blocking caller gets ``PoolOutOfMemoryError`` with a snapshot
(:func:`~zero_runtime.memory.reports.oom_snapshot`).

Called under the pool's lock; it waits only on the pool's condition variable, so I/O
threads can record completions meanwhile. A blocking caller short of slots counts itself
in :attr:`Placement.starved`, which makes the prefetcher step aside.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from zero_runtime.memory.counters import CounterAccumulator
from zero_runtime.memory.errors import PoolOutOfMemoryError
from zero_runtime.memory.io import IoJob
from zero_runtime.memory.page_table import (
    HOLDS,
    IN_FLIGHT,
    LEVEL,
    RESIDENT_STATES,
    TIER_ORDER,
    PageRecord,
    PageState,
    PageTable,
    TensorEntry,
)
from zero_runtime.memory.policy import EvictionPolicy
from zero_runtime.memory.tiers import SlotTier
from zero_runtime.memory.transitions import SnapshotFn, TierTransitions
from zero_runtime.memory.wakeups import PoolCondition

S = PageState

WAIT_SLICE_SECONDS = 0.25  # seconds; waits re-check their condition at least this often
# A blocking placement gives up (PoolOutOfMemoryError) when its own pages keep being
# pushed back down (thrashing): more than THRASH_HOPS_PER_PAGE hops per page it places
# (a page needs at most 2: NVMe -> host -> device) plus THRASH_SLACK_HOPS.
THRASH_HOPS_PER_PAGE = 4
THRASH_SLACK_HOPS = 16
# ... or when it has waited this long in all without a page of its own moving.
STUCK_SECONDS = 300.0


class Placement:
    """Owner of where pages go: the placement loop, victim choice and OOM decisions.

    Args:
        table: the page table.
        tiers: tier name -> tier.
        has_nvme: whether the pool has an NVMe tier (the host tier's pages can go down).
        transitions: the owner of page moves.
        policy: the eviction policy (victim ranking).
        cond: the pool's condition variable (its lock held by every caller).
        check_open: raises ``PoolClosedError`` once the pool is closed.
        snapshot: builds an OOM snapshot ``(nbytes, tensor_id, tier, reason)``.
        counters: where acquires count prefetch hits/misses and stalls, and a device
            shrink its evictions.

    Attributes:
        starved: blocking callers now waiting for slots (the prefetcher yields while > 0).
    """

    def __init__(
        self,
        table: PageTable,
        tiers: dict[str, SlotTier],
        has_nvme: bool,
        transitions: TierTransitions,
        policy: EvictionPolicy,
        cond: PoolCondition,
        check_open: Callable[[], None],
        snapshot: SnapshotFn,
        counters: CounterAccumulator,
    ) -> None:
        self._table = table
        self._tiers = tiers
        self._has_nvme = has_nvme
        self._moves = transitions
        self._policy = policy
        self._cond = cond
        self._check_open = check_open
        self._snapshot = snapshot
        self._counters = counters
        self._page_size = tiers["host"].page_size
        self.starved = 0

    # --- the loop -------------------------------------------------------------------------
    def settle(
        self,
        pages: list[PageRecord],
        target: str,
        exclude: set[str],
        *,
        advisory: bool,
        down_only: bool = False,
        limit: float | None = None,
    ) -> bool:
        """Move ``pages`` to ``target`` hop by hop, making room as needed.

        Waits on the condition. Pages of ``exclude`` tensors are never chosen as
        victims; with ``limit``, only pages whose next use is further than ``limit``
        are. Returns True when done. Advisory callers (prefetch) count a page read
        already on its way to the host as done, and get False instead of an error when
        stuck, when a job failed, or when a blocking caller is starved.

        A blocking call is bounded: it raises instead of waiting forever when its own pages
        are moved back down by other callers again and again (more than
        ``THRASH_HOPS_PER_PAGE`` hops per page plus ``THRASH_SLACK_HOPS``: two acquires
        evicting each other's pages under a tight budget), or when none of its pages has
        moved for ``STUCK_SECONDS`` (300 s) while I/O is pending.

        Raises:
            PoolOutOfMemoryError: (blocking callers) nothing can make room, or the
                placement thrashes or makes no progress (the reason says which).
            PagingError: (blocking callers) an NVMe job of this call failed.
            KeyError: a page's tensor was freed meanwhile.
            PoolClosedError: the pool closed meanwhile.
        """
        pages = list({id(p): p for p in pages}.values())  # a tensor may be listed twice
        jobs: list[IoJob] = []
        starving = False
        own_hops = 0
        max_hops = THRASH_HOPS_PER_PAGE * len(pages) + THRASH_SLACK_HOPS
        last_progress = time.monotonic()
        try:
            while True:
                self._check_open()
                for job in jobs:
                    if job.done and job.error is not None:
                        if advisory:
                            return False
                        raise job.error
                if advisory and self.starved:
                    return False
                todo = []
                for p in pages:
                    if p.state is S.FREED:
                        if advisory:
                            return False
                        raise KeyError(f"tensor {p.tensor_id!r} was freed while being placed")
                    issued = advisory and target == "host" and p.state is S.IN_FLIGHT_IN
                    if not (issued or _placed(p, target, down_only)):
                        todo.append(p)
                if not todo:
                    return True
                acted = False
                lacking: dict[str, list[PageRecord]] = {name: [] for name in TIER_ORDER}
                for p in todo:
                    if p.state in IN_FLIGHT:
                        continue
                    dst = _next_hop(p, target)
                    if p.state is S.ON_HOST_CLEAN and dst == "nvme":
                        self._moves.drop_clean(p, evicting=False)  # no write, no new slot
                        acted = True
                        last_progress = time.monotonic()
                        continue
                    tier = self._tiers[dst]
                    if tier.has_free():
                        self._moves.hop(p, dst, tier.take(), jobs, evicting=False)
                        acted = True
                        own_hops += 1
                        last_progress = time.monotonic()
                    else:
                        lacking[dst].append(p)
                if not advisory and starving != any(lacking.values()):
                    starving = not starving
                    self.starved += 1 if starving else -1
                    if not starving:
                        self._cond.notify_plain()  # the prefetch thread may go on
                if not advisory and own_hops > max_hops:
                    raise self.out_of_memory(
                        pages,
                        target,
                        lacking,
                        exclude,
                        reason=(
                            f"placement thrashes: {own_hops} page moves for {len(pages)} "
                            f"pages bound for the {target} tier (at most {max_hops}); other "
                            "callers keep evicting them, so the tiers are too small for the "
                            "pages in use at once"
                        ),
                    )
                short = False
                if any(lacking.values()):
                    made, short = self._make_room(lacking, exclude, jobs, limit)
                    acted = made or acted
                if acted:
                    continue
                if not self._moves.io_busy():
                    if advisory:
                        return False
                    raise self.out_of_memory(pages, target, lacking, exclude)
                if not advisory and time.monotonic() - last_progress > STUCK_SECONDS:
                    raise self.out_of_memory(
                        pages,
                        target,
                        lacking,
                        exclude,
                        reason=(
                            f"placement made no progress for {STUCK_SECONDS:.0f} s: none of "
                            f"{len(todo)} pages bound for the {target} tier could move while "
                            "other I/O kept the pool busy"
                        ),
                    )
                jobs = [job for job in jobs if not job.done]  # done ones checked above
                self._cond.wait_io(
                    todo + [job.page for job in jobs],
                    WAIT_SLICE_SECONDS,
                    room=any(lacking.values()),
                    victims=short,
                )
        finally:
            if starving:
                self.starved -= 1
                self._cond.notify_plain()  # the prefetch thread steps aside while starved

    def bring(self, entry: TensorEntry, tier: str) -> None:
        """Settle ``entry``'s pages on ``tier`` for an acquire (the caller pinned it).

        Each page counts as a prefetch hit (already on ``tier``, or being read to the
        host) or a miss (brought by this call); the time waited counts as stall seconds.

        Raises:
            as :meth:`settle` (blocking).
        """
        start = time.perf_counter()
        hits = sum(
            1
            for p in entry.pages
            if _resident(p, tier) or (tier == "host" and p.state is S.IN_FLIGHT_IN)
        )
        waited = not all(_resident(p, tier) for p in entry.pages)
        self.settle(entry.pages, tier, {entry.tensor_id}, advisory=False)
        self._counters.add("prefetch_hits", hits)
        self._counters.add("prefetch_misses", len(entry.pages) - hits)
        if waited:
            self._counters.add("stall_seconds", time.perf_counter() - start)

    def shrink_device(self, new: int) -> int:
        """Set the device tier to ``new`` page slots, first moving the excess pages to the
        host by the eviction policy (counted as evictions). Returns the pages moved.

        Raises:
            PoolOutOfMemoryError: more pages must move than are unpinned on the device
                (nothing changed), or the host cannot take them.
        """
        device = self._tiers["device"]
        excess = device.used - new
        victims = self.victims("device", excess, set(), None) if excess > 0 else []
        if len(victims) < excess:
            reason = (
                f"cannot shrink the device tier to {new} page slots: {device.used} "
                f"are in use and only {len(victims)} can move down (the rest are pinned)"
            )
            raise PoolOutOfMemoryError(
                self._snapshot(excess * self._page_size, "", "device", reason)
            )
        device.resize(new)
        if victims:
            self.settle(victims, "host", set(), advisory=False, down_only=True)
            self._counters.add("evictions", len(victims))
        return len(victims)

    def evict(self, entries: list[TensorEntry], to_tier: str) -> None:
        """Move ``entries``' pages down to ``to_tier`` (pages already lower stay); waits,
        with all their I/O issued first.

        Raises:
            ValueError: a tensor is pinned or acquired (nothing moved).
            as :meth:`settle` (blocking).
        """
        for entry in entries:
            if entry.pinned:
                raise ValueError(f"tensor {entry.tensor_id!r} is pinned or acquired")
        pages = [p for e in entries for p in e.pages]
        ids = {e.tensor_id for e in entries}
        self.settle(pages, to_tier, ids, advisory=False, down_only=True)

    def wait_settled(self, entry: TensorEntry) -> None:
        """Wait until none of ``entry``'s pages is in flight.

        Raises:
            KeyError: the tensor was freed meanwhile.
            PoolClosedError: the pool closed meanwhile.
        """
        while entry.in_flight():
            self._check_open()
            self._cond.wait_io(entry.pages, WAIT_SLICE_SECONDS)
        if entry.tensor_id not in self._table:
            raise KeyError(f"tensor {entry.tensor_id!r} was freed while waiting")

    # --- room -----------------------------------------------------------------------------
    def below(self, tier: str) -> str | None:
        """The tier under ``tier`` that its pages can move to, or None."""
        if tier == "device":
            return "host"
        if tier == "host" and self._has_nvme:
            return "nvme"
        return None

    def _coming_free(self, tier: str) -> int:
        """Slots of ``tier`` that jobs in flight will free when they finish: a write's
        host slot. (A read keeps its NVMe slot: the page arrives clean.)"""
        if tier == "host":
            return self._table.count(S.IN_FLIGHT_OUT)
        return 0

    def _make_room(
        self,
        lacking: dict[str, list[PageRecord]],
        exclude: set[str],
        jobs: list[IoJob],
        limit: float | None,
    ) -> tuple[bool, bool]:
        """Start moving victims down for the slots ``lacking`` asks for, top tier first
        (a device victim that finds the host full is added to the host's wants). Returns
        ``(acted, short)``: whether a move started, and whether a tier had fewer victims
        than it needs beyond the slots writes in flight will free (then a finished read,
        which makes a page a victim again, is worth waking for)."""
        acted = False
        short = False
        for name in TIER_ORDER:
            need = len(lacking[name]) - self._coming_free(name)
            lower = self.below(name)
            if name == "nvme" and need > 0:
                # The lowest tier: room only from clean pages' copies (they turn dirty).
                reclaimed = self._moves.reclaim_nvme(need)
                acted = reclaimed > 0 or acted
                short = short or reclaimed < need
            if need <= 0 or lower is None:
                continue
            chosen = self.victims(name, need, exclude, limit)
            short = short or len(chosen) < need
            for victim in chosen:
                lower_tier = self._tiers[lower]
                if victim.state is S.ON_HOST_CLEAN and lower == "nvme":
                    self._moves.drop_clean(victim, evicting=True)  # no write
                    acted = True
                elif lower_tier.has_free():
                    self._moves.hop(victim, lower, lower_tier.take(), jobs, evicting=True)
                    acted = True
                else:
                    lacking[lower].append(victim)
        return acted, short

    def victims(
        self, tier: str, n: int, exclude: set[str], limit: float | None
    ) -> list[PageRecord]:
        """The ``n`` pages of other, unpinned tensors to evict first from ``tier`` (a
        clean page on the host is one: its eviction writes nothing)."""
        states = RESIDENT_STATES[tier]
        candidates = (
            p
            for e in self._table.entries()
            if not e.pinned and e.tensor_id not in exclude
            for p in e.pages
            if p.state in states
        )
        return self._policy.choose(candidates, n, limit)

    # --- refusals -------------------------------------------------------------------------
    def check_fits(self, entry: TensorEntry, tier: str) -> None:
        """Fail fast when the tensor cannot fit on ``tier`` beside other pinned pages.

        Raises:
            PoolOutOfMemoryError: naming the pages needed and held.
        """
        slots = self._tiers[tier].n_slots
        if slots is None or len(entry.pages) <= self._tiers[tier].free_count():
            return  # unbounded, or enough free slots whatever is pinned: no scan
        pinned = sum(
            1
            for e in self._table.pinned_entries()
            if e is not entry
            for p in e.pages
            if tier in HOLDS[p.state]
        )
        if len(entry.pages) > slots - pinned:
            reason = (
                f"the tensor needs {len(entry.pages)} pages and the {tier} tier has {slots} "
                f"page slots, {pinned} of them held by pinned or acquired tensors"
            )
            raise PoolOutOfMemoryError(
                self._snapshot(len(entry.pages) * self._page_size, entry.tensor_id, tier, reason)
            )

    def out_of_memory(
        self,
        pages: list[PageRecord],
        target: str,
        lacking: dict[str, list[PageRecord]],
        exclude: set[str],
        reason: str | None = None,
    ) -> PoolOutOfMemoryError:
        """The error of a placement that cannot proceed, with the stuck tier's reason
        (or ``reason`` when the caller knows better)."""
        stuck = next((name for name in TIER_ORDER if lacking[name]), target)
        tier = self._tiers[stuck]
        lower = self.below(stuck)
        if reason is None:
            reason = f"the {stuck} tier is full ({tier.used} of {tier.n_slots} page slots)"
            if lower is None:
                lowest = stuck == "nvme"
                reason += "; it is the lowest tier" if lowest else "; there is no NVMe tier"
            elif not self.victims(stuck, 1, exclude, None):
                reason += "; none of its pages can move down (all pinned, acquired or requested)"
            else:
                reason += f"; the {lower} tier below is full too"
        tensor_ids = list(dict.fromkeys(p.tensor_id for p in pages))
        request = len(pages) * self._page_size
        return PoolOutOfMemoryError(self._snapshot(request, ",".join(tensor_ids), target, reason))


def _resident(page: PageRecord, tier: str) -> bool:
    """True when ``page`` is settled on ``tier`` (on the host: dirty or clean)."""
    return page.state in RESIDENT_STATES[tier]


def _placed(page: PageRecord, target: str, down_only: bool) -> bool:
    if _resident(page, target):
        return True
    return (
        down_only
        and page.state in (S.ON_DEVICE, S.ON_HOST, S.ON_HOST_CLEAN, S.ON_NVME)
        and LEVEL[page.tier] > LEVEL[target]
    )


def _next_hop(page: PageRecord, target: str) -> str:
    if page.state is S.UNPLACED:
        return target
    here = LEVEL[page.tier]
    return TIER_ORDER[here + 1] if LEVEL[target] > here else TIER_ORDER[here - 1]
