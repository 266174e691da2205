"""The flight recorder: the last N StepStats in memory, for post-mortems."""

from __future__ import annotations

import collections
import threading

from zero_runtime.telemetry.stats import StepStats


class FlightRecorder:
    """A bounded ring buffer of the most recent :class:`StepStats`.

    Args:
        capacity: records kept (default 256, >= 1); older records are dropped first.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"FlightRecorder capacity must be >= 1, got {capacity}")
        self._ring: collections.deque[StepStats] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()

    def append(self, stats: StepStats) -> None:
        """Record one step (drops the oldest when full)."""
        with self._lock:
            self._ring.append(stats)

    def last(self, n: int | None = None) -> list[StepStats]:
        """The most recent ``n`` records (all when None), oldest first."""
        with self._lock:
            records = list(self._ring)
        return records if n is None else records[-n:]

    def __len__(self) -> int:
        with self._lock:
            return len(self._ring)
