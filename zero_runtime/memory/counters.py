"""Per-step paging counters and per-tier usage, the figures the telemetry layer records.

Field names of :class:`PageCounters` are exactly ``tb_plugin.metadata.PAGE_COLUMNS``.
Directions: ``d2h`` device to host, ``h2d`` host to device, ``h2n`` host to NVMe,
``n2h`` NVMe to host. A *move* is a page changing tier (a completed transition in the page
table); reads and writes of a page where it lives are not moves.
"""

from __future__ import annotations

import dataclasses

# Directions of page moves, in PAGE_COLUMNS order.
DIRECTIONS = ("d2h", "h2d", "h2n", "n2h", "h2n_clean")


@dataclasses.dataclass(frozen=True)
class PageCounters:
    """Page moves and I/O during one step (closed by ``PagedBufferPool.step_boundary``).

    Attributes:
        d2h_pages: pages moved device -> host (count).
        d2h_bytes: payload bytes of those pages (bytes; the tensor bytes a page holds, so
            at most the page size each).
        h2d_pages, h2d_bytes: host -> device, likewise.
        h2n_pages, h2n_bytes: host -> NVMe (page-outs), likewise.
        n2h_pages, n2h_bytes: NVMe -> host (page-ins), likewise.
        evictions: pages moved one tier down because a tier was full (count); moves asked
            for with ``evict()`` are not evictions.
        prefetch_hits: pages an ``acquire`` found already in the requested tier or on
            their way there (count).
        prefetch_misses: pages an ``acquire`` had to bring in itself (count).
        stall_seconds: wall time ``acquire`` spent waiting for pages (seconds).
        io_seconds: time the I/O threads spent in pread/pwrite and CRC-32C, summed over
            threads, so it can exceed wall time (seconds).
        h2n_clean_pages: pages moved host -> NVMe with no write, because their NVMe copy
            was current (a clean page, read from NVMe and not written since: its host copy
            is dropped). Not in ``h2n_pages``, which counts writes (count).
        h2n_clean_bytes: payload bytes of those pages: writes saved (bytes).
    """

    d2h_pages: int = 0
    d2h_bytes: int = 0
    h2d_pages: int = 0
    h2d_bytes: int = 0
    h2n_pages: int = 0
    h2n_bytes: int = 0
    n2h_pages: int = 0
    n2h_bytes: int = 0
    evictions: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    stall_seconds: float = 0.0
    io_seconds: float = 0.0
    h2n_clean_pages: int = 0
    h2n_clean_bytes: int = 0

    def as_row(self) -> tuple[float, ...]:
        """Return the values in ``PAGE_COLUMNS`` order (floats, for the summary vector)."""
        return tuple(float(getattr(self, f.name)) for f in dataclasses.fields(self))


@dataclasses.dataclass(frozen=True)
class PoolTotals:
    """A pool's page counters since it was created (``PagedBufferPool.totals``): every
    step's :class:`PageCounters` summed, and the page moves split by the kind of the
    tensor moved.

    Attributes:
        counters: the steps' :class:`PageCounters` summed, the open step's included
            (``h2n_clean_pages``: clean evictions and clean moves down, each a write
            avoided; ``h2n_clean_bytes``: the bytes not written).
        by_kind: tensor kind ('param', 'grad', 'optimizer', 'activation', 'other') ->
            ``{"<direction>_pages": count, "<direction>_bytes": bytes}`` for every
            direction of :data:`DIRECTIONS` (``n2h``: read from NVMe; ``h2n``: written
            to NVMe; ``h2n_clean``: left the host with no write); a kind never moved is
            absent.
    """

    counters: PageCounters
    by_kind: dict[str, dict[str, int]]

    def as_dict(self) -> dict:
        """A JSON-ready copy: the summed counters' fields, ``"by_kind"``, and the figures
        that say where the bytes went: ``clean_page_outs`` (pages that left the host
        with no write, their NVMe copy current: clean evictions and clean moves down),
        ``writes_avoided_bytes`` (their bytes), ``read_bytes_by_kind`` and
        ``written_bytes_by_kind`` (kind -> bytes read from / written to NVMe)."""
        return {
            **dataclasses.asdict(self.counters),
            "by_kind": {k: dict(v) for k, v in self.by_kind.items()},
            "clean_page_outs": self.counters.h2n_clean_pages,
            "writes_avoided_bytes": self.counters.h2n_clean_bytes,
            "read_bytes_by_kind": {k: v["n2h_bytes"] for k, v in self.by_kind.items()},
            "written_bytes_by_kind": {k: v["h2n_bytes"] for k, v in self.by_kind.items()},
        }


def _zeros() -> dict[str, float]:
    return {f.name: f.default for f in dataclasses.fields(PageCounters)}


class CounterAccumulator:
    """Mutable counters for the open step, and their totals since creation; not
    thread-safe (the pool's lock guards it)."""

    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self.reset(totals=True)

    def reset(self, totals: bool = False) -> None:
        """Zero every counter of the open step (and, with ``totals``, the totals too)."""
        self._values = _zeros()
        if totals:
            self._totals = _zeros()
            self._by_kind: dict[str, dict[str, int]] = {}

    def move(self, direction: str, payload_bytes: int, kind: str = "other") -> None:
        """Count one page of a ``kind`` tensor moved in ``direction`` (one of
        :data:`DIRECTIONS`), ``payload_bytes`` of it."""
        for values in (self._values, self._totals):
            values[f"{direction}_pages"] += 1
            values[f"{direction}_bytes"] += payload_bytes
        per_kind = self._by_kind.get(kind)
        if per_kind is None:
            per_kind = self._by_kind[kind] = {
                f"{d}_{unit}": 0 for d in DIRECTIONS for unit in ("pages", "bytes")
            }
        per_kind[f"{direction}_pages"] += 1
        per_kind[f"{direction}_bytes"] += payload_bytes

    def add(self, name: str, amount: float = 1) -> None:
        """Add ``amount`` to counter ``name`` (a :class:`PageCounters` field)."""
        self._values[name] += amount
        self._totals[name] += amount

    def snapshot(self) -> PageCounters:
        """Return the current values as a frozen :class:`PageCounters`."""
        return PageCounters(**self._values)

    def totals(self) -> PoolTotals:
        """The totals since creation (or the last ``reset(totals=True)``), a copy."""
        return PoolTotals(
            PageCounters(**self._totals), {k: dict(v) for k, v in self._by_kind.items()}
        )


@dataclasses.dataclass(frozen=True)
class TierUsage:
    """One tier's occupancy, as returned by ``PagedBufferPool.usage()``.

    Attributes:
        used_bytes: bytes of the tier's slots in use (whole pages; pages in flight count
            toward both tiers they touch, see ``PageState``).
        capacity_bytes: the tier's budget rounded down to whole pages; ``None`` when
            unbounded (an NVMe tier without a budget).
        peak_bytes: highest ``used_bytes`` since the last ``step_boundary`` (or start).
        bytes_by_kind: ``used_bytes`` split by kind ('param', 'grad', 'optimizer',
            'activation', 'other'); the values sum to ``used_bytes``.
        pages: number of slots in use (``used_bytes // page_size``).
    """

    used_bytes: int
    capacity_bytes: int | None
    peak_bytes: int
    bytes_by_kind: dict[str, int]
    pages: int
