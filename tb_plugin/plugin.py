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
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from tb_plugin import metadata

# Steps asked of the data provider per time series; ``read_tensors`` caps its answer at
# this many, so it is large: thinning is done here, by the point budget below.
READ_DOWNSAMPLE = 1_000_000  # steps

DEFAULT_POINTS = 2000  # points per series in a /series answer when ?points is absent
MIN_POINTS = 2  # smallest accepted ?points
MAX_POINTS = 50_000  # largest accepted ?points
MAX_QUERY_VALUE_CHARS = 1024  # characters; a longer run or tag is refused with 400

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
    last step. If the union is larger than ``budget`` the buckets are halved and the
    choice redone. So the largest (and smallest) value of every series always survives,
    however far it is thinned; NaN cells are ignored.

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
    while True:
        starts = np.linspace(0, n, buckets + 1).astype(np.int64)[:-1]  # [B] bucket starts
        bucket_of = np.repeat(np.arange(buckets), np.diff(np.append(starts, n)))  # [N]
        chosen = [np.array([0, n - 1])]
        for series, reduce in ((highs, np.maximum), (lows, np.minimum)):
            extreme = reduce.reduceat(series, starts, axis=0)  # [B, S'] per-bucket extreme
            at_extreme = np.where(series == extreme[bucket_of], position, n)  # [N, S']
            chosen.append(np.minimum.reduceat(at_extreme, starts, axis=0).ravel())
        kept = np.unique(np.concatenate(chosen))
        kept = kept[kept < n]
        if len(kept) <= budget or buckets == 1:
            return kept
        buckets = max(1, buckets // 2)


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
    """The ?points budget: an integer in [MIN_POINTS, MAX_POINTS], default DEFAULT_POINTS."""
    raw = request.args.get("points")
    if raw is None:
        return DEFAULT_POINTS
    if not _POINTS_ARG.fullmatch(raw) or not MIN_POINTS <= int(raw) <= MAX_POINTS:
        raise errors.InvalidArgumentError(
            f"query parameter 'points' must be an integer in [{MIN_POINTS}, {MAX_POINTS}]"
            f", got {raw[:40]!r}"
        )
    return int(raw)


class MemoryHierarchyPlugin(base_plugin.TBPlugin):
    """The Memory Hierarchy View: tier occupancy, page traffic and timing per run.

    Args:
        context: TensorBoard's ``TBContext``; only ``context.data_provider`` is used.
    """

    plugin_name = metadata.PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext, static_dir: str = STATIC_DIR) -> None:
        self._data_provider = context.data_provider
        self._static_dir = static_dir

    # -- TBPlugin interface ----------------------------------------------------------------
    def get_plugin_apps(self) -> dict[str, Callable]:
        """Map routes (under ``/data/plugin/memory_hierarchy``) to WSGI apps."""
        return {
            "/runs": self.runs_route,
            "/series": self.series_route,
            "/json": self.json_route,
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
    def _layout(self, ctx: Any, experiment: str, run: str, tag: str) -> Layout:
        listing = self._data_provider.list_tensors(
            ctx,
            experiment_id=experiment,
            plugin_name=metadata.PLUGIN_NAME,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]),
        )
        series = listing.get(run, {}).get(tag)
        if series is None:
            raise errors.NotFoundError(f"no memory_hierarchy data for run {run!r}, tag {tag!r}")
        return parse_layout(series.plugin_content, run, tag)

    def _read(self, ctx: Any, experiment: str, run: str, tag: str) -> list[provider.TensorDatum]:
        data = self._data_provider.read_tensors(
            ctx,
            experiment_id=experiment,
            plugin_name=metadata.PLUGIN_NAME,
            downsample=READ_DOWNSAMPLE,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]),
        )
        return data.get(run, {}).get(tag, [])

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
        listing = self._data_provider.list_tensors(
            ctx, experiment_id=experiment, plugin_name=metadata.PLUGIN_NAME
        )
        runs = []
        for run in sorted(listing):
            tags = {}
            for tag, series in sorted(listing[run].items()):
                entry: dict[str, Any] = {
                    "max_step": series.max_step,
                    "max_wall_time": series.max_wall_time,
                }
                try:
                    entry["kind"] = parse_layout(series.plugin_content, run, tag).kind
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
            points: the point budget (see :func:`peak_keeping_indices`).

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
        layout = self._layout(ctx, experiment, run, tag)
        if layout.kind == metadata.KIND_JSON:
            raise errors.InvalidArgumentError(f"tag {tag!r} is a json tag; read it from /json")
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
        keep = peak_keeping_indices(cells, points)
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
            "steps": [int(data[i].step) for i in keep],
            "wall_times": [float(data[i].wall_time) for i in keep],
            "values": values,
            "total_steps": len(data),
            "downsampled": len(keep) < len(data),
        }

    @wrappers.Request.application
    @_json_errors
    def series_route(self, request: wrappers.Request) -> wrappers.Response:
        """GET /series?run=R&tag=T[&points=N]: see :meth:`series_impl`."""
        run = _required_arg(request, "run")
        tag = _required_arg(request, "tag")
        points = _points_arg(request)
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        body = self.series_impl(ctx, experiment, run, tag, points)
        return http_util.Respond(request, body, "application/json")

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
        layout = self._layout(ctx, experiment, run, tag)
        if layout.kind != metadata.KIND_JSON:
            raise errors.InvalidArgumentError(
                f"tag {tag!r} is a {layout.kind} tag; read it from /series"
            )
        events = []
        for datum in self._read(ctx, experiment, run, tag):
            raw = np.asarray(datum.numpy).reshape(()).item()  # bytes (or str)
            try:
                value = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
            except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as exc:
                raise DataContractError(
                    f"run {run!r}, tag {tag!r}, step {datum.step}: record is not UTF-8 JSON"
                ) from exc
            events.append(
                {"step": int(datum.step), "wall_time": float(datum.wall_time), "value": value}
            )
        return {"run": run, "tag": tag, "kind": metadata.KIND_JSON, "events": events}

    @wrappers.Request.application
    @_json_errors
    def json_route(self, request: wrappers.Request) -> wrappers.Response:
        """GET /json?run=R&tag=T: see :meth:`json_impl`."""
        run = _required_arg(request, "run")
        tag = _required_arg(request, "tag")
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        return http_util.Respond(
            request, self.json_impl(ctx, experiment, run, tag), "application/json"
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
