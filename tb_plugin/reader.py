"""The plugin's one reader over TensorBoard's data provider, shared by every route.

It reads summaries only through the data provider (``list_tensors`` and
``read_tensors``), so every route answers the same with ``--load_fast=true`` (the Rust
data server; :mod:`tb_plugin.fast_read` decodes its answers in bulk) and
``--load_fast=false`` (the Python multiplexer). It owns:

- the **listing** of every run's memory_hierarchy time series (metadata and
  ``max_step``), reused for :data:`LISTING_TTL_SECONDS` and then refreshed in the
  background while the old one is still answered (up to :data:`LISTING_STALE_SECONDS`);
- the **decoded steps and min/max levels** of matrix and vector tags
  (:class:`tb_plugin.levels.SeriesLevels`, one per ``(experiment, run, tag)`` in a
  :class:`tb_plugin.levels.LevelStore`), brought up to the listing's ``max_step`` by
  decoding only the new steps (read anew from every step when the run's event files were
  replaced or truncated, :mod:`tb_plugin.run_files`, or its ``max_step`` fell); every
  listing (each ``/runs`` poll) wakes a background indexer that brings every run's series
  up to date as their steps load, so a chart request is answered from memory at any point
  budget;
- the decoded records of json tags, in a :class:`tb_plugin.cache.CostLru` keyed by
  ``(experiment, run, tag, max_step, generation)``: ``max_step`` comes from the cheap
  listing, so a live run's new records are read on the next request;
- the way from a run name to its directory inside the logdir (:meth:`Reader.run_dir`,
  for live tuning).

Nothing here knows HTTP: errors are TensorBoard's typed errors (``NotFoundError``,
``InvalidArgumentError``) and :class:`tb_plugin.layout.DataContractError`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from tensorboard import errors
from tensorboard.data import provider

from tb_plugin import fast_read, metadata, tuning
from tb_plugin.cache import CostLru
from tb_plugin.layout import DataContractError, Layout, cached_layout
from tb_plugin.levels import LevelStore, SeriesLevels
from tb_plugin.run_files import RunGenerations

# Steps asked of the data provider per time series; ``read_tensors`` caps its answer at
# this many, so it is large: thinning is done by the routes, to their point budget.
READ_DOWNSAMPLE = 1_000_000  # steps

SERIES_CACHE_BYTES = 1024 * 2**20  # bytes of decoded steps + levels kept (all runs, tags)
RECORDS_CACHE_BYTES = 64 * 2**20  # bytes of decoded json records kept (all runs, all tags)
# How long a listing of every run's tags (with max_step) is reused, seconds. The Rust data
# server's ListTensors scans every stored point for max_step (about 0.4 s for 10 runs of
# 100,000 steps), and every request needs it; TensorBoard itself reloads the logdir every
# 5 s by default, so a listing this young hides at most one reload.
LISTING_TTL_SECONDS = 2.0
# A listing older than the TTL but younger than this is still answered from at once while
# a background thread lists again (stale-while-revalidate), so the view's 5-s poll of
# /runs never waits for the scan; older than this, the request lists and waits. Seconds.
LISTING_STALE_SECONDS = 60.0

# The background indexer runs at most once per this many seconds (TensorBoard reloads
# the logdir every 5 s by default); each run re-reads only the series that grew.
INDEX_INTERVAL_SECONDS = 5.0
# Tags the indexer brings up to date first: what the view's first paint draws.
INDEX_ORDER = (
    metadata.TAG_TIERS,
    metadata.TAG_READINGS,
    metadata.TAG_RUN_INFO,
    metadata.TAG_CONFIG_EVENT,
    metadata.TAG_PAGES,
    metadata.TAG_TIMING,
)

logger = logging.getLogger(__name__)

Listing = dict[str, dict[str, Any]]  # run -> tag -> provider.TensorTimeSeries


class Reader:
    """Reads and caches memory_hierarchy summaries for the routes (one per plugin).

    Args:
        data_provider: TensorBoard's data provider.
        logdir: TensorBoard's ``--logdir`` ("" when there is none, e.g. ``--logdir_spec``);
            only :meth:`run_dir` uses it.
        series_cache_bytes: budget of the decoded steps and their levels (bytes).
        records_cache_bytes: budget of the decoded json-records cache (bytes).
        index_in_background: when True (default), each new listing wakes a background
            thread that brings every series' levels up to date (see the module docstring).
        on_indexed: called by the background indexer as ``on_indexed(ctx, experiment,
            run, tag)`` after it brought a matrix or vector series up to date (the plugin
            encodes the view's first answers there); its errors are logged and ignored.
        index_json_tags: json tags the indexer also reads into the records cache.

    Thread-safe: TensorBoard serves requests from a thread pool.
    """

    def __init__(
        self,
        data_provider: Any,
        logdir: str = "",
        series_cache_bytes: int = SERIES_CACHE_BYTES,
        records_cache_bytes: int = RECORDS_CACHE_BYTES,
        index_in_background: bool = True,
        on_indexed: Callable[[Any, str, str, str], None] | None = None,
        index_json_tags: tuple[str, ...] = (),
    ) -> None:
        self._data_provider = data_provider
        self.logdir = logdir
        self._generations = RunGenerations()
        self._levels = LevelStore(series_cache_bytes)
        self._records_cache: CostLru[list[dict[str, Any]]] = CostLru(records_cache_bytes)
        self._listing_lock = threading.Lock()
        self._listings: dict[str, tuple[float, Listing]] = {}  # experiment -> (time, listing)
        self._listing_refreshes: set[str] = set()  # experiments being listed in background
        self._indexing = False  # the background indexer is running
        self._indexed_at = -math.inf  # time.monotonic() when it last finished
        self.index_in_background = index_in_background
        self._on_indexed = on_indexed
        self._index_json_tags = index_json_tags

    # -- the listing ----------------------------------------------------------------------
    def listing(self, ctx: Any, experiment: str) -> Listing:
        """Every run's memory_hierarchy time series (metadata, max_step).

        Fresh for LISTING_TTL_SECONDS; then, up to LISTING_STALE_SECONDS, the cached one is
        returned while one background thread lists again; older, this call lists and waits.
        """
        with self._listing_lock:
            cached = self._listings.get(experiment)
            age = time.monotonic() - cached[0] if cached is not None else math.inf
            if age < LISTING_TTL_SECONDS:
                return cached[1]  # type: ignore[index]
            if age < LISTING_STALE_SECONDS:
                if experiment not in self._listing_refreshes:
                    self._listing_refreshes.add(experiment)
                    threading.Thread(
                        target=self._refresh_listing,
                        args=(ctx, experiment),
                        name="memory_hierarchy-listing",
                        daemon=True,
                    ).start()
                return cached[1]  # type: ignore[index]
        return self._refresh_listing(ctx, experiment)

    def _refresh_listing(self, ctx: Any, experiment: str) -> Listing:
        """List every run's time series now and keep the answer."""
        try:
            listing = self._data_provider.list_tensors(
                ctx, experiment_id=experiment, plugin_name=metadata.PLUGIN_NAME
            )
            with self._listing_lock:
                self._listings[experiment] = (time.monotonic(), listing)
            self._kick_indexer(ctx, experiment, listing)
            return listing
        finally:
            with self._listing_lock:
                self._listing_refreshes.discard(experiment)

    # -- the background indexer ------------------------------------------------------------
    def _kick_indexer(self, ctx: Any, experiment: str, listing: Listing) -> None:
        """Start the background indexer over ``listing`` unless it is running or ran less
        than INDEX_INTERVAL_SECONDS ago (or indexing is off)."""
        if not self.index_in_background:
            return
        with self._listing_lock:
            now = time.monotonic()
            if self._indexing or now - self._indexed_at < INDEX_INTERVAL_SECONDS:
                return
            self._indexing = True
        threading.Thread(
            target=self._index,
            args=(ctx, experiment, listing),
            name="memory_hierarchy-indexer",
            daemon=True,
        ).start()

    def _index(self, ctx: Any, experiment: str, listing: Listing) -> None:
        """Bring every matrix and vector series of the listing up to its max_step, the
        tags the view draws first before the others, the most recent runs first."""
        try:
            order = {tag: i for i, tag in enumerate(INDEX_ORDER)}
            latest = {
                run: max((s.max_wall_time for s in tags.values()), default=0.0)
                for run, tags in listing.items()
            }
            jobs = sorted(
                ((run, tag) for run, tags in listing.items() for tag in tags),
                key=lambda rt: (order.get(rt[1], len(order)), -latest[rt[0]], rt[0]),
            )
            for run, tag in jobs:
                series = listing[run][tag]
                try:
                    if cached_layout(series.plugin_content, run, tag).kind == metadata.KIND_JSON:
                        if tag in self._index_json_tags:
                            self.records(ctx, experiment, run, tag)
                        continue
                    self.series_levels(ctx, experiment, run, tag)
                    if self._on_indexed is not None:
                        self._on_indexed(ctx, experiment, run, tag)
                except Exception as exc:  # noqa: BLE001 - a request reports it; go on
                    logger.debug("indexing %r/%r failed: %s", run, tag, exc)
        finally:
            with self._listing_lock:
                self._indexing = False
                self._indexed_at = time.monotonic()

    def require_run(self, ctx: Any, experiment: str, run: str) -> dict[str, Any]:
        """The run's tags (tag -> time series) from the listing.

        Raises:
            NotFoundError: the run has no memory_hierarchy data.
        """
        tags = self.listing(ctx, experiment).get(run)
        if tags is None:
            raise errors.NotFoundError(f"no memory_hierarchy run {run[:80]!r} in this logdir")
        return tags

    def layout(self, ctx: Any, experiment: str, run: str, tag: str) -> tuple[Layout, int]:
        """The layout of one time series and its ``max_step`` (from the listing).

        Raises:
            NotFoundError: no such run or tag.
            DataContractError: undecodable metadata.
        """
        series = self.listing(ctx, experiment).get(run, {}).get(tag)
        if series is None:
            raise errors.NotFoundError(f"no memory_hierarchy data for run {run!r}, tag {tag!r}")
        return cached_layout(series.plugin_content, run, tag), int(series.max_step)

    # -- matrix and vector tags -------------------------------------------------------------
    def series_levels(self, ctx: Any, experiment: str, run: str, tag: str) -> SeriesLevels:
        """Every stored step of a matrix or vector tag, with its min/max levels, brought
        up to the listing's ``max_step`` (only the new steps are decoded and folded in).

        Hold the returned object's ``lock`` while reading it with more than one call.

        Raises:
            NotFoundError: no such run or tag.
            InvalidArgumentError: the tag is a json tag.
            DataContractError: undecodable metadata or a tensor of the wrong shape.
        """
        layout, max_step = self.layout(ctx, experiment, run, tag)
        if layout.kind == metadata.KIND_JSON:
            raise errors.InvalidArgumentError(f"tag {tag!r} is a json tag; read it from /json")
        key = (experiment, run, tag)
        generation = self.generation(run)
        levels = self._levels.get(key)
        if levels is None or levels.layout != layout:
            levels = self._levels.setdefault(key, SeriesLevels(layout, generation))
        if levels.generation != generation or levels.last_step > max_step:
            # the run's files were replaced (a rerun into the same logdir): read it anew
            levels = SeriesLevels(layout, generation)
            self._levels.put(key, levels)
        if levels.last_step < max_step:
            with levels.lock:
                if levels.last_step < max_step:  # not brought up to date meanwhile
                    levels = self._extend(ctx, experiment, run, tag, levels)
        return levels

    def levels_step(self, experiment: str, run: str, tag: str) -> int | None:
        """The last step the series' levels hold now (no read), or None if never read."""
        levels = self._levels.get((experiment, run, tag))
        return None if levels is None else levels.last_step

    def _extend(
        self, ctx: Any, experiment: str, run: str, tag: str, levels: SeriesLevels
    ) -> SeriesLevels:
        """Read the series and fold the steps after ``levels.last_step`` into ``levels``
        (called with its lock held). If the stored steps before it changed (a restarted
        run's steps replaced), a new SeriesLevels is built from every step instead."""
        layout, after = levels.layout, levels.last_step
        skipped, new = self._decode(ctx, experiment, run, tag, layout, after)
        if skipped != levels.n:  # earlier steps changed: start again from every step
            fresh = SeriesLevels(layout, levels.generation)
            with fresh.lock:
                _skipped, everything = self._decode(ctx, experiment, run, tag, layout, -1)
                fresh.append(*everything)
            self._levels.put((experiment, run, tag), fresh)
            return fresh
        levels.append(*new)
        self._levels.touch((experiment, run, tag))
        return levels

    def _decode(
        self, ctx: Any, experiment: str, run: str, tag: str, layout: Layout, after: int
    ) -> tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(points at or before step ``after``, (steps, wall times, cells) of the points
        after it): read straight from the data server when that applies
        (``fast_read.read_series``), else through the public ``read_tensors``."""
        fast = fast_read.read_series(
            self._data_provider,
            experiment,
            metadata.PLUGIN_NAME,
            run,
            tag,
            READ_DOWNSAMPLE,
            layout.shape,
            after_step=after,
        )
        if fast is None:
            return self._decode_after(ctx, experiment, run, tag, layout, after)
        return fast.skipped, (fast.steps, fast.wall_times, fast.cells)

    def _read(self, ctx: Any, experiment: str, run: str, tag: str) -> list[provider.TensorDatum]:
        data = self._data_provider.read_tensors(
            ctx,
            experiment_id=experiment,
            plugin_name=metadata.PLUGIN_NAME,
            downsample=READ_DOWNSAMPLE,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]),
        )
        return data.get(run, {}).get(tag, [])

    def _decode_after(
        self, ctx: Any, experiment: str, run: str, tag: str, layout: Layout, after: int
    ) -> tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(points at or before step ``after``, (steps, wall times, cells) of the points
        after it) through the public ``read_tensors``."""
        everything = self._read(ctx, experiment, run, tag)
        data = [d for d in everything if d.step > after]
        width = int(np.prod(layout.shape))
        cells = np.empty((len(data), width), dtype=np.float64)  # [N, rows*columns]
        for i, datum in enumerate(data):
            array = np.asarray(datum.numpy, dtype=np.float64)
            if array.ndim == 1 and array.size in metadata.LEGACY_WIDTHS.get(tag, ()):
                # an older writer's vector: the columns added since are not measured
                array = np.concatenate([array, np.full(layout.shape[0] - array.size, np.nan)])
            if array.shape != layout.shape:
                raise DataContractError(
                    f"run {run!r}, tag {tag!r}, step {datum.step}: tensor shape "
                    f"{array.shape} does not match the layout's {layout.shape}"
                )
            cells[i] = array.ravel()
        steps = np.fromiter((d.step for d in data), dtype=np.int64, count=len(data))
        walls = np.fromiter((d.wall_time for d in data), dtype=np.float64, count=len(data))
        return len(everything) - len(data), (steps, walls, cells)

    # -- json tags -------------------------------------------------------------------------
    def records(self, ctx: Any, experiment: str, run: str, tag: str) -> list[dict[str, Any]]:
        """Every record of one json tag of one run, from the cache when unchanged.

        Returns:
            ``[{"step": int, "wall_time": float (s since the epoch), "value": decoded
            JSON}]`` sorted by step. The list is shared with the cache: do not modify it.

        Raises:
            NotFoundError: no such run or tag.
            InvalidArgumentError: the tag is not a json tag.
            DataContractError: undecodable metadata or a record that is not UTF-8 JSON.
        """
        layout, max_step = self.layout(ctx, experiment, run, tag)
        if layout.kind != metadata.KIND_JSON:
            raise errors.InvalidArgumentError(
                f"tag {tag!r} is a {layout.kind} tag; read it from /series"
            )

        def compute() -> tuple[list[dict[str, Any]], int]:
            events = []
            cost = 0
            for datum in self._read(ctx, experiment, run, tag):
                raw = np.asarray(datum.numpy).reshape(()).item()  # bytes (or str)
                try:
                    value = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
                except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as exc:
                    raise DataContractError(
                        f"run {run!r}, tag {tag!r}, step {datum.step}: record is not UTF-8 JSON"
                    ) from exc
                cost += len(raw) + 64
                events.append(
                    {"step": int(datum.step), "wall_time": float(datum.wall_time), "value": value}
                )
            return events, cost

        key = ("json", experiment, run, tag, max_step, self.generation(run))
        return self._records_cache.get_or_compute(key, compute)

    def records_if_any(self, ctx: Any, experiment: str, run: str, tag: str) -> list[dict]:
        """:meth:`records`, or [] when the run has none of that tag."""
        if tag not in self.listing(ctx, experiment).get(run, {}):
            return []
        return self.records(ctx, experiment, run, tag)

    # -- run directories -------------------------------------------------------------------
    def generation(self, run: str) -> int:
        """The generation of the run's event files (:mod:`tb_plugin.run_files`): part of
        every cache key of the run, so a run whose files were replaced is read anew."""
        return self._generations.generation(self.logdir, run)

    def run_dir(self, ctx: Any, experiment: str, run: str) -> str:
        """The run's directory inside the logdir (see :func:`tuning.resolve_run_dir`).

        Raises:
            InvalidArgumentError: no local logdir, or a run outside it.
            NotFoundError: not a run with memory_hierarchy data.
        """
        return tuning.resolve_run_dir(self.logdir, run, self.listing(ctx, experiment))
