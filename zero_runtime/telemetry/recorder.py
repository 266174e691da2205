"""The flight recorder: the last N StepStats and the last page moves, for post-mortems."""

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


class PageMoveRecorder:
    """A ring buffer of the most recent page moves the runtime observed.

    Each move is a dict ``{"wall_time": s since epoch, "direction": "h2n" | "n2h" | ...,
    "bytes": payload bytes, "tensor": str, "page": int, "seconds": I/O seconds,
    "ok": bool}``.

    Args:
        capacity: moves kept (default 1024, >= 1).

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError(f"PageMoveRecorder capacity must be >= 1, got {capacity}")
        self._ring: collections.deque[dict] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()

    def append(self, move: dict) -> None:
        """Record one move (drops the oldest when full)."""
        with self._lock:
            self._ring.append(move)

    def last(self, n: int | None = None) -> list[dict]:
        """The most recent ``n`` moves (all when None), oldest first."""
        with self._lock:
            records = list(self._ring)
        return records if n is None else records[-n:]

    def __len__(self) -> int:
        with self._lock:
            return len(self._ring)
