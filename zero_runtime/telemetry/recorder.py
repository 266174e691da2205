"""The flight recorder: the last N StepStats and the last page moves, for post-mortems."""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

from zero_runtime.telemetry.stats import StepStats

T = TypeVar("T")


class _Ring(Generic[T]):
    """A thread-safe bounded ring buffer; the oldest item is dropped when full.

    Args:
        capacity: items kept (>= 1).

    Raises:
        ValueError: ``capacity`` < 1 (the message names the concrete class).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"{type(self).__name__} capacity must be >= 1, got {capacity}")
        self._ring: collections.deque[T] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()

    def append(self, item: T) -> None:
        """Record one item (drops the oldest when full)."""
        with self._lock:
            self._ring.append(item)

    def last(self, n: int | None = None) -> list[T]:
        """The most recent ``n`` items (all when None), oldest first."""
        with self._lock:
            records = list(self._ring)
        return records if n is None else records[-n:]

    def __len__(self) -> int:
        with self._lock:
            return len(self._ring)


class FlightRecorder(_Ring[StepStats]):
    """A bounded ring buffer of the most recent :class:`StepStats`.

    Args:
        capacity: records kept (default 256, >= 1); older records are dropped first.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int = 256) -> None:
        super().__init__(capacity)


class PageMoveRecorder(_Ring[dict]):
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
        super().__init__(capacity)
