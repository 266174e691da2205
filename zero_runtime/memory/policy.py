"""Eviction policy: which pages leave a full tier first.

Without an access order, least recently used first (by ``PageRecord.last_use_tick``).
With the step's access order (``set_order``), the page whose tensor is next used
furthest ahead goes first (Belady's rule over a step order that repeats every step; a
tensor absent from the order is "never" and goes before all), ties broken by LRU. The
position in the order advances with each acquire and restarts at each step boundary.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Sequence

from zero_runtime.memory.page_table import PageRecord


class EvictionPolicy:
    """Ranks eviction candidates; holds the access order and the position in it."""

    def __init__(self) -> None:
        self._order: list[str] = []
        self._positions: dict[str, list[int]] = {}  # tensor id -> its indices in _order
        self._cursor = 0  # index in _order of the next expected use

    @property
    def order(self) -> tuple[str, ...]:
        """The access order set (empty: none)."""
        return tuple(self._order)

    @property
    def cursor(self) -> int:
        """Index in :attr:`order` of the next expected use."""
        return self._cursor

    def resume(self, tensor_ids: Sequence[str] | None, cursor: int) -> None:
        """Set the order and the position in it (a recorded state, for a replay)."""
        self.set_order(tensor_ids)
        self._cursor = int(cursor)

    @property
    def ordered(self) -> bool:
        """True when an access order is set."""
        return bool(self._order)

    def set_order(self, tensor_ids: Sequence[str] | None) -> None:
        """Set the step's access order (``None`` or empty: plain LRU); restart at its head."""
        self._order = list(tensor_ids or ())
        self._positions = {}
        for i, tid in enumerate(self._order):
            self._positions.setdefault(tid, []).append(i)
        self._cursor = 0

    def restart(self) -> None:
        """Go back to the head of the order (at a step boundary)."""
        self._cursor = 0

    def advance(self, tensor_id: str) -> None:
        """Record that ``tensor_id`` was just used: move past its next occurrence."""
        positions = self._positions.get(tensor_id)
        if not positions:
            return
        i = bisect.bisect_left(positions, self._cursor)
        self._cursor = (positions[i] if i < len(positions) else positions[0]) + 1

    def distance(self, tensor_id: str) -> float:
        """Uses until ``tensor_id`` is next used (0: next); ``inf`` if not in the order.

        Counts into the next step when the rest of this step does not use it; always
        ``inf`` without an order.
        """
        positions = self._positions.get(tensor_id)
        if not positions:
            return math.inf
        i = bisect.bisect_left(positions, self._cursor)
        if i < len(positions):
            return positions[i] - self._cursor
        return len(self._order) - self._cursor + positions[0]

    def choose(
        self, candidates: Iterable[PageRecord], n: int, limit: float | None = None
    ) -> list[PageRecord]:
        """The ``n`` pages to evict first among ``candidates``.

        Args:
            candidates: evictable pages (unpinned, settled on the tier).
            n: how many to return (fewer if there are fewer candidates).
            limit: if given, only pages whose next use is further than ``limit`` qualify
                (a prefetch must not evict what is needed before what it brings in).
        """
        ranked = [(self.distance(p.tensor_id), p) for p in candidates]
        if limit is not None:
            ranked = [c for c in ranked if c[0] > limit]
        best = heapq.nsmallest(n, ranked, key=lambda c: (-c[0], c[1].last_use_tick))
        return [p for _, p in best]
