"""Precomputed min/max levels of one time series, built incrementally as steps arrive.

A :class:`SeriesLevels` keeps every stored step of one matrix or vector tag of one run
(the raw rows, needed for exports and for the values a chart draws) and a pyramid of
levels over them: level ``j`` cuts the steps into buckets of ``BASE * 2**j`` steps and
keeps, per bucket and per series (column), the position and value of the bucket's
maximum and of its minimum (NaN ignored; the first step holding the extreme wins).
Level 0 is computed from the raw rows, level ``j + 1`` from pairs of level ``j``
buckets, and only for buckets that are complete: appending steps extends each level by
its new complete buckets, so a run of N steps costs O(N x S) once, however often it is
read, and a live run costs only its new steps.

:meth:`SeriesLevels.indices` answers a point budget from the levels without scanning the
steps: it takes the finest level whose buckets fit the budget, the union of their
extremes' positions, the extremes of the steps after the last complete bucket and the
first and last step; if the union is still over budget, the next coarser level, and
past the coarsest, each series' extremes over every step. The largest and smallest value
of every series always survive, however far the answer is thinned (the peak-keeping rule
of the plugin's former per-request thinning, with power-of-two buckets).

Memory: the raw rows (``N x S`` float64 plus steps and wall times) and about
``2 * N / BASE`` buckets of ``2 x S`` (int32 position, float64 value) pairs: with
``BASE = 16``, 3 bytes per step and series, under half of the raw cells' 8.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

from tb_plugin.layout import Layout

BASE = 16  # steps per bucket of level 0
_NONE = -1  # position of a bucket's extreme when the series has no value in the bucket


class _Level:
    """One level: per complete bucket and series, the max and min position and value."""

    def __init__(self, width: int) -> None:
        self.count = 0
        self.max_pos = np.empty((0, width), np.int32)  # [B, S] row index or _NONE
        self.max_val = np.empty((0, width), np.float64)  # [B, S] -inf when none
        self.min_pos = np.empty((0, width), np.int32)
        self.min_val = np.empty((0, width), np.float64)  # +inf when none

    def extend(self, max_pos, max_val, min_pos, min_val) -> None:  # noqa: ANN001 - arrays
        self.max_pos = _grow(self.max_pos, self.count, max_pos)
        self.max_val = _grow(self.max_val, self.count, max_val)
        self.min_pos = _grow(self.min_pos, self.count, min_pos)
        self.min_val = _grow(self.min_val, self.count, min_val)
        self.count += len(max_pos)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.max_pos, self.max_val, self.min_pos, self.min_val))


def _grow(array: np.ndarray, used: int, new: np.ndarray) -> np.ndarray:
    """``array[:used]`` followed by ``new`` (amortised: capacity grows by a quarter)."""
    need = used + len(new)
    if need > len(array):
        bigger = np.empty(
            (max(need, len(array) + len(array) // 4, 64),) + array.shape[1:], array.dtype
        )
        bigger[:used] = array[:used]
        array = bigger
    array[used:need] = new
    return array


def _block_extremes(
    cells: np.ndarray, offset: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row block ``[B, k, S]`` of ``cells``: (max_pos, max_val, min_pos, min_val)
    ``[B, S]``, positions offset by ``offset``; a block without values has _NONE."""
    blocks, k, _width = cells.shape
    nan = np.isnan(cells)
    highs = np.where(nan, -np.inf, cells)
    lows = np.where(nan, np.inf, cells)
    base = offset + k * np.arange(blocks)[:, None]  # [B, 1]
    empty = nan.all(axis=1)  # [B, S]
    out = []
    for series, pick in ((highs, np.argmax), (lows, np.argmin)):
        at = pick(series, axis=1)  # [B, S] first extreme in the block
        val = np.take_along_axis(series, at[:, None, :], axis=1)[:, 0, :]
        out.append(np.where(empty, _NONE, base + at).astype(np.int32))
        out.append(val)
    return out[0], out[1], out[2], out[3]


def _union(n: int, parts: list[np.ndarray]) -> np.ndarray:
    """Sorted unique positions in ``[0, n)`` of ``parts`` (_NONE ignored); a mask over the
    n steps, faster than ``np.unique`` for the sizes here."""
    mark = np.zeros(n + 1, dtype=bool)  # the last slot takes _NONE (index -1)
    for part in parts:
        mark[part] = True
    return np.flatnonzero(mark[:n])


def _merge_pairs(level: _Level, start: int, stop: int):  # noqa: ANN202 - four arrays
    """Buckets ``[start, stop)`` (an even count) of ``level`` merged in pairs."""
    sl, sr = slice(start, stop, 2), slice(start + 1, stop, 2)
    right_max = level.max_val[sr] > level.max_val[sl]  # strict: the first extreme wins
    right_min = level.min_val[sr] < level.min_val[sl]
    return (
        np.where(right_max, level.max_pos[sr], level.max_pos[sl]),
        np.where(right_max, level.max_val[sr], level.max_val[sl]),
        np.where(right_min, level.min_pos[sr], level.min_pos[sl]),
        np.where(right_min, level.min_val[sr], level.min_val[sl]),
    )


class SeriesLevels:
    """Every stored step of one matrix or vector tag and its min/max levels.

    Args:
        layout: the tag's layout (its shape gives the row width S = rows x columns).
        generation: the run's files' generation these steps come from
            (:class:`tb_plugin.run_files.RunGenerations`; default 0).

    Attributes:
        layout: the tag's layout.
        generation: as given.
        lock: held by whoever appends (the background indexer or a request); readers of
            :meth:`snapshot` need not hold it.

    Appends and reads may come from different threads: a snapshot is a consistent view of
    the first ``n`` rows, which later appends never change.
    """

    def __init__(self, layout: Layout, generation: int = 0) -> None:
        self.layout = layout
        self.generation = generation
        self.width = int(np.prod(layout.shape)) if layout.shape else 1
        self.lock = threading.Lock()
        self._n = 0
        self._steps = np.empty(0, np.int64)
        self._walls = np.empty(0, np.float64)
        self._cells = np.empty((0, self.width), np.float64)
        self._levels: list[_Level] = []

    # -- state ----------------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Steps held."""
        return self._n

    @property
    def last_step(self) -> int:
        """The last step held (-1 when empty)."""
        return int(self._steps[self._n - 1]) if self._n else -1

    @property
    def nbytes(self) -> int:
        """Memory held (raw rows and levels, allocated capacity), bytes."""
        raw = self._steps.nbytes + self._walls.nbytes + self._cells.nbytes
        return int(raw + sum(level.nbytes for level in self._levels))

    def steps(self) -> np.ndarray:
        """The steps held, ``[n]`` int64 (a read-only view)."""
        view = self._steps[: self._n]
        view.flags.writeable = False
        return view

    def rows(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(steps ``[K]``, wall times ``[K]`` (s), cells ``[K, S]``) at positions ``keep``."""
        return self._steps[keep], self._walls[keep], self._cells[keep]

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(steps ``[n]``, wall times ``[n]``, cells ``[n, S]``) held now, as views that
        later appends never change (they write past ``n`` or into a new array), so a
        stream can read them without the lock."""
        n = self._n
        return self._steps[:n], self._walls[:n], self._cells[:n]

    # -- writing --------------------------------------------------------------------------
    def append(self, steps: np.ndarray, walls: np.ndarray, cells: np.ndarray) -> None:
        """Append rows (steps after :attr:`last_step`, in order) and extend the levels.

        Args:
            steps: ``[K]`` int steps, increasing, each > :attr:`last_step`.
            walls: ``[K]`` wall times, seconds since the epoch.
            cells: ``[K, S]`` float64 values (NaN = not measured).

        Raises:
            ValueError: steps out of order, or cells of another width.
        """
        k = len(steps)
        if not k:
            return
        cells = np.asarray(cells, np.float64).reshape(k, -1)
        if cells.shape[1] != self.width:
            raise ValueError(f"rows of width {cells.shape[1]}; this series has {self.width}")
        steps = np.asarray(steps, np.int64)
        if steps[0] <= self.last_step or (k > 1 and np.any(np.diff(steps) <= 0)):
            raise ValueError(
                f"steps must increase past {self.last_step}; got {steps[:3].tolist()}..."
            )
        n = self._n
        self._steps = _grow(self._steps, n, steps)
        self._walls = _grow(self._walls, n, np.asarray(walls, np.float64))
        self._cells = _grow(self._cells, n, cells)
        self._n = n + k
        self._extend_levels()

    def _extend_levels(self) -> None:
        if not self._levels:
            self._levels.append(_Level(self.width))
        level0 = self._levels[0]
        done = level0.count * BASE
        blocks = (self._n - done) // BASE
        if blocks:
            rows = self._cells[done : done + blocks * BASE].reshape(blocks, BASE, self.width)
            level0.extend(*_block_extremes(rows, done))
        j = 0
        while self._levels[j].count >= 2:
            lower = self._levels[j]
            if j + 1 == len(self._levels):
                self._levels.append(_Level(self.width))
            upper = self._levels[j + 1]
            start, stop = 2 * upper.count, lower.count - lower.count % 2
            if stop > start:
                upper.extend(*_merge_pairs(lower, start, stop))
            j += 1

    # -- reading --------------------------------------------------------------------------
    def indices(self, budget: int) -> np.ndarray:
        """Peak-keeping positions of at most ``max(budget, 2 * S + 2)`` steps.

        Args:
            budget: the number of steps to aim for (>= 2).

        Returns:
            Sorted int positions into the held steps (all of them when ``n <= budget``):
            the first and last step and, per bucket of the level chosen, each series'
            first maximum and first minimum (see the module docstring).
        """
        n = self._n
        if n <= budget:
            return np.arange(n)
        target = max(1, (budget - 2) // 2)
        for j, level in enumerate(self._levels):
            size = BASE << j
            covered = level.count * size
            if level.count + (1 if covered < n else 0) > target:
                continue  # too many buckets: a coarser level
            parts = [np.array([0, n - 1]), level.max_pos[: level.count].ravel()]
            parts.append(level.min_pos[: level.count].ravel())
            if covered < n:  # the steps after the last complete bucket: their extremes
                t_max, t_min = self._range_extremes(covered)
                parts += [t_max, t_min]
            kept = _union(n, parts)
            if len(kept) <= budget:
                return kept
        # Even the coarsest level is over budget (many series for the budget): each
        # series' extremes over all the steps, and the first and last step (2 S + 2).
        t_max, t_min = self._range_extremes(0)
        return _union(n, [np.array([0, n - 1]), t_max, t_min])

    def _range_extremes(self, start: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions ``[S]`` of each series' first max and first min over rows
        ``[start, n)`` (``start`` a multiple of BASE), from the levels' complete buckets
        (coarsest first) and the raw rows after them (fewer than BASE)."""
        n = self._n
        best = [np.full(self.width, _NONE, np.int32), np.full(self.width, -np.inf)]
        best += [np.full(self.width, _NONE, np.int32), np.full(self.width, np.inf)]

        def take(max_pos, max_val, min_pos, min_val) -> None:  # noqa: ANN001 - arrays [S]
            more, less = max_val > best[1], min_val < best[3]
            best[0] = np.where(more, max_pos, best[0])
            best[1] = np.where(more, max_val, best[1])
            best[2] = np.where(less, min_pos, best[2])
            best[3] = np.where(less, min_val, best[3])

        for j in range(len(self._levels) - 1, -1, -1):
            level, size = self._levels[j], BASE << j
            while start % size == 0 and start // size < level.count:
                b = start // size
                take(level.max_pos[b], level.max_val[b], level.min_pos[b], level.min_val[b])
                start += size
        if start < n:
            t = _block_extremes(self._cells[start:n][None], start)
            take(t[0][0], t[1][0], t[2][0], t[3][0])
        return best[0], best[2]


class LevelStore:
    """The :class:`SeriesLevels` of every series read, least recently used evicted first
    once their memory (:attr:`SeriesLevels.nbytes`) passes a budget.

    Args:
        max_bytes: the budget, bytes. An evicted series is read again (all its steps) the
            next time it is asked for; whoever still holds it may keep using it.

    Thread-safe.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, SeriesLevels] = OrderedDict()
        self._costs: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Memory of the series kept, bytes (as of their last :meth:`touch`)."""
        with self._lock:
            return sum(self._costs.values())

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> SeriesLevels | None:
        """The series under ``key`` (marked recently used), or None."""
        with self._lock:
            levels = self._entries.get(key)
            if levels is not None:
                self._entries.move_to_end(key)
            return levels

    def setdefault(self, key: Hashable, levels: SeriesLevels) -> SeriesLevels:
        """The series under ``key``; ``levels`` is kept there first if there is none (or
        one of another layout)."""
        with self._lock:
            held = self._entries.get(key)
            if held is not None and held.layout == levels.layout:
                self._entries.move_to_end(key)
                return held
        self.put(key, levels)
        return levels

    def put(self, key: Hashable, levels: SeriesLevels) -> None:
        """Keep ``levels`` under ``key`` (replacing any), then evict beyond the budget."""
        with self._lock:
            self._entries[key] = levels
            self._entries.move_to_end(key)
        self.touch(key)

    def touch(self, key: Hashable) -> None:
        """Take the series' current size into account and evict the least recently used
        others while over budget (the series under ``key`` itself is kept)."""
        with self._lock:
            levels = self._entries.get(key)
            if levels is None:
                return
            self._costs[key] = levels.nbytes
            total = sum(self._costs.values())
            for old in list(self._entries):
                if total <= self.max_bytes:
                    break
                if old == key:
                    continue
                del self._entries[old]
                total -= self._costs.pop(old, 0)
