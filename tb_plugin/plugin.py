"""HTTP read side of the Memory Hierarchy View: the TensorBoard plugin backend.

The plugin reads summaries only through TensorBoard's data provider (``list_tensors`` and
``read_tensors``), so it serves the same answers whether TensorBoard runs with
``--load_fast=true`` (the Rust data server) or ``--load_fast=false`` (the Python
multiplexer). Layouts and tag names come from :mod:`tb_plugin.metadata`, the one module
shared with the write side.

Every data route is split in two, as in TensorBoard's scalar plugin: a ``*_route`` that
parses and validates the request, and a ``*_impl`` that takes plain arguments and returns
JSON-ready data. Errors are typed: :class:`tensorboard.errors.InvalidArgumentError` (400),
:class:`tensorboard.errors.NotFoundError` (404) and :class:`DataContractError` (500, the
stored summaries cannot be decoded, for example a newer schema version); each becomes a
JSON body ``{"error": {"code": <http status>, "message": <text>}}``. ``docs/http_api.md``
documents every route with its JSON shape and units.

Keeping every step: TensorBoard itself samples summaries per plugin (100 steps with the
Rust server, 10 with the Python one) unless started with
``--samples_per_plugin=memory_hierarchy=0``, which keeps every step. The plugin then reads
all stored steps and thins each answer to a point budget with :func:`peak_keeping_indices`,
which never drops a bucket's minimum or maximum, so a tier's peak stays visible.

Caching: decoding every stored step is the expensive part of a request (a 100,000-step
series is 100,000 tensor protos), so the decoded steps of each series are kept in a
:class:`tb_plugin.cache.CostLru` keyed by ``(experiment, run, tag, max_step)``, and the
encoded (gzipped) answers likewise plus their parameters. ``max_step`` comes from the
cheap ``list_tensors`` listing, so new steps of a live run are read on the next request.

Exports: ``/series`` and ``/json`` take ``format=json|csv``; either answers as a download
(``Content-Disposition: attachment``), built by :mod:`tb_plugin.export`. ``points=0``
asks ``/series`` for every stored step.

Live tuning (issue #9): ``GET /tuning`` shows a run's tunable keys, their values in effect
and the latest request's state; ``POST /tune`` writes a request through
:func:`zero_runtime.control.write_request`, only when TensorBoard was started with
``--memory_hierarchy_tuning`` (:mod:`tb_plugin.loader`); the checks are in
:mod:`tb_plugin.tuning`. ``GET /oom`` returns a run's latest out-of-memory post-mortem.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from tb_plugin import export, fast_read, metadata, origin, tuning
from tb_plugin.cache import CostLru
from zero_runtime import control

# Steps asked of the data provider per time series; ``read_tensors`` caps its answer at
# this many, so it is large: thinning is done here, by the point budget below.
READ_DOWNSAMPLE = 1_000_000  # steps

DEFAULT_POINTS = 2000  # points per series in a /series answer when ?points is absent
FULL_POINTS = 0  # ?points=0: every stored step, not thinned (for exports)
MIN_POINTS = 2  # smallest accepted ?points other than FULL_POINTS
MAX_POINTS = 50_000  # largest accepted ?points
MAX_QUERY_VALUE_CHARS = 1024  # characters; a longer run or tag is refused with 400
FORMATS = ("json", "csv")  # accepted ?format values; either answers as a download

SERIES_CACHE_BYTES = 512 * 2**20  # bytes of decoded steps kept (all runs, all tags)
ANSWER_CACHE_BYTES = 64 * 2**20  # bytes of encoded, gzipped answers kept
GZIP_LEVEL = 3  # the level TensorBoard's http_util uses
# How long a listing of every run's tags (with max_step) is reused, seconds. The Rust data
# server's ListTensors scans every stored point for max_step (about 0.4 s for 10 runs of
# 100,000 steps), and every request needs it; TensorBoard itself reloads the logdir every
# 5 s by default, so a listing this young hides at most one reload.
LISTING_TTL_SECONDS = 2.0
# A listing older than the TTL but younger than this is still answered from at once while
# a background thread lists again (stale-while-revalidate), so the view's 5-s poll of
# /runs never waits for the scan; older than this, the request lists and waits. Seconds.
LISTING_STALE_SECONDS = 60.0

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")

# Content types of the static assets the frontend build produces; other files are 404.
_CONTENT_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".map": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
# A static asset is a plain file name in STATIC_DIR: no separators, no leading dot, no
# percent sign (so neither encoded nor doubly encoded ".." can get through).
_ASSET_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
_POINTS_ARG = re.compile(r"[0-9]{1,9}")
_FORMAT_ARG = re.compile(r"[a-z]{1,8}")

_STATIC_PREFIX = f"/data/plugin/{metadata.PLUGIN_NAME}/"


class DataContractError(errors.PublicError):
    """Stored summaries that this reader cannot decode (HTTP 500).

    Raised for a schema version newer than :data:`tb_plugin.metadata.SCHEMA_VERSION`,
    a metadata content that is not the documented JSON object, or a tensor whose shape
    does not match its layout. The message names the run, the tag and the reason.
    """

    http_code = 500

    def __init__(self, details: str) -> None:
        super().__init__(f"Cannot decode memory_hierarchy data: {details}")


@dataclass(frozen=True)
class Layout:
    """A tag's layout as stored in its summary metadata (see :mod:`tb_plugin.metadata`)."""

    version: int
    kind: str  # metadata.KIND_MATRIX | KIND_VECTOR | KIND_JSON
    rows: tuple[str, ...]  # matrix row names; empty for vector and json
    columns: tuple[str, ...]  # column names; empty for json
    units: tuple[str, ...]  # parallel to columns

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor shape one datum of this layout has."""
        if self.kind == metadata.KIND_MATRIX:
            return (len(self.rows), len(self.columns))
        if self.kind == metadata.KIND_VECTOR:
            return (len(self.columns),)
        return ()


def parse_layout(content: bytes, run: str, tag: str) -> Layout:
    """Decode a summary's plugin content into a :class:`Layout`.

    Args:
        content: ``plugin_data.content`` of the time series.
        run: the run name, for error messages.
        tag: the tag name, for error messages.

    Returns:
        The layout.

    Raises:
        DataContractError: newer schema version, or not the documented JSON object.
    """
    try:
        parsed = metadata.parse_plugin_metadata(content)
    except ValueError as exc:  # includes metadata.UnsupportedSchemaError
        raise DataContractError(f"run {run!r}, tag {tag!r}: {exc}") from exc
    kind = parsed.get("kind")
    if kind not in (metadata.KIND_MATRIX, metadata.KIND_VECTOR, metadata.KIND_JSON):
        raise DataContractError(f"run {run!r}, tag {tag!r}: unknown layout kind {kind!r}")
    try:
        rows, columns, units = (
            tuple(str(x) for x in parsed.get(key, [])) for key in ("rows", "columns", "units")
        )
    except TypeError as exc:
        raise DataContractError(f"run {run!r}, tag {tag!r}: malformed layout") from exc
    return Layout(parsed["version"], kind, rows, columns, units)


def peak_keeping_indices(values: np.ndarray, budget: int) -> np.ndarray:
    """Choose which steps of a set of aligned series to keep, keeping every peak.

    The steps are cut into equal buckets; in each bucket the first step holding each
    series' minimum and the first holding its maximum are kept, as are the first and the
    last step. If the union is larger than ``budget`` neighbouring buckets are merged in
    pairs (keeping the larger maximum and the smaller minimum of the two) and the union
    taken again, until it fits. So the largest (and smallest) value of every series always
    survives, however far it is thinned; NaN cells are ignored. The steps are scanned once
    (cost O(N x S)); each merge costs O(buckets x S).

    Args:
        values: float array ``[N, S]``: N steps, S series sharing those steps.
        budget: the number of steps to aim for (>= 2). The answer has at most
            ``max(budget, 2 * S + 2)`` steps.

    Returns:
        Sorted int indices into the N steps (all of them when ``N <= budget``).
    """
    n = values.shape[0]
    if n <= budget:
        return np.arange(n)
    measured = values[:, ~np.all(np.isnan(values), axis=0)]  # [N, S'] drop all-NaN series
    highs = np.where(np.isnan(measured), -np.inf, measured)
    lows = np.where(np.isnan(measured), np.inf, measured)
    position = np.arange(n)[:, None]  # [N, 1]
    buckets = max(1, (budget - 2) // 2)
    starts = np.linspace(0, n, buckets + 1).astype(np.int64)[:-1]  # [B] bucket starts
    bucket_of = np.repeat(np.arange(buckets), np.diff(np.append(starts, n)))  # [N]
    picks = []  # per (series, reduce): [B, S'] the step of each bucket's extreme
    for series, reduce in ((highs, np.maximum), (lows, np.minimum)):
        extreme = reduce.reduceat(series, starts, axis=0)  # [B, S'] per-bucket extreme
        at_extreme = np.where(series == extreme[bucket_of], position, n)  # [N, S']
        picks.append((series, np.minimum.reduceat(at_extreme, starts, axis=0)))
    columns = np.arange(measured.shape[1])[None, :]  # [1, S']
    ends = np.array([0, n - 1])
    while True:
        kept = np.unique(np.concatenate([ends] + [pos.ravel() for _s, pos in picks]))
        kept = kept[kept < n]
        if len(kept) <= budget or len(picks[0][1]) == 1:
            return kept
        merged = []
        for (series, pos), better in zip(picks, (np.greater, np.less)):
            pairs = len(pos) // 2
            left, right = pos[0 : 2 * pairs : 2], pos[1 : 2 * pairs : 2]  # [B/2, S']
            take_right = better(series[np.minimum(right, n - 1), columns], series[left, columns])
            take_right &= right < n
            out = np.where(take_right, right, left)
            if len(pos) % 2:
                out = np.vstack([out, pos[-1:]])
            merged.append((series, out))
        picks = merged


def _json_floats(values: np.ndarray) -> list[float | None]:
    """Float list for JSON: NaN and infinities become None (JSON null)."""
    return [v if math.isfinite(v) else None for v in values.tolist()]


def _json_errors(route: Callable[[Any, wrappers.Request], wrappers.Response]) -> Callable:
    """Wrap a route so typed errors become JSON bodies with their HTTP status."""

    @functools.wraps(route)
    def wrapper(self: Any, request: wrappers.Request) -> wrappers.Response:
        try:
            return route(self, request)
        except errors.PublicError as exc:
            body = {"error": {"code": exc.http_code, "message": str(exc)}}
            return http_util.Respond(
                request, body, "application/json", code=exc.http_code, headers=exc.headers
            )

    return wrapper


def _required_arg(request: wrappers.Request, name: str) -> str:
    """A non-empty query value of bounded length, or InvalidArgumentError."""
    value = request.args.get(name)
    if not value:
        raise errors.InvalidArgumentError(f"query parameter {name!r} is required")
    if len(value) > MAX_QUERY_VALUE_CHARS:
        raise errors.InvalidArgumentError(
            f"query parameter {name!r} is longer than {MAX_QUERY_VALUE_CHARS} characters"
        )
    return value


def _points_arg(request: wrappers.Request) -> int:
    """The ?points budget: 0 (every step) or an integer in [MIN_POINTS, MAX_POINTS].

    Default DEFAULT_POINTS.
    """
    raw = request.args.get("points")
    if raw is None:
        return DEFAULT_POINTS
    if not _POINTS_ARG.fullmatch(raw) or not (
        int(raw) == FULL_POINTS or MIN_POINTS <= int(raw) <= MAX_POINTS
    ):
        raise errors.InvalidArgumentError(
            f"query parameter 'points' must be {FULL_POINTS} (every step) or an integer in "
            f"[{MIN_POINTS}, {MAX_POINTS}], got {raw[:40]!r}"
        )
    return int(raw)


def _format_arg(request: wrappers.Request) -> str | None:
    """The ?format of a download: None (plain answer), 'json' or 'csv'."""
    raw = request.args.get("format")
    if raw is None:
        return None
    if not _FORMAT_ARG.fullmatch(raw) or raw not in FORMATS:
        raise errors.InvalidArgumentError(
            f"query parameter 'format' must be one of {list(FORMATS)}, got {raw[:40]!r}"
        )
    return raw


def _run_path_arg(request: wrappers.Request) -> str:
    """The ?run of a route that names a run's directory: required, bounded, and a relative
    path inside the logdir (no absolute path, ``..`` part, backslash or NUL), else
    InvalidArgumentError (400). The same rule as :func:`tb_plugin.tuning.resolve_run_dir`.
    """
    run = _required_arg(request, "run")
    if (
        "\0" in run
        or "\\" in run
        or os.path.isabs(run)
        or any(part == ".." for part in run.split("/"))
    ):
        raise errors.InvalidArgumentError(f"run {run[:80]!r} is not a path inside the logdir")
    return run


# Fields of a memory_hierarchy/checkpoint record served by /checkpoints (docs/events.md).
_CHECKPOINT_FIELDS = (
    "op",
    "tag",
    "path",
    "bytes",
    "seconds",
    "replicas",
    "rank",
    "saved_replicas",
)
# Order of a save and a restore at one step in /checkpoints (a record of another op: last).
_CHECKPOINT_OP_ORDER = {"save": 0, "restore": 1}


def _checkpoint_op_order(op: Any) -> int:
    """Sort rank of a checkpoint record's ``op``: save 0, restore 1, anything else 2."""
    return _CHECKPOINT_OP_ORDER.get(op, 2) if isinstance(op, str) else 2


def _rate(amount: Any, seconds: Any) -> float | None:
    """``amount / seconds`` (per second), or None unless both are finite numbers, s > 0."""
    numbers = (int, float)
    if (
        not isinstance(amount, numbers)
        or not isinstance(seconds, numbers)
        or isinstance(amount, bool)
        or isinstance(seconds, bool)
        or not math.isfinite(amount)
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        return None
    return float(amount) / float(seconds)


@dataclass(frozen=True)
class SeriesData:
    """Every stored step of one matrix or vector tag, decoded (a cache entry)."""

    layout: Layout
    steps: np.ndarray  # [N] int64
    wall_times: np.ndarray  # [N] float64, seconds since the epoch
    cells: np.ndarray  # [N, rows*columns] float64, NaN = not measured

    @property
    def nbytes(self) -> int:
        """Memory held by the arrays, bytes."""
        return int(self.steps.nbytes + self.wall_times.nbytes + self.cells.nbytes)


@dataclass(frozen=True)
class Answer:
    """An encoded, gzipped HTTP answer body (a cache entry)."""

    gzipped: bytes
    content_type: str
    headers: tuple[tuple[str, str], ...]


def _encode(text: str, content_type: str, headers: tuple[tuple[str, str], ...] = ()) -> Answer:
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=GZIP_LEVEL, mtime=0) as f:
        f.write(text.encode("utf-8"))
    return Answer(out.getvalue(), content_type, headers)


def _respond(request: wrappers.Request, answer: Answer) -> wrappers.Response:
    """Send a pre-gzipped answer (TensorBoard's Respond gunzips it for clients that must)."""
    return http_util.Respond(
        request,
        answer.gzipped,
        answer.content_type,
        content_encoding="gzip",
        headers=list(answer.headers),
    )


@functools.lru_cache(maxsize=4096)
def _cached_layout(content: bytes, run: str, tag: str) -> Layout:
    return parse_layout(content, run, tag)


def _ack_problem(run: str, ack: Any) -> str | None:
    """What is wrong with a run's acknowledgement file (naming it), or None (also absent)."""
    problem = None if ack is None else tuning.record_problem(ack)
    return None if problem is None else f"{control.ACK_FILE} of run {run[:80]!r}: {problem}"


def _ack_errors(run: str, ack: Any) -> list[str]:
    """``[reason]`` for /tuning's ``data_errors`` when the ack is malformed, else ``[]``."""
    problem = _ack_problem(run, ack)
    return [] if problem is None else [f"{problem}; skipped"]


class MemoryHierarchyPlugin(base_plugin.TBPlugin):
    """The Memory Hierarchy View: tier occupancy, page traffic and timing per run.

    Args:
        context: TensorBoard's ``TBContext``: ``data_provider``, ``logdir`` (where runs'
            directories are, for live tuning) and ``flags`` (``memory_hierarchy_tuning``,
            absent = off) are used.
        static_dir: where the built frontend is (default :data:`STATIC_DIR`).
        series_cache_bytes: budget of the decoded-steps cache (bytes).
        answer_cache_bytes: budget of the encoded-answers cache (bytes).
    """

    plugin_name = metadata.PLUGIN_NAME

    def __init__(
        self,
        context: base_plugin.TBContext,
        static_dir: str = STATIC_DIR,
        series_cache_bytes: int = SERIES_CACHE_BYTES,
        answer_cache_bytes: int = ANSWER_CACHE_BYTES,
    ) -> None:
        self._data_provider = context.data_provider
        self._static_dir = static_dir
        self._series_cache: CostLru[SeriesData] = CostLru(series_cache_bytes)
        self._json_cache: CostLru[list[dict[str, Any]]] = CostLru(answer_cache_bytes)
        self._answer_cache: CostLru[Answer] = CostLru(answer_cache_bytes)
        self._listing_lock = threading.Lock()
        self._listings: dict[str, tuple[float, dict[str, dict[str, Any]]]] = {}
        self._listing_refreshes: set[str] = set()  # experiments being listed in background
        flags = getattr(context, "flags", None)
        self._flags = flags
        self._tuning_enabled = bool(getattr(flags, tuning.FLAG_NAME, False))
        self._logdir = getattr(context, "logdir", None) or getattr(flags, "logdir", None) or ""
        self._tune_lock = threading.Lock()  # one request written at a time (versions)

    # -- TBPlugin interface ----------------------------------------------------------------
    def get_plugin_apps(self) -> dict[str, Callable]:
        """Map routes (under ``/data/plugin/memory_hierarchy``) to WSGI apps."""
        return {
            "/runs": self.runs_route,
            "/series": self.series_route,
            "/json": self.json_route,
            "/tuning": self.tuning_route,
            "/tune": self.tune_route,
            "/oom": self.oom_route,
            "/checkpoints": self.checkpoints_route,
            "/*": self.static_route,
        }

    def is_active(self) -> bool:
        """Return False at once: TensorBoard marks the plugin active by its data.

        ``data_plugin_names()`` matches the data provider's ``list_plugins()``, which is
        how TensorBoard enables the tab without this method scanning the logdir.
        """
        return False

    def data_plugin_names(self) -> tuple[str, ...]:
        """The summary plugin names whose data this plugin reads."""
        return (metadata.PLUGIN_NAME,)

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        """Load the frontend as an ES module in an iframe (``/index.js``, ``render()``)."""
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Memory Hierarchy")

    # -- data access ------------------------------------------------------------------------
    def _listing(self, ctx: Any, experiment: str) -> dict[str, dict[str, Any]]:
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

    def _refresh_listing(self, ctx: Any, experiment: str) -> dict[str, dict[str, Any]]:
        """List every run's time series now and keep the answer."""
        try:
            listing = self._data_provider.list_tensors(
                ctx, experiment_id=experiment, plugin_name=metadata.PLUGIN_NAME
            )
            with self._listing_lock:
                self._listings[experiment] = (time.monotonic(), listing)
            return listing
        finally:
            with self._listing_lock:
                self._listing_refreshes.discard(experiment)

    def _layout(self, ctx: Any, experiment: str, run: str, tag: str) -> tuple[Layout, int]:
        """The layout of one time series and its ``max_step`` (from the listing)."""
        series = self._listing(ctx, experiment).get(run, {}).get(tag)
        if series is None:
            raise errors.NotFoundError(f"no memory_hierarchy data for run {run!r}, tag {tag!r}")
        return _cached_layout(series.plugin_content, run, tag), int(series.max_step)

    def _read(self, ctx: Any, experiment: str, run: str, tag: str) -> list[provider.TensorDatum]:
        data = self._data_provider.read_tensors(
            ctx,
            experiment_id=experiment,
            plugin_name=metadata.PLUGIN_NAME,
            downsample=READ_DOWNSAMPLE,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]),
        )
        return data.get(run, {}).get(tag, [])

    def _decode_series(
        self, ctx: Any, experiment: str, run: str, tag: str, layout: Layout
    ) -> SeriesData:
        """Read and decode every stored step of a matrix or vector tag."""
        fast = fast_read.read_series(
            self._data_provider,
            experiment,
            metadata.PLUGIN_NAME,
            run,
            tag,
            READ_DOWNSAMPLE,
            layout.shape,
        )
        if fast is not None:
            return SeriesData(layout, fast.steps, fast.wall_times, fast.cells)
        data = self._read(ctx, experiment, run, tag)
        width = int(np.prod(layout.shape))
        cells = np.empty((len(data), width), dtype=np.float64)  # [N, rows*columns]
        for i, datum in enumerate(data):
            array = np.asarray(datum.numpy, dtype=np.float64)
            if array.shape != layout.shape:
                raise DataContractError(
                    f"run {run!r}, tag {tag!r}, step {datum.step}: tensor shape "
                    f"{array.shape} does not match the layout's {layout.shape}"
                )
            cells[i] = array.ravel()
        steps = np.fromiter((d.step for d in data), dtype=np.int64, count=len(data))
        walls = np.fromiter((d.wall_time for d in data), dtype=np.float64, count=len(data))
        return SeriesData(layout, steps, walls, cells)

    def series_data(self, ctx: Any, experiment: str, run: str, tag: str) -> SeriesData:
        """Every stored step of a matrix or vector tag, from the cache when unchanged.

        Raises:
            NotFoundError: no such run or tag.
            InvalidArgumentError: the tag is a json tag.
            DataContractError: undecodable metadata or a tensor of the wrong shape.
        """
        layout, max_step = self._layout(ctx, experiment, run, tag)
        if layout.kind == metadata.KIND_JSON:
            raise errors.InvalidArgumentError(f"tag {tag!r} is a json tag; read it from /json")

        def compute() -> tuple[SeriesData, int]:
            data = self._decode_series(ctx, experiment, run, tag, layout)
            return data, data.nbytes

        return self._series_cache.get_or_compute((experiment, run, tag, max_step), compute)

    # -- /runs --------------------------------------------------------------------------------
    def runs_impl(self, ctx: Any, experiment: str) -> dict[str, Any]:
        """List the runs that have memory_hierarchy data, with their tags.

        Args:
            ctx: the request context.
            experiment: the experiment id.

        Returns:
            ``{"runs": [{"run": name, "tags": {tag: {"kind", "max_step",
            "max_wall_time"}}}]}`` sorted by run name. A tag whose metadata this reader
            cannot decode has ``"kind": null`` and an ``"error"`` message instead.
        """
        listing = self._listing(ctx, experiment)
        runs = []
        for run in sorted(listing):
            tags = {}
            for tag, series in sorted(listing[run].items()):
                entry: dict[str, Any] = {
                    "max_step": series.max_step,
                    "max_wall_time": series.max_wall_time,
                }
                try:
                    entry["kind"] = _cached_layout(series.plugin_content, run, tag).kind
                except DataContractError as exc:
                    entry["kind"] = None
                    entry["error"] = str(exc)
                tags[tag] = entry
            runs.append({"run": run, "tags": tags})
        return {"runs": runs}

    @wrappers.Request.application
    @_json_errors
    def runs_route(self, request: wrappers.Request) -> wrappers.Response:
        """GET /runs: see :meth:`runs_impl`."""
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        return http_util.Respond(request, self.runs_impl(ctx, experiment), "application/json")

    # -- /series ------------------------------------------------------------------------------
    def series_impl(
        self, ctx: Any, experiment: str, run: str, tag: str, points: int = DEFAULT_POINTS
    ) -> dict[str, Any]:
        """One matrix or vector tag of one run, as columnar arrays over steps.

        Args:
            ctx: the request context.
            experiment: the experiment id.
            run: the run name.
            tag: a matrix or vector tag.
            points: the point budget (see :func:`peak_keeping_indices`);
                :data:`FULL_POINTS` (0) returns every stored step.

        Returns:
            ``{"run", "tag", "kind", "rows", "columns", "units", "steps", "wall_times",
            "values", "total_steps", "downsampled"}``; ``values`` is ``{row: {column:
            [...]}}`` for a matrix and ``{column: [...]}`` for a vector, parallel to
            ``steps``, with null where the value was not measured (NaN).

        Raises:
            NotFoundError: no such run or tag.
            InvalidArgumentError: the tag is a json tag.
            DataContractError: undecodable metadata or a tensor of the wrong shape.
        """
        data = self.series_data(ctx, experiment, run, tag)
        layout, cells = data.layout, data.cells
        n = len(cells)
        keep = np.arange(n) if points == FULL_POINTS else peak_keeping_indices(cells, points)
        kept = cells[keep]
        columns = layout.columns
        if layout.kind == metadata.KIND_MATRIX:
            grid = kept.reshape(len(keep), len(layout.rows), len(columns))  # [K, R, C]
            values: dict[str, Any] = {
                row: {col: _json_floats(grid[:, r, c]) for c, col in enumerate(columns)}
                for r, row in enumerate(layout.rows)
            }
        else:
            values = {col: _json_floats(kept[:, c]) for c, col in enumerate(columns)}
        return {
            "run": run,
            "tag": tag,
            "kind": layout.kind,
            "rows": list(layout.rows),
            "columns": list(columns),
            "units": list(layout.units),
            "steps": data.steps[keep].tolist(),
            "wall_times": data.wall_times[keep].tolist(),
            "values": values,
            "total_steps": n,
            "downsampled": len(keep) < n,
        }

    def series_answer(
        self, ctx: Any, experiment: str, run: str, tag: str, points: int, fmt: str | None
    ) -> Answer:
        """The encoded /series answer, cached by (run, tag, max_step, points, format)."""
        _layout, max_step = self._layout(ctx, experiment, run, tag)

        def compute() -> tuple[Answer, int]:
            body = self.series_impl(ctx, experiment, run, tag, points)
            if fmt is None:
                answer = _encode(json.dumps(body), "application/json")
            else:
                suffix = "full" if points == FULL_POINTS else f"{points}points"
                text = json.dumps(body) if fmt == "json" else export.series_csv(body)
                content_type = "application/json" if fmt == "json" else "text/csv; charset=utf-8"
                disposition = export.content_disposition(run, tag, suffix, fmt)
                answer = _encode(text, content_type, (("Content-Disposition", disposition),))
            return answer, len(answer.gzipped)

        key = ("series", experiment, run, tag, max_step, points, fmt)
        return self._answer_cache.get_or_compute(key, compute)

    @wrappers.Request.application
    @_json_errors
    def series_route(self, request: wrappers.Request) -> wrappers.Response:
        """GET /series?run=R&tag=T[&points=N][&format=json|csv]: see :meth:`series_impl`.

        With ``format`` the answer is a download (``Content-Disposition: attachment``):
        the same JSON, or CSV (:func:`tb_plugin.export.series_csv`).
        """
        run = _required_arg(request, "run")
        tag = _required_arg(request, "tag")
        points = _points_arg(request)
        fmt = _format_arg(request)
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        return _respond(request, self.series_answer(ctx, experiment, run, tag, points, fmt))

    # -- /json ----------------------------------------------------------------------------------
    def json_impl(self, ctx: Any, experiment: str, run: str, tag: str) -> dict[str, Any]:
        """Every record of one json tag of one run.

        Args:
            ctx: the request context.
            experiment: the experiment id.
            run: the run name.
            tag: a json tag.

        Returns:
            ``{"run", "tag", "kind": "json", "events": [{"step", "wall_time", "value"}]}``
            with ``value`` the decoded JSON object, sorted by step.

        Raises:
            NotFoundError: no such run or tag.
            InvalidArgumentError: the tag is not a json tag.
            DataContractError: undecodable metadata or a record that is not JSON.
        """
        layout, max_step = self._layout(ctx, experiment, run, tag)
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

        events = self._json_cache.get_or_compute(("json", experiment, run, tag, max_step), compute)
        return {"run": run, "tag": tag, "kind": metadata.KIND_JSON, "events": events}

    @wrappers.Request.application
    @_json_errors
    def json_route(self, request: wrappers.Request) -> wrappers.Response:
        """GET /json?run=R&tag=T[&format=json|csv]: see :meth:`json_impl`.

        With ``format`` the answer is a download: the same JSON, or CSV
        (:func:`tb_plugin.export.json_csv`; placement as one row per variable).
        """
        run = _required_arg(request, "run")
        tag = _required_arg(request, "tag")
        fmt = _format_arg(request)
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        body = self.json_impl(ctx, experiment, run, tag)
        if fmt is None:
            return http_util.Respond(request, body, "application/json")
        text = json.dumps(body) if fmt == "json" else export.json_csv(body)
        content_type = "application/json" if fmt == "json" else "text/csv; charset=utf-8"
        disposition = export.content_disposition(run, tag, "all", fmt)
        return _respond(
            request, _encode(text, content_type, (("Content-Disposition", disposition),))
        )

    # -- /tuning and /tune ------------------------------------------------------------------
    def _latest_json(self, ctx: Any, experiment: str, run: str, tag: str) -> list[dict]:
        """Every record of a json tag of a run ([] when the run has none of that tag)."""
        if tag not in self._listing(ctx, experiment).get(run, {}):
            return []
        return self.json_impl(ctx, experiment, run, tag)["events"]

    def _run_dir(self, ctx: Any, experiment: str, run: str) -> str:
        """The run's directory inside the logdir (see :func:`tuning.resolve_run_dir`)."""
        return tuning.resolve_run_dir(self._logdir, run, self._listing(ctx, experiment))

    def tuning_impl(self, ctx: Any, experiment: str, run: str) -> dict[str, Any]:
        """A run's tunable keys, the values in effect and the latest request's state.

        Args:
            ctx: the request context.
            experiment: the experiment id.
            run: the run name.

        Returns:
            ``{"run", "enabled", "flag", "keys": [{"key", "unit", "min", "max",
            "description", "value", "recorded", "since_step", "version"}],
            "config_version",
            "request": tuning.request_state(...), "run_dir_error", "tuning_run",
            "tuning_note"}``: ``enabled`` is whether
            this TensorBoard may write requests; ``value`` the value in effect (null when
            the run never recorded it); ``config_version`` the version of the newest
            applied request (0: as started); ``run_dir_error`` says why the run's
            directory cannot be read (null normally; the request state is then "none").
            ``tuning_run`` is the run ``POST /tune`` writes to: ``run`` itself, or for a
            non-chief worker of a multi-worker job the chief's run
            (:func:`tuning.job_chief_run`), whose request and decision ``request`` then
            shows (the job's); ``tuning_note`` says so (null for an ordinary run).

        Raises:
            NotFoundError: the run has no memory_hierarchy data.
        """
        if run not in self._listing(ctx, experiment):
            raise errors.NotFoundError(f"no memory_hierarchy run {run[:80]!r} in this logdir")
        run_infos = self._latest_json(ctx, experiment, run, metadata.TAG_RUN_INFO)
        config = run_infos[-1]["value"].get("config") if run_infos else None
        events = self._latest_json(ctx, experiment, run, metadata.TAG_CONFIG_EVENT)
        data_errors = []
        for event in events:
            problem = tuning.record_problem(event["value"])
            if problem is not None:
                data_errors.append(
                    f"{metadata.TAG_CONFIG_EVENT} at step {event['step']}: {problem}; skipped"
                )
        request = ack = None
        run_dir_error = None
        try:
            run_dir = self._run_dir(ctx, experiment, run)
            request, ack = tuning.read_request(run_dir), control.read_ack(run_dir)
        except errors.InvalidArgumentError as exc:
            run_dir_error = str(exc)
        data_errors += _ack_errors(run, ack)
        values = tuning.current_values(config if isinstance(config, dict) else None, events, ack)
        keys = [{**spec, **values[spec["key"]]} for spec in tuning.tunable_keys()]
        # A non-chief worker: the job's request and decision live in the chief's run.
        chief = None if run_dir_error else tuning.job_chief_run(self._logdir, run)
        note = None
        if chief is not None:
            note = tuning.redirect_note(run, chief)
            try:
                chief_dir = self._run_dir(ctx, experiment, chief)
                request, ack = tuning.read_request(chief_dir), control.read_ack(chief_dir)
                data_errors += _ack_errors(chief, ack)
            except (errors.InvalidArgumentError, errors.NotFoundError):
                note += " This TensorBoard does not list that run, so it cannot tune the job."
        return {
            "run": run,
            "enabled": self._tuning_enabled,
            "flag": f"--{tuning.FLAG_NAME}",
            "keys": keys,
            "config_version": max((v["version"] for v in values.values()), default=0),
            "request": tuning.request_state(request, ack),
            "run_dir_error": run_dir_error,
            "tuning_run": chief or run,
            "tuning_note": note,
            "data_errors": data_errors,
        }

    @wrappers.Request.application
    @_json_errors
    def tuning_route(self, request: wrappers.Request) -> wrappers.Response:
        """GET /tuning?run=R: see :meth:`tuning_impl`."""
        run = _required_arg(request, "run")
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        return http_util.Respond(
            request, self.tuning_impl(ctx, experiment, run), "application/json"
        )

    def _require_tuning(self) -> None:
        """Raise TuningDisabledError unless started with ``--memory_hierarchy_tuning``."""
        if not self._tuning_enabled:
            raise tuning.TuningDisabledError(
                f"live tuning is off: start TensorBoard with --{tuning.FLAG_NAME} to let "
                "the tab change running jobs"
            )

    def tune_impl(
        self, ctx: Any, experiment: str, run: str, updates: dict[str, int]
    ) -> dict[str, Any]:
        """Write a live-tuning request for a run (``zero_runtime.control.write_request``).

        Args:
            ctx: the request context.
            experiment: the experiment id.
            run: the run name.
            updates: checked key -> int (see :func:`tuning.parse_tune_body`).

        Returns:
            ``{"run", "version", "updates", "request", "tuning_run", "redirected",
            "tuning_note"}``: the version written, the updates
            the request file now holds (a pending earlier request's are merged in) and
            its state (``"pending"`` until the job's next step boundary).
            ``tuning_run`` is the run written to: ``run``, or for a non-chief worker of a
            multi-worker job the chief's run (:func:`tuning.job_chief_run`: tuning
            applies to the whole job and only the chief reads requests), in which case
            ``redirected`` is true and ``tuning_note`` says so (else null).

        Raises:
            TuningDisabledError: TensorBoard runs without ``--memory_hierarchy_tuning``.
            InvalidArgumentError: the run's directory is not inside the logdir.
            NotFoundError: not a run of this logdir.
            ChiefRunMissingError: a non-chief worker's run whose chief run this
                TensorBoard does not list (409; nothing written).
        """
        self._require_tuning()
        run_dir = self._run_dir(ctx, experiment, run)
        chief = tuning.job_chief_run(self._logdir, run)
        if chief is not None:
            try:
                run_dir = self._run_dir(ctx, experiment, chief)
            except (errors.InvalidArgumentError, errors.NotFoundError) as exc:
                raise tuning.ChiefRunMissingError(
                    f"{run[:80]!r} is a worker of a multi-worker job whose live tuning is "
                    f"decided by the chief's run {chief[:80]!r}, which cannot be written "
                    f"here ({exc}); nothing was written"
                ) from exc
        with self._tune_lock:
            problem = _ack_problem(chief or run, control.read_ack(run_dir))
            if problem is not None:
                raise tuning.ControlFileError(
                    f"{problem}. Only the runtime writes that file: "
                    "remove it (the job writes a new one at its next decision) and try "
                    "again; nothing was written"
                )
            version = control.write_request(run_dir, updates)
            written = tuning.read_request(run_dir)
            ack = control.read_ack(run_dir)
        return {
            "run": run,
            "version": version,
            "updates": (written or {}).get("updates", updates),
            "request": tuning.request_state(written, ack),
            "tuning_run": chief or run,
            "redirected": chief is not None,
            "tuning_note": tuning.redirect_note(run, chief) if chief else None,
        }

    @wrappers.Request.application
    @_json_errors
    def tune_route(self, request: wrappers.Request) -> wrappers.Response:
        """POST /tune?run=R with ``{"updates": {...}}``: see :meth:`tune_impl`.

        Refused, with nothing written: another method (405); tuning off (403); without
        the header ``X-Memory-Hierarchy-Tuning: 1`` (403, so a cross-site form cannot post
        it); a Content-Type other than ``application/json`` (415); a body over
        ``tuning.MAX_BODY_BYTES`` (413); a body :func:`tuning.parse_tune_body` refuses
        or a run outside the logdir (400); an unknown run (404); a non-chief worker's
        run whose chief run is not listed (409). A worker's run is written to its chief's.
        """
        if request.method != "POST":
            raise tuning.MethodNotAllowedError("/tune accepts only POST", allow="POST")
        self._require_tuning()
        origin.check_same_origin(request.environ, self._flags, "POST /tune")
        if request.headers.get(tuning.HEADER_NAME) != tuning.HEADER_VALUE:
            raise errors.PermissionDeniedError(
                f"POST /tune needs the header {tuning.HEADER_NAME}: {tuning.HEADER_VALUE}"
            )
        if request.mimetype != tuning.CONTENT_TYPE:
            raise tuning.UnsupportedMediaTypeError(
                f"POST /tune needs Content-Type {tuning.CONTENT_TYPE}, "
                f"got {request.mimetype[:80]!r}"
            )
        limit = tuning.MAX_BODY_BYTES
        if request.content_length is not None and request.content_length > limit:
            raise tuning.PayloadTooLargeError(f"the body is larger than {limit} bytes")
        body = request.stream.read(limit + 1)
        if len(body) > limit:
            raise tuning.PayloadTooLargeError(f"the body is larger than {limit} bytes")
        run = _required_arg(request, "run")
        updates = tuning.parse_tune_body(body)
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        return http_util.Respond(
            request, self.tune_impl(ctx, experiment, run, updates), "application/json"
        )

    # -- /oom -------------------------------------------------------------------------------
    def oom_impl(self, ctx: Any, experiment: str, run: str) -> dict[str, Any]:
        """A run's latest out-of-memory post-mortem (the ``memory_hierarchy/oom`` tag).

        Args:
            ctx: the request context.
            experiment: the experiment id.
            run: the run name.

        Returns:
            ``{"run", "step", "wall_time", "count", "postmortem"}``: ``postmortem`` is the
            latest record's object as the runtime wrote it (the shared OOM contract, see
            ``docs/http_api.md``), ``count`` how many post-mortems the run recorded.

        Raises:
            NotFoundError: the run recorded no post-mortem.
            DataContractError: a record that is not UTF-8 JSON.
        """
        events = self.json_impl(ctx, experiment, run, metadata.TAG_OOM)["events"]
        if not events:
            raise errors.NotFoundError(f"run {run[:80]!r} recorded no out-of-memory post-mortem")
        last = events[-1]
        return {
            "run": run,
            "step": last["step"],
            "wall_time": last["wall_time"],
            "count": len(events),
            "postmortem": last["value"],
        }

    @wrappers.Request.application
    @_json_errors
    def oom_route(self, request: wrappers.Request) -> wrappers.Response:
        """GET /oom?run=R: see :meth:`oom_impl`."""
        run = _required_arg(request, "run")
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        return http_util.Respond(request, self.oom_impl(ctx, experiment, run), "application/json")

    # -- /checkpoints -------------------------------------------------------------------------
    def checkpoints_impl(self, ctx: Any, experiment: str, run: str) -> dict[str, Any]:
        """A run's checkpoint saves and restores: the ``memory_hierarchy/checkpoint`` and
        ``memory_hierarchy/checkpoint_restore`` tags merged (two tags so that TensorBoard's
        ``--load_fast``, one value per run, tag and step, keeps a save and a restore at one
        step; a run written before the restore tag existed has restores under the first).

        Args:
            ctx: the request context.
            experiment: the experiment id.
            run: the run name.

        Returns:
            ``{"run", "checkpoints": [{"step", "wall_time", "op", "tag", "path", "bytes",
            "seconds", "bytes_per_second", "replicas", "rank", "saved_replicas"}]}``
            sorted by ``(step, op)`` with a save before a restore (records of one step and
            op in the order read, an op other than these after both). Fields as the
            runtime wrote them (docs/events.md; a field it did not write is null):
            ``bytes`` (save: shard bytes this worker wrote; restore: bytes verified and
            read), ``seconds`` (wall time of the operation on this worker, s),
            ``saved_replicas`` (restore only). ``bytes_per_second`` is
            ``bytes / seconds`` (write bandwidth of a save, read bandwidth of a restore,
            bytes/s), null when either is missing, not a number or ``seconds <= 0``.
            A run without checkpoint records answers an empty list.

        Raises:
            NotFoundError: the run has no memory_hierarchy data.
            DataContractError: a record that is not a UTF-8 JSON object.
        """
        listing = self._listing(ctx, experiment)
        if run not in listing:
            raise errors.NotFoundError(f"no memory_hierarchy run {run[:80]!r} in this logdir")
        rows = []
        for tag in (metadata.TAG_CHECKPOINT, metadata.TAG_CHECKPOINT_RESTORE):
            if tag not in listing[run]:
                continue
            for event in self.json_impl(ctx, experiment, run, tag)["events"]:
                value = event["value"]
                if not isinstance(value, dict):
                    raise DataContractError(
                        f"run {run!r}, tag {tag!r}, step {event['step']}: "
                        "record is not a JSON object"
                    )
                row = {key: value.get(key) for key in _CHECKPOINT_FIELDS}
                row["step"], row["wall_time"] = event["step"], event["wall_time"]
                row["bytes_per_second"] = _rate(row["bytes"], row["seconds"])
                rows.append(row)
        # Stable: records of one step and op keep the order read.
        rows.sort(key=lambda r: (r["step"], _checkpoint_op_order(r["op"])))
        return {"run": run, "checkpoints": rows}

    @wrappers.Request.application
    @_json_errors
    def checkpoints_route(self, request: wrappers.Request) -> wrappers.Response:
        """GET /checkpoints?run=R: see :meth:`checkpoints_impl`.

        400 for a missing, empty or over-long run, or one that is not a relative path
        inside the logdir (absolute, ``..``, a backslash or a NUL: :func:`_run_path_arg`);
        404 for a run without memory_hierarchy data.
        """
        run = _run_path_arg(request)
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        return http_util.Respond(
            request, self.checkpoints_impl(ctx, experiment, run), "application/json"
        )

    # -- static assets ------------------------------------------------------------------------
    def static_impl(self, name: str) -> tuple[bytes, str]:
        """Read one built frontend asset from the static directory.

        Args:
            name: the file name requested (the path after the plugin prefix).

        Returns:
            ``(content, content_type)``.

        Raises:
            InvalidArgumentError: ``name`` is not a plain file name (separators,
                backslashes, ``..``, percent signs, absolute paths).
            NotFoundError: no such asset, or an asset type that is not served.
        """
        if not _ASSET_NAME.fullmatch(name):
            raise errors.InvalidArgumentError(f"not a static asset name: {name[:80]!r}")
        content_type = _CONTENT_TYPES.get(os.path.splitext(name)[1])
        root = os.path.realpath(self._static_dir)
        path = os.path.realpath(os.path.join(root, name))
        if content_type is None or os.path.dirname(path) != root or not os.path.isfile(path):
            hint = ""
            if name == "index.js":
                hint = " (the frontend is not built: run scripts/setup.sh)"
            raise errors.NotFoundError(f"no static asset {name!r}{hint}")
        with open(path, "rb") as f:
            return f.read(), content_type

    @wrappers.Request.application
    @_json_errors
    def static_route(self, request: wrappers.Request) -> wrappers.Response:
        """GET /<asset>: the built frontend (``index.js`` and what it loads)."""
        path = request.path
        name = path[len(_STATIC_PREFIX) :] if path.startswith(_STATIC_PREFIX) else path
        content, content_type = self.static_impl(name)
        return http_util.Respond(request, content, content_type)
