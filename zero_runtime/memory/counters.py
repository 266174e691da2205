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


class CounterAccumulator:
    """Mutable counters for the open step; not thread-safe (the pool's lock guards it)."""

    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self.reset()

    def reset(self) -> None:
        """Zero every counter."""
        self._values = {f.name: f.default for f in dataclasses.fields(PageCounters)}

    def move(self, direction: str, payload_bytes: int) -> None:
        """Count one page moved in ``direction`` (one of :data:`DIRECTIONS`)."""
        self._values[f"{direction}_pages"] += 1
        self._values[f"{direction}_bytes"] += payload_bytes

    def add(self, name: str, amount: float = 1) -> None:
        """Add ``amount`` to counter ``name`` (a :class:`PageCounters` field)."""
        self._values[name] += amount

    def snapshot(self) -> PageCounters:
        """Return the current values as a frozen :class:`PageCounters`."""
        return PageCounters(**self._values)


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
