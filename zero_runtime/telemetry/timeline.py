"""Comm/compute interval timeline and the overlap ratio.

Vocabulary: an *interval* is a half-open ``(start, end)`` pair of seconds on one clock
(``time.perf_counter`` for what the runtime records itself; the profiler's own clock for a
trace, converted to seconds). A *kind* is ``"comm"`` (anything that moves bytes:
collectives, NVMe page reads/writes, host<->device copies) or ``"compute"`` (kernels,
the host optimizer update).

Overlap ratio, as Holistic Trace Analysis defines "communication computation overlap"
(HTA, ``hta/analyzers/breakdown_analysis.py`` and its docs, "Comm Comp Overlap"):

    overlap_ratio = |union(comm) ∩ union(compute)| / |union(comm)|

in [0, 1]: 1 when every communication second is hidden under computation, 0 when they
are serialized. Undefined (NaN) when there is no communication.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterable, Sequence

Interval = tuple[float, float]  # (start, end) seconds, end >= start

COMM = "comm"
COMPUTE = "compute"
KINDS = (COMM, COMPUTE)


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge intervals into sorted, disjoint intervals.

    Args:
        intervals: ``(start, end)`` pairs, seconds; empty or reversed ones are dropped.

    Returns:
        Sorted disjoint intervals covering exactly the same points (touching ones merge).
    """
    merged: list[list[float]] = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two interval sets (each merged first), sorted and disjoint."""
    return intersect_merged(union(a), union(b))


def intersect_merged(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """:func:`intersect` of two already merged (sorted, disjoint) interval lists, without
    merging them again."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def total(intervals: Iterable[Interval]) -> float:
    """Seconds covered by the union of ``intervals``."""
    return sum(e - s for s, e in union(intervals))


@dataclasses.dataclass(frozen=True)
class Overlap:
    """Comm/compute figures of one window, seconds (NaN when nothing was recorded).

    Attributes:
        comm_seconds: |union(comm)|.
        compute_seconds: |union(compute)|.
        overlap_seconds: |union(comm) ∩ union(compute)|.
        overlap_ratio: overlap_seconds / comm_seconds in [0, 1]; NaN when comm is 0.
    """

    comm_seconds: float
    compute_seconds: float
    overlap_seconds: float
    overlap_ratio: float

    def as_dict(self) -> dict[str, float]:
        """Keys are ``tb_plugin.metadata.TIMING_COLUMNS`` names."""
        return dataclasses.asdict(self)


def overlap(comm: Sequence[Interval], compute: Sequence[Interval]) -> Overlap:
    """The HTA overlap figures of two interval sets (module docstring)."""
    c = total(comm)
    both = total(intersect(comm, compute))
    return Overlap(
        comm_seconds=c,
        compute_seconds=total(compute),
        overlap_seconds=both,
        overlap_ratio=both / c if c > 0 else math.nan,
    )


class Timeline:
    """Thread-safe recorder of comm and compute intervals for the current step.

    The runtime records intervals it drives itself (NVMe page I/O as ``comm``, the host
    optimizer update as ``compute``) from any thread, and :meth:`drain` takes the step's
    intervals at the step boundary.

    Args:
        max_intervals: intervals kept per kind between drains (default 100000); beyond
            it the oldest are dropped and :attr:`dropped` counts them.
    """

    def __init__(self, max_intervals: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._intervals: dict[str, list[Interval]] = {k: [] for k in KINDS}
        self._max = max_intervals
        self.dropped = 0

    def add(self, kind: str, start: float, end: float) -> None:
        """Record one interval of ``kind`` ('comm' or 'compute'), seconds.

        Raises:
            ValueError: an unknown kind.
        """
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is invalid: expected one of {KINDS}")
        with self._lock:
            bucket = self._intervals[kind]
            bucket.append((float(start), float(end)))
            if len(bucket) > self._max:
                del bucket[0]
                self.dropped += 1

    def drain(self) -> dict[str, list[Interval]]:
        """Return and clear the recorded intervals: ``{"comm": [...], "compute": [...]}``."""
        with self._lock:
            out = self._intervals
            self._intervals = {k: [] for k in KINDS}
        return out

    def overlap(self) -> Overlap:
        """:func:`overlap` of the intervals recorded so far (does not clear them)."""
        with self._lock:
            comm, compute = list(self._intervals[COMM]), list(self._intervals[COMPUTE])
        return overlap(comm, compute)
