"""``GET /first_view``: everything the view's first paint needs, in one answer.

The tab's first meaningful paint is the tier charts of the first selected runs. Asked
route by route it is ``/runs`` and then, per run, two ``/series`` (tiers, readings) and
two ``/json`` (run_info, config_event) answers: a round trip and a dozen requests queued
behind each other in TensorBoard's server and the browser. This route answers the
``/runs`` listing and those runs' answers at once; each embedded answer is byte for byte
what its own route answers (the ``/series`` ones come from the same answer cache), so the
view seeds its cache with them and its normal refresh then finds everything there.

Which runs: those named by ``?run=`` (the view's remembered selection, first ones in
name order), else the view's default: of the ``limit`` most recent runs (newest
``max_wall_time`` over a run's tags, ties by name; ``frontend/src/selection.js``), the
first ``eager`` in name order.
"""

from __future__ import annotations

import gzip
import json
import re
from typing import Any

from tensorboard import errors
from tensorboard.backend import json_util
from werkzeug import wrappers

from tb_plugin import metadata, routing
from tb_plugin.cache import CostLru
from tb_plugin.layout import DataContractError
from tb_plugin.reader import Reader
from tb_plugin.routes import records, runs, series

DEFAULT_LIMIT = 10  # runs selected on a first visit (selection.js DEFAULT_SELECTED_RUNS)
DEFAULT_EAGER = 4  # panels filled at once (index.js EAGER_RUNS)
MAX_EAGER = 16  # largest accepted ?eager (and most ?run values used)
MAX_LIMIT = 1000  # largest accepted ?limit
VIEW_POINTS = 1000  # the view's point budget per chart (CHART_POINTS in frontend model.js)
# The tags the first paint draws: series (tier charts, readings beside them) and json
# (run facts, config-change markers).
SERIES_TAGS = (metadata.TAG_TIERS, metadata.TAG_READINGS)
JSON_TAGS = (metadata.TAG_RUN_INFO, metadata.TAG_CONFIG_EVENT)

_COUNT = re.compile(r"[0-9]{1,6}")


def count_arg(request: wrappers.Request, name: str, default: int, low: int, high: int) -> int:
    """An integer query value in [low, high], ``default`` when absent.

    Raises:
        InvalidArgumentError: not a whole number in range.
    """
    raw = request.args.get(name)
    if raw is None:
        return default
    if not _COUNT.fullmatch(raw) or not low <= int(raw) <= high:
        raise errors.InvalidArgumentError(
            f"query parameter {name!r} must be an integer in [{low}, {high}], got {raw[:40]!r}"
        )
    return int(raw)


def default_runs(listed: list[dict[str, Any]], limit: int, eager: int) -> list[str]:
    """The runs the view fills first on a first visit (no remembered selection).

    Args:
        listed: the ``runs`` of a ``/runs`` answer.
        limit: runs selected by default (the most recent ones).
        eager: panels filled at once.

    Returns:
        Of the ``limit`` runs with the newest ``max_wall_time`` (ties by name), the first
        ``eager`` in name order.
    """

    def recency(entry: dict[str, Any]) -> float:
        times = [t.get("max_wall_time") or 0.0 for t in entry["tags"].values()]
        return max([0.0, *times])

    recent = sorted(listed, key=lambda e: (-recency(e), e["run"]))[:limit]
    return sorted(e["run"] for e in recent)[:eager]


def _error(exc: errors.PublicError | DataContractError) -> dict[str, Any]:
    code = exc.http_code if isinstance(exc, errors.PublicError) else 500
    return {"error": {"code": code, "message": str(exc)}}


def first_view_text(
    reader: Reader,
    answers: CostLru[routing.Answer],
    ctx: Any,
    experiment: str,
    names: list[str] | None,
    limit: int = DEFAULT_LIMIT,
    eager: int = DEFAULT_EAGER,
    points: int = VIEW_POINTS,
) -> str:
    """The ``/first_view`` answer as JSON text.

    Args:
        reader: the plugin's reader.
        answers: the encoded ``/series`` answers (shared with that route).
        ctx: the request context.
        experiment: the experiment id.
        names: the runs to include (those not listed are left out), or None for
            :func:`default_runs`.
        limit: see :func:`default_runs`.
        eager: see :func:`default_runs`; at most this many of ``names`` are used.
        points: the ``/series`` point budget of the embedded series (default the view's,
            :data:`VIEW_POINTS`, whose answers the indexer encodes in advance).

    Returns:
        ``{"runs": <the /runs answer's runs>, "first_runs": [run, ...], "points": int,
        "series": {run: {tag: <the /series answer>}}, "json": {run: {tag: <the /json
        answer>}}}``. Only tags the run has are present; a tag whose answer fails is
        ``{"error": {"code", "message"}}`` (its own route reports the same).
    """
    listed = runs.runs_impl(reader, ctx, experiment)["runs"]
    tags_of = {e["run"]: e["tags"] for e in listed}
    if names is None:
        chosen = default_runs(listed, limit, eager)
    else:
        chosen = [n for n in dict.fromkeys(names) if n in tags_of][:eager]
    parts_series: list[str] = []
    parts_json: list[str] = []
    for run in chosen:
        in_series, in_json = [], []
        for tag in SERIES_TAGS:
            if tag not in tags_of[run]:
                continue
            try:
                answer = series.series_answer(
                    reader, answers, ctx, experiment, run, tag, points, None
                )
                text = gzip.decompress(answer.gzipped).decode("utf-8")
            except (errors.PublicError, DataContractError) as exc:
                text = json.dumps(_error(exc))
            in_series.append(f"{json.dumps(tag)}:{text}")
        for tag in JSON_TAGS:
            if tag not in tags_of[run]:
                continue
            try:
                body: dict[str, Any] = records.json_impl(reader, ctx, experiment, run, tag)
            except (errors.PublicError, DataContractError) as exc:
                body = _error(exc)
            in_json.append(f"{json.dumps(tag)}:{json.dumps(json_util.Cleanse(body))}")
        parts_series.append(f"{json.dumps(run)}:{{{','.join(in_series)}}}")
        parts_json.append(f"{json.dumps(run)}:{{{','.join(in_json)}}}")
    return (
        f'{{"runs":{json.dumps(listed)},"first_runs":{json.dumps(chosen)},'
        f'"points":{points},"series":{{{",".join(parts_series)}}},'
        f'"json":{{{",".join(parts_json)}}}}}'
    )


@wrappers.Request.application
@routing.json_errors
def first_view_route(
    reader: Reader, answers: CostLru[routing.Answer], request: wrappers.Request
) -> wrappers.Response:
    """GET /first_view[?run=A&run=B...][&limit=N][&eager=N][&points=N]: see
    :func:`first_view_text` (``run`` values are bounded like every run name)."""
    names = request.args.getlist("run")
    for name in names:
        if not name or len(name) > routing.MAX_QUERY_VALUE_CHARS:
            raise errors.InvalidArgumentError(
                "query parameter 'run' must be a non-empty name of at most "
                f"{routing.MAX_QUERY_VALUE_CHARS} characters"
            )
    limit = count_arg(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
    eager = count_arg(request, "eager", DEFAULT_EAGER, 1, MAX_EAGER)
    points = series.points_arg(request) if "points" in request.args else VIEW_POINTS
    if points == series.FULL_POINTS:
        raise errors.InvalidArgumentError(
            "query parameter 'points' must not be 0 here (every step is an export: /series)"
        )
    ctx, experiment = routing.scope(request)
    text = first_view_text(reader, answers, ctx, experiment, names or None, limit, eager, points)
    return routing.respond_answer(request, routing.encode(text, routing.JSON))
