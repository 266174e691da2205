"""A small thread-safe LRU cache bounded by a cost budget, for the plugin's read side.

The plugin caches decoded data and encoded answers: the decoded steps of a time series and
the decoded records of a json tag (:mod:`tb_plugin.reader`), keyed by ``(experiment, run,
tag, max_step)``, and encoded ``/series`` answers (:mod:`tb_plugin.routes.series`), keyed
by the same plus the answer's parameters. ``max_step`` is in the key, so a run that grows gets a
new entry on the next request and the old one ages out; so is the generation of the run's
event files (:mod:`tb_plugin.run_files`), so a run rewritten into the same directory does
too; nothing is invalidated by hand.

Concurrent requests for the same missing key compute it once: the first computes, the
others wait for its result (TensorBoard serves requests from a thread pool, and the view
asks for several series at once).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class CostLru(Generic[V]):
    """Least-recently-used cache whose entries have a cost; the total stays under a budget.

    Args:
        max_cost: the budget (in whatever unit the costs use; the plugin uses bytes). An
            entry costlier than the budget is returned but not kept.
    """

    def __init__(self, max_cost: int) -> None:
        self.max_cost = max_cost
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._cost = 0
        self._lock = threading.Lock()
        self._inflight: dict[Hashable, threading.Lock] = {}
        self.hits = 0
        self.misses = 0

    @property
    def cost(self) -> int:
        """The total cost of the entries kept."""
        return self._cost

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> V | None:
        """The value for ``key`` (marking it recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, value: V, cost: int) -> None:
        """Keep ``value`` under ``key``, evicting the least recently used beyond budget."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._cost -= old[1]
            if cost > self.max_cost:
                return
            self._entries[key] = (value, cost)
            self._cost += cost
            while self._cost > self.max_cost and self._entries:
                _key, (_value, evicted) = self._entries.popitem(last=False)
                self._cost -= evicted

    def get_or_compute(self, key: Hashable, compute: Callable[[], tuple[V, int]]) -> V:
        """The cached value for ``key``, or ``compute()``'s value (kept with its cost).

        Args:
            key: the cache key.
            compute: returns ``(value, cost)``; called at most once at a time per key.
                Its exceptions propagate and nothing is cached.
        """
        value = self.get(key)
        if value is not None:
            self.hits += 1
            return value
        with self._lock:
            gate = self._inflight.setdefault(key, threading.Lock())
        with gate:
            value = self.get(key)  # computed by another thread while this one waited
            if value is not None:
                self.hits += 1
                return value
            self.misses += 1
            try:
                value, cost = compute()
                self.put(key, value, cost)
            finally:
                with self._lock:
                    self._inflight.pop(key, None)
            return value

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
            self._cost = 0
