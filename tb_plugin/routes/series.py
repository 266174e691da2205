"""``GET /series``: one matrix or vector tag of one run as columnar arrays over steps.

The answer is thinned to a point budget from the series' precomputed min/max levels
(:meth:`tb_plugin.levels.SeriesLevels.indices`: every bucket's minimum and maximum kept),
encoded and gzipped once, and kept in an answer cache keyed by ``(experiment, run, tag,
max_step, generation, points, format)`` (``generation``: :mod:`tb_plugin.run_files`).
Every step (``points=0``) is streamed instead.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np
from tensorboard import errors
from werkzeug import wrappers

from tb_plugin import export, metadata, routing
from tb_plugin.cache import CostLru
from tb_plugin.reader import Reader

DEFAULT_POINTS = 2000  # points per series in a /series answer when ?points is absent
FULL_POINTS = 0  # ?points=0: every stored step, not thinned (for exports)
MIN_POINTS = 2  # smallest accepted ?points other than FULL_POINTS
MAX_POINTS = 50_000  # largest accepted ?points
ANSWER_CACHE_BYTES = 64 * 2**20  # bytes of encoded, gzipped answers kept

_POINTS_ARG = re.compile(r"[0-9]{1,9}")


def points_arg(request: wrappers.Request) -> int:
    """The ?points budget: 0 (every step) or an integer in [MIN_POINTS, MAX_POINTS].

    Default DEFAULT_POINTS.

    Raises:
        InvalidArgumentError: anything else (signs, decimals, more than 9 digits).
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


def _json_floats(values: np.ndarray) -> list[float | None]:
    """Float list for JSON: NaN and infinities become None (JSON null)."""
    return [v if math.isfinite(v) else None for v in values.tolist()]


def series_impl(
    reader: Reader, ctx: Any, experiment: str, run: str, tag: str, points: int = DEFAULT_POINTS
) -> dict[str, Any]:
    """One matrix or vector tag of one run, as columnar arrays over steps.

    Args:
        reader: the plugin's reader.
        ctx: the request context.
        experiment: the experiment id.
        run: the run name.
        tag: a matrix or vector tag.
        points: the point budget (see :meth:`tb_plugin.levels.SeriesLevels.indices`);
            :data:`FULL_POINTS` (0) returns every stored step.

    Returns:
        ``{"run", "tag", "kind", "rows", "columns", "units", "steps", "wall_times",
        "values", "total_steps", "downsampled"}``; ``values`` is ``{row: {column:
        [...]}}`` for a matrix and ``{column: [...]}`` for a vector, parallel to
        ``steps``, with null where the value was not measured (NaN); ``wall_times`` in
        seconds since the epoch; ``units`` parallel to ``columns``.

    Raises:
        NotFoundError: no such run or tag.
        InvalidArgumentError: the tag is a json tag.
        DataContractError: undecodable metadata or a tensor of the wrong shape.
    """
    levels = reader.series_levels(ctx, experiment, run, tag)
    with levels.lock:  # one consistent view while the indexer may append
        n = levels.n
        keep = np.arange(n) if points == FULL_POINTS else levels.indices(points)
        steps, walls, kept = levels.rows(keep)
    layout = levels.layout
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
        "steps": steps.tolist(),
        "wall_times": walls.tolist(),
        "values": values,
        "total_steps": n,
        "downsampled": len(keep) < n,
    }


def series_answer(
    reader: Reader,
    answers: CostLru[routing.Answer],
    ctx: Any,
    experiment: str,
    run: str,
    tag: str,
    points: int,
    fmt: str | None,
) -> routing.Answer:
    """The encoded /series answer, cached in ``answers`` by (run, tag, max_step, the
    run files' generation, points, format): :func:`series_impl`'s JSON, or with ``fmt`` a
    download of it."""
    _layout, max_step = reader.layout(ctx, experiment, run, tag)

    def compute() -> tuple[routing.Answer, int]:
        body = series_impl(reader, ctx, experiment, run, tag, points)
        if fmt is None:
            answer = routing.encode(json.dumps(body), routing.JSON)
        else:
            suffix = "full" if points == FULL_POINTS else f"{points}points"
            answer = routing.download(body, fmt, export.series_csv, run, tag, suffix)
        return answer, len(answer.gzipped)

    key = ("series", experiment, run, tag, max_step, reader.generation(run), points, fmt)
    return answers.get_or_compute(key, compute)


@wrappers.Request.application
@routing.json_errors
def series_route(
    reader: Reader, answers: CostLru[routing.Answer], request: wrappers.Request
) -> wrappers.Response:
    """GET /series?run=R&tag=T[&points=N][&format=json|csv]: see :func:`series_impl`.

    With ``format`` the answer is a download (``Content-Disposition: attachment``):
    the same JSON, or CSV (:func:`tb_plugin.export.series_csv`). With ``points=0`` (every
    step) the answer is streamed in chunks from the precomputed levels
    (:func:`tb_plugin.export.stream_series`), never built whole in memory.
    """
    run = routing.required_arg(request, "run")
    tag = routing.required_arg(request, "tag")
    points = points_arg(request)
    fmt = routing.format_arg(request)
    ctx, experiment = routing.scope(request)
    if points == FULL_POINTS:  # every step: streamed from the levels, never held whole
        levels = reader.series_levels(ctx, experiment, run, tag)
        return export.stream_series(request, levels, run, tag, fmt)
    answer = series_answer(reader, answers, ctx, experiment, run, tag, points, fmt)
    return routing.respond_answer(request, answer)
