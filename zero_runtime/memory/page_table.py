"""The page table: the one record of where every page lives.

Vocabulary (cited by the other modules of this package):

- *page*: a fixed-size piece (``page_size`` bytes, a power of two) of one tensor's bytes,
  identified by ``(tensor_id, index)``. Page ``i`` holds bytes ``[i * page_size,
  min((i + 1) * page_size, nbytes))`` of the tensor's C-order buffer; that length is its
  *payload*. Only the last page of a tensor can have a payload shorter than a page.
- *slot*: a page-sized place in a tier (an index into the tier's storage). A page in a
  settled state holds one slot; a page in flight holds one in each tier it touches.
- *tier*: ``"device"``, ``"host"`` or ``"nvme"``, top to bottom.

One :class:`TensorEntry` per tensor owns the list of its :class:`PageRecord`; there is no
other map keyed by tensor or page. Every change of a page's state and slots goes through
:meth:`PageTable.transition`, which checks the state it leaves, takes ownership of the
new slot, returns the slots the page gives up to their tiers and counts the move.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Iterator, Mapping
from typing import Protocol

import numpy as np

from zero_runtime.memory.counters import CounterAccumulator
from zero_runtime.memory.errors import PageStateError

KINDS = ("param", "grad", "optimizer", "activation", "other")
TIER_ORDER = ("device", "host", "nvme")  # top to bottom
LEVEL = {name: i for i, name in enumerate(TIER_ORDER)}  # tier -> depth (0: top)


class PageState(enum.Enum):
    """Lifecycle of one page. What counts toward each tier's memory is stated per state.

    - ``UNPLACED``: record created by ``allocate`` but no slot yet; counts nowhere.
    - ``ON_DEVICE``: in a device slot; counts toward the device tier.
    - ``ON_HOST``: in a host slot; counts toward the host tier.
    - ``ON_HOST_CLEAN``: in a host slot *and* still in the NVMe slot it was read from,
      whose bytes and CRC-32C are current (a clean page, in an OS's terms). It counts
      toward both tiers. Evicting it to NVMe drops the host copy with no write
      (``h2n_clean``); a write to it first drops the NVMe copy (-> ``ON_HOST``, dirty).
    - ``ON_NVME``: in an NVMe slot with a recorded CRC-32C; counts toward the NVMe tier.
    - ``IN_FLIGHT_OUT``: being written host -> NVMe; holds its host slot (the source) and
      its NVMe slot (the destination), so it counts toward both until the write ends.
    - ``IN_FLIGHT_IN``: being read NVMe -> host; holds its NVMe slot (the source) and a
      host slot (the destination); counts toward both until the read ends.
    - ``FREED``: terminal; counts nowhere.

    Device <-> host moves are synchronous copies, so they have no in-flight state.
    Pinning is not a state: a tensor's pin count (``TensorEntry.pinned``) keeps its pages
    from being evicted in whichever state they are.
    """

    UNPLACED = "unplaced"
    ON_DEVICE = "on_device"
    ON_HOST = "on_host"
    ON_HOST_CLEAN = "on_host_clean"
    ON_NVME = "on_nvme"
    IN_FLIGHT_OUT = "in_flight_out"
    IN_FLIGHT_IN = "in_flight_in"
    FREED = "freed"


S = PageState

# Tiers whose slots a page holds in each state.
HOLDS: dict[PageState, frozenset[str]] = {
    S.UNPLACED: frozenset(),
    S.ON_DEVICE: frozenset({"device"}),
    S.ON_HOST: frozenset({"host"}),
    S.ON_HOST_CLEAN: frozenset({"host", "nvme"}),
    S.ON_NVME: frozenset({"nvme"}),
    S.IN_FLIGHT_OUT: frozenset({"host", "nvme"}),
    S.IN_FLIGHT_IN: frozenset({"nvme", "host"}),
    S.FREED: frozenset(),
}

# The settled state of each tier.
RESIDENT = {"device": S.ON_DEVICE, "host": S.ON_HOST, "nvme": S.ON_NVME}
IN_FLIGHT = frozenset({S.IN_FLIGHT_OUT, S.IN_FLIGHT_IN})
# The settled states of each tier (tuples: membership by identity, no Enum hashing, on
# the victim scan's hot path); on the host a page is dirty or clean (NVMe copy current).
RESIDENT_STATES: dict[str, tuple[PageState, ...]] = {
    "device": (S.ON_DEVICE,),
    "host": (S.ON_HOST, S.ON_HOST_CLEAN),
    "nvme": (S.ON_NVME,),
}
HOST_STATES = RESIDENT_STATES["host"]

# Legal transitions: (from, to) -> direction counted as a move, or None.
LEGAL: dict[tuple[PageState, PageState], str | None] = {
    (S.UNPLACED, S.ON_DEVICE): None,
    (S.UNPLACED, S.ON_HOST): None,
    (S.UNPLACED, S.ON_NVME): None,
    (S.UNPLACED, S.FREED): None,
    (S.ON_DEVICE, S.ON_HOST): "d2h",
    (S.ON_HOST, S.ON_DEVICE): "h2d",
    (S.ON_HOST, S.IN_FLIGHT_OUT): None,
    (S.IN_FLIGHT_OUT, S.ON_NVME): "h2n",
    (S.IN_FLIGHT_OUT, S.ON_HOST): None,  # the write failed; the page stays on host
    (S.ON_NVME, S.IN_FLIGHT_IN): None,
    (S.IN_FLIGHT_IN, S.ON_HOST): "n2h",
    (S.IN_FLIGHT_IN, S.ON_HOST_CLEAN): "n2h",  # read; the NVMe copy is kept
    (S.ON_HOST_CLEAN, S.ON_NVME): "h2n_clean",  # evicted clean: the host copy dropped
    (S.ON_HOST_CLEAN, S.ON_HOST): None,  # about to be written: the NVMe copy dropped
    (S.ON_HOST_CLEAN, S.ON_DEVICE): "h2d",  # both lower copies dropped
    (S.ON_HOST_CLEAN, S.FREED): None,
    (S.IN_FLIGHT_IN, S.ON_NVME): None,  # the read failed; the page stays on NVMe
    (S.ON_DEVICE, S.FREED): None,
    (S.ON_HOST, S.FREED): None,
    (S.ON_NVME, S.FREED): None,
}


class SlotOwner(Protocol):
    """What the page table needs from a tier: giving a slot back."""

    def release(self, slot: int) -> None:
        """Return ``slot`` to the tier's free list."""


@dataclasses.dataclass(eq=False)
class PageRecord:
    """The page table's record of one page. Mutated only by :meth:`PageTable.transition`
    (state, slots) and :meth:`PageTable.touch` (last use); ``checksum`` is set by the pool
    when it writes the page's NVMe copy.

    Attributes:
        tensor_id: the owning tensor.
        index: page index within the tensor (0-based).
        payload: bytes of the tensor in this page (<= page size).
        state: the :class:`PageState`.
        slots: tier name -> slot index, for each tier in ``HOLDS[state]``.
        checksum: CRC-32C of the payload as last written to NVMe (``None`` before that).
        last_use_step: the step of the last use (allocate, write, acquire, page-in).
        last_use_tick: a pool-wide counter at the last use, to order uses within a step.
    """

    tensor_id: str
    index: int
    payload: int
    state: PageState = S.UNPLACED
    slots: dict[str, int] = dataclasses.field(default_factory=dict)
    checksum: int | None = None
    last_use_step: int = 0
    last_use_tick: int = 0
    external: bool = False  # a reservation's page: accounted, its bytes held elsewhere

    @property
    def tier(self) -> str | None:
        """The tier the page is in (the source tier while in flight); ``None`` if none."""
        if self.state in (S.ON_DEVICE,):
            return "device"
        if self.state in (S.ON_HOST, S.ON_HOST_CLEAN, S.IN_FLIGHT_OUT):
            return "host"
        if self.state in (S.ON_NVME, S.IN_FLIGHT_IN):
            return "nvme"
        return None


@dataclasses.dataclass(eq=False)
class TensorEntry:
    """One tensor: its logical shape and dtype, its pages, and its pins.

    Attributes:
        tensor_id: the caller's identifier.
        shape: logical shape.
        dtype: numpy dtype.
        kind: accounting label, one of :data:`KINDS`.
        nbytes: ``prod(shape) * dtype.itemsize`` (bytes).
        pages: the page records, in index order.
        pin_count: explicit ``pin()`` calls not yet matched by ``unpin()``.
        acquire_count: ``acquire()`` calls not yet matched by ``release()``.
        acquisitions: every ``acquire()`` that succeeded, ever (a prefetch request queued
            before the latest one was served by it: :class:`~zero_runtime.memory.prefetch.
            PrefetchRequest`).
        acquired_tier: the tier it is acquired on while ``acquire_count > 0``.
        acquired: the array handed out by ``acquire(tier='host')`` while acquired.
        as_pages: acquired by ``acquire_pages`` (page views, nothing to write back), not
            by ``acquire``; the two are not mixed while ``acquire_count > 0``.
        writable: whether that array may be written (and is written back on release).
        external: a reservation (:meth:`PagedBufferPool.reserve`): its pages are counted
            on their tier and pinned there, but its bytes are held outside the pool.
    """

    tensor_id: str
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str
    nbytes: int
    pages: list[PageRecord]
    pin_count: int = 0
    acquire_count: int = 0
    acquisitions: int = 0
    acquired_tier: str | None = None
    acquired: np.ndarray | None = None
    as_pages: bool = False
    writable: bool = False
    external: bool = False

    @property
    def pinned(self) -> bool:
        """True while pinned or acquired: its pages are not evicted."""
        return self.pin_count > 0 or self.acquire_count > 0

    def in_flight(self) -> bool:
        """True if any of its pages is being read or written."""
        return any(p.state in IN_FLIGHT for p in self.pages)


class PageTable:
    """Owner of every :class:`TensorEntry` and :class:`PageRecord` and of their transitions.

    Not thread-safe: the pool calls it under its lock.

    Args:
        tiers: tier name -> tier, to which released slots are returned.
        counters: accumulator in which completed moves are counted.
    """

    def __init__(self, tiers: Mapping[str, SlotOwner], counters: CounterAccumulator) -> None:
        self._tiers = tiers
        self._counters = counters
        self._tensors: dict[str, TensorEntry] = {}
        self._state_counts: collections.Counter[PageState] = collections.Counter()
        # Kept by transition() so that usage and the fit check read them without a scan of
        # every page (they ran per acquire and per optimizer sub-group, under the pool's
        # lock: O(pages) each, a tenth of a 170M-parameter NVMe step's wall time).
        self._tier_kind_pages: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self._pinned: dict[str, TensorEntry] = {}
        self._tick = 0
        self.step = 0

    # --- tensors ----------------------------------------------------------------------
    def add(self, entry: TensorEntry) -> None:
        """Register a new tensor (its pages ``UNPLACED``).

        Raises:
            ValueError: ``entry.tensor_id`` is already registered.
        """
        if entry.tensor_id in self._tensors:
            raise ValueError(f"tensor {entry.tensor_id!r} is already allocated in this pool")
        if any(p.state is not S.UNPLACED for p in entry.pages):
            raise PageStateError(f"tensor {entry.tensor_id!r} added with placed pages")
        self._tensors[entry.tensor_id] = entry
        self._state_counts[S.UNPLACED] += len(entry.pages)

    def get(self, tensor_id: str) -> TensorEntry:
        """Return the entry of ``tensor_id``.

        Raises:
            KeyError: unknown tensor; the message names it.
        """
        try:
            return self._tensors[tensor_id]
        except KeyError:
            raise KeyError(f"tensor {tensor_id!r} is not allocated in this pool") from None

    def remove(self, tensor_id: str) -> None:
        """Forget a tensor whose pages are all ``FREED``.

        Raises:
            PageStateError: a page still holds a slot.
        """
        entry = self.get(tensor_id)
        live = [p.index for p in entry.pages if p.state is not S.FREED]
        if live:
            raise PageStateError(f"tensor {tensor_id!r} removed with live pages {live}")
        del self._tensors[tensor_id]
        self._pinned.pop(tensor_id, None)
        self._state_counts[S.FREED] -= len(entry.pages)

    def count(self, state: PageState) -> int:
        """Number of pages in ``state`` (over all tensors)."""
        return self._state_counts[state]

    def pages_by_kind(self, tier: str) -> dict[str, int]:
        """Pages holding a slot of ``tier`` (``HOLDS``: in-flight pages count on both
        tiers), by their tensor's ``kind``; kinds with none are left out. O(kinds)."""
        return {k: n for k, n in self._tier_kind_pages[tier].items() if n}

    def note_pins(self, entry: TensorEntry) -> None:
        """Record that ``entry``'s pin or acquire count changed (call after each change:
        :meth:`pinned_entries` lists the entries pinned now)."""
        if entry.pinned and entry.tensor_id in self._tensors:
            self._pinned[entry.tensor_id] = entry
        else:
            self._pinned.pop(entry.tensor_id, None)

    def pinned_entries(self) -> list[TensorEntry]:
        """The entries pinned or acquired now (:attr:`TensorEntry.pinned`), as recorded by
        :meth:`note_pins`."""
        return list(self._pinned.values())

    def audit(self) -> None:
        """Check the incremental figures (pages by tier and kind, pinned entries)
        against a scan of every page and entry.

        Raises:
            PageStateError: a figure differs from the scan (internal error), naming it.
        """
        scan: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for entry in self._tensors.values():
            for page in entry.pages:
                for tier in HOLDS[page.state]:
                    scan[tier][entry.kind] += 1
        for tier in set(scan) | set(self._tier_kind_pages):
            if self.pages_by_kind(tier) != {k: n for k, n in scan[tier].items() if n}:
                raise PageStateError(
                    f"pages by kind on {tier}: kept {self.pages_by_kind(tier)}, "
                    f"scanned {dict(scan[tier])} (internal error)"
                )
        pinned = {t for t, e in self._tensors.items() if e.pinned}
        if pinned != set(self._pinned):
            raise PageStateError(
                f"pinned entries: kept {sorted(self._pinned)}, scanned {sorted(pinned)} "
                "(internal error)"
            )

    def __contains__(self, tensor_id: object) -> bool:
        return tensor_id in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def entries(self) -> Iterator[TensorEntry]:
        """Iterate over the tensor entries (insertion order)."""
        return iter(list(self._tensors.values()))

    def pages(self) -> Iterator[PageRecord]:
        """Iterate over every page record."""
        for entry in list(self._tensors.values()):
            yield from entry.pages

    @property
    def tick(self) -> int:
        """The pool-wide use counter (the last tick handed out by :meth:`touch`)."""
        return self._tick

    def resume_tick(self, tick: int) -> None:
        """Continue counting uses from ``tick`` (a recorded state, for a replay)."""
        self._tick = int(tick)

    # --- pages ------------------------------------------------------------------------
    def touch(self, page: PageRecord) -> None:
        """Mark ``page`` as used now (for LRU ordering)."""
        self._tick += 1
        page.last_use_tick = self._tick
        page.last_use_step = self.step

    def transition(
        self, page: PageRecord, to: PageState, new_slot: int | None = None
    ) -> str | None:
        """Move ``page`` to state ``to``; the only place a page's state or slots change.

        Args:
            page: the record.
            to: the new state.
            new_slot: the slot, already taken from its tier by the caller, in the one
                tier the new state holds and the old one does not; ``None`` when the new
                state holds no new tier.

        Returns:
            The move direction counted ('d2h', 'h2d', 'h2n', 'n2h', 'h2n_clean') or
            ``None``.

        Raises:
            PageStateError: ``(page.state, to)`` is not a legal transition, or
                ``new_slot`` is missing or superfluous. Internal errors; nothing changed.
        """
        frm = page.state
        if (frm, to) not in LEGAL:
            raise PageStateError(
                f"illegal page transition {frm.name} -> {to.name} for page {page.index} of "
                f"tensor {page.tensor_id!r} (internal error)"
            )
        gained = HOLDS[to] - HOLDS[frm]
        lost = HOLDS[frm] - HOLDS[to]
        if bool(gained) != (new_slot is not None):
            raise PageStateError(
                f"transition {frm.name} -> {to.name} of page {page.index} of tensor "
                f"{page.tensor_id!r} needs a new slot in {sorted(gained) or 'no tier'}, "
                f"got {new_slot!r} (internal error)"
            )
        kind = self._tensors[page.tensor_id].kind if lost or gained else ""
        for tier in lost:
            self._tiers[tier].release(page.slots.pop(tier))
            self._tier_kind_pages[tier][kind] -= 1
        for tier in gained:
            page.slots[tier] = new_slot  # type: ignore[assignment]
            self._tier_kind_pages[tier][kind] += 1
        page.state = to
        self._state_counts[frm] -= 1
        self._state_counts[to] += 1
        direction = LEGAL[(frm, to)]
        if direction is not None:
            self._counters.move(direction, page.payload, self._tensors[page.tensor_id].kind)
        return direction
