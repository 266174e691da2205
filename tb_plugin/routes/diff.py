"""``GET /diff``: two runs compared, run B minus run A.

Per step (aligned by step number: only the steps both runs recorded are differenced; the
steps only one run has are counted, never padded or shifted), the difference ``b - a`` of
each tier's ``used_bytes`` and ``peak_bytes``, of the page moves per direction and of the
step time; whole-run summaries of both runs and their deltas; and a placement diff of
the runs' latest ``memory_hierarchy/placement`` records, keyed by variable name.

The per-step differences are thinned to a point budget with the plugin's min/max levels
(:class:`tb_plugin.levels.SeriesLevels` built over the difference rows), so every
bucket's largest and smallest difference survives, as on the ``/series`` charts.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from tensorboard import errors
from werkzeug import wrappers

from tb_plugin import export, metadata, routing
from tb_plugin.layout import Layout
from tb_plugin.levels import SeriesLevels
from tb_plugin.reader import Reader
from tb_plugin.routes.series import DEFAULT_POINTS, FULL_POINTS, points_arg

# Tier columns differenced per step (bytes).
TIER_FIELDS = ("used_bytes", "peak_bytes")
# Page-move columns differenced per step: pages and bytes per direction (count, bytes).
PAGE_FIELDS = (
    "d2h_pages",
    "h2d_pages",
    "h2n_pages",
    "n2h_pages",
    "d2h_bytes",
    "h2d_bytes",
    "h2n_bytes",
    "n2h_bytes",
)
# Fields of a placement variable compared between the runs (docs/events.md).
PLACEMENT_FIELDS = (
    "param_tier",
    "grad_tier",
    "optimizer_tier",
    "partitioning",
    "shard_bytes_per_replica",
    "bytes",
    "shape",
    "dtype",
)
# ?part of a CSV download: the per-step differences or the placement diff.
CSV_PARTS = ("steps", "placement")


def _step_names() -> list[tuple[str, str]]:
    """(column name in the answer/CSV, unit) of every per-step difference, in order."""
    names = [(f"{t}/{f}", "bytes") for t in metadata.TIERS for f in TIER_FIELDS]
    names += [(f, "bytes" if f.endswith("bytes") else "count") for f in PAGE_FIELDS]
    names.append(("step_seconds", "seconds"))
    return names


def _columns(
    reader: Reader, ctx: Any, experiment: str, run: str, tag: str, fields: list[tuple[str, str]]
) -> tuple[np.ndarray, np.ndarray]:
    """(steps ``[N]`` int64, values ``[N, F]`` float64) of a run's matrix or vector tag,
    ``fields`` as (row or "", column); NaN where not measured; empty when no such tag."""
    if tag not in reader.require_run(ctx, experiment, run):
        return np.empty(0, np.int64), np.empty((0, len(fields)))
    levels = reader.series_levels(ctx, experiment, run, tag)
    steps, _walls, cells = levels.snapshot()
    layout = levels.layout
    index = []
    for row, col in fields:
        if col not in layout.columns or (row and row not in layout.rows):
            index.append(-1)
        else:
            r = layout.rows.index(row) if row else 0
            index.append(r * len(layout.columns) + layout.columns.index(col))
    out = np.full((len(steps), len(fields)), np.nan)
    for j, i in enumerate(index):
        if i >= 0:
            out[:, j] = cells[:, i]
    return steps, out


def _run_rows(reader: Reader, ctx: Any, experiment: str, run: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps ``[N]``, rows ``[N, D]`` in :func:`_step_names` order) of one run: steps of
    its tier matrix; pages and timing joined by step (NaN at steps they lack)."""
    tier_fields = [(t, f) for t in metadata.TIERS for f in TIER_FIELDS]
    steps, tiers = _columns(reader, ctx, experiment, run, metadata.TAG_TIERS, tier_fields)
    rows = np.full((len(steps), len(_step_names())), np.nan)
    rows[:, : len(tier_fields)] = tiers
    parts = (
        (metadata.TAG_PAGES, [("", f) for f in PAGE_FIELDS]),
        (metadata.TAG_TIMING, [("", "step_seconds")]),
    )
    start = len(tier_fields)
    for tag, fields in parts:
        other_steps, values = _columns(reader, ctx, experiment, run, tag, fields)
        _common, at_run, at_other = np.intersect1d(steps, other_steps, return_indices=True)
        rows[at_run, start : start + len(fields)] = values[at_other]
        start += len(fields)
    return steps, rows


def _number(value: float) -> float | None:
    """A finite float, else None (JSON null: not measured)."""
    return float(value) if math.isfinite(value) else None


def _pair(a: float | None, b: float | None) -> dict[str, float | None]:
    """``{"a", "b", "delta": b - a}`` (delta null unless both were measured)."""
    delta = b - a if a is not None and b is not None else None
    return {"a": a, "b": b, "delta": delta}


def _reduce(values: np.ndarray, how: str) -> float | None:
    """max / sum / median / last of the measured (finite) values; None when none are."""
    finite = values[np.isfinite(values)]
    if not len(finite):
        return None
    if how == "last":
        return float(finite[-1])
    return float({"max": np.max, "sum": np.sum, "median": np.median}[how](finite))


def _summary(
    rows_a: np.ndarray, rows_b: np.ndarray, traced: tuple[np.ndarray, np.ndarray]
) -> dict[str, Any]:
    """Whole-run figures of both runs and their deltas (see :func:`diff_impl`)."""
    names = [n for n, _u in _step_names()]
    col = {n: i for i, n in enumerate(names)}
    out: dict[str, Any] = {"tiers": {}, "pages": {}}
    for tier in metadata.TIERS:
        out["tiers"][tier] = {
            "peak_bytes": _pair(
                _reduce(rows_a[:, col[f"{tier}/peak_bytes"]], "max"),
                _reduce(rows_b[:, col[f"{tier}/peak_bytes"]], "max"),
            ),
            "last_used_bytes": _pair(
                _reduce(rows_a[:, col[f"{tier}/used_bytes"]], "last"),
                _reduce(rows_b[:, col[f"{tier}/used_bytes"]], "last"),
            ),
        }
    for field in PAGE_FIELDS:
        out["pages"][field] = _pair(
            _reduce(rows_a[:, col[field]], "sum"), _reduce(rows_b[:, col[field]], "sum")
        )
    seconds = col["step_seconds"]
    out["median_step_seconds"] = _pair(
        _reduce(rows_a[~traced[0], seconds], "median"),
        _reduce(rows_b[~traced[1], seconds], "median"),
    )
    return out


def _latest_value(reader: Reader, ctx: Any, experiment: str, run: str, tag: str) -> tuple:
    """(step, value) of a run's latest record of a json tag, or (None, None)."""
    events = reader.records_if_any(ctx, experiment, run, tag)
    return (events[-1]["step"], events[-1]["value"]) if events else (None, None)


def _variables(value: Any) -> dict[str, dict[str, Any]]:
    """A placement record's variables by name (rows without a string name skipped)."""
    variables = value.get("variables", []) if isinstance(value, dict) else []
    return {
        v["name"]: v for v in variables if isinstance(v, dict) and isinstance(v.get("name"), str)
    }


def placement_diff(
    value_a: Any, value_b: Any, stage_a: Any = None, stage_b: Any = None
) -> dict[str, Any]:
    """The variables whose placement differs between two placement records.

    Args:
        value_a: run A's ``memory_hierarchy/placement`` value (``{"variables": [...]}``),
            or None when it recorded none.
        value_b: run B's.
        stage_a: run A's ZeRO stage (from ``run_info``), shown on every row; None unknown.
        stage_b: run B's.

    Returns:
        ``{"rows", "equal", "differ", "only_a", "only_b", "fields"}``: ``rows`` (sorted by
        name) one per variable that is in one run only or differs in any of
        :data:`PLACEMENT_FIELDS`: ``{"name", "status": "differ"|"only_a"|"only_b",
        "changed": [field, ...], "a": {field: value} | None, "b": ..., "stage_a",
        "stage_b", "bytes_a", "bytes_b", "bytes_delta"}`` where ``bytes_*`` are the
        bytes one replica holds of the variable (``shard_bytes_per_replica``, else its
        ``bytes``; null when unknown) and ``bytes_delta = bytes_b - bytes_a`` (0 for a
        side that lacks the variable counts as 0 bytes); ``equal`` counts the
        variables identical in both.
    """
    vars_a, vars_b = _variables(value_a), _variables(value_b)
    rows, counts = [], {"equal": 0, "differ": 0, "only_a": 0, "only_b": 0}
    for name in sorted(set(vars_a) | set(vars_b)):
        va, vb = vars_a.get(name), vars_b.get(name)
        if va is not None and vb is not None:
            changed = [f for f in PLACEMENT_FIELDS if va.get(f) != vb.get(f)]
            if not changed:
                counts["equal"] += 1
                continue
            status = "differ"
        else:
            changed = list(PLACEMENT_FIELDS)
            status = "only_a" if vb is None else "only_b"
        counts[status] += 1
        held = [_held_bytes(v) for v in (va, vb)]
        both = [0 if v is None else h for v, h in zip((va, vb), held)]
        rows.append(
            {
                "name": name,
                "status": status,
                "changed": changed,
                "a": None if va is None else {f: va.get(f) for f in PLACEMENT_FIELDS},
                "b": None if vb is None else {f: vb.get(f) for f in PLACEMENT_FIELDS},
                "stage_a": stage_a,
                "stage_b": stage_b,
                "bytes_a": held[0],
                "bytes_b": held[1],
                "bytes_delta": None if None in both else both[1] - both[0],
            }
        )
    return {"rows": rows, **counts, "fields": list(PLACEMENT_FIELDS)}


def _held_bytes(var: dict[str, Any] | None) -> int | float | None:
    """Bytes one replica holds of a placement variable: its ``shard_bytes_per_replica``,
    else ``bytes``; None when the variable is absent or neither is a number."""
    if var is None:
        return None
    for key in ("shard_bytes_per_replica", "bytes"):
        value = var.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value
    return None


def _require(reader: Reader, ctx: Any, experiment: str, name: str, run: str) -> None:
    """400 naming the parameter and the run when the run has no memory_hierarchy data."""
    if run not in reader.listing(ctx, experiment):
        raise errors.InvalidArgumentError(
            f"run {name}={run[:80]!r} has no memory_hierarchy data in this logdir"
        )


def diff_impl(
    reader: Reader,
    ctx: Any,
    experiment: str,
    run_a: str,
    run_b: str,
    points: int = DEFAULT_POINTS,
) -> dict[str, Any]:
    """Run B compared with run A (see the module docstring and ``docs/http/reports.md``).

    Args:
        reader: the plugin's reader (tiers, pages, timing, run_info, placement).
        ctx: the request context.
        experiment: the experiment id.
        run_a: the run subtracted (A).
        run_b: the run compared with it (B).
        points: point budget of the per-step differences; 0 (FULL_POINTS) = every
            common step.

    Returns:
        ``{"a", "b", "steps", "columns", "units", "values", "total_steps",
        "downsampled", "alignment", "summary", "stage", "placement"}``: ``steps`` the
        common steps kept (ascending ints); ``values[column]`` parallel to ``steps``,
        ``b - a`` in ``units`` (bytes, count, seconds), null where either run did not
        measure it; ``columns`` are ``<tier>/used_bytes``, ``<tier>/peak_bytes`` per
        tier, the page moves per direction, ``step_seconds``. ``alignment``:
        ``{"rule", "common_steps", "only_a", "only_b", "a_steps", "b_steps"}`` with
        ``*_steps`` ``[first, last]`` (null for a run without tier steps).
        ``summary``: per tier the largest ``peak_bytes`` and the last ``used_bytes``,
        per page field the total over the run, the median step time (s) of steps that
        did not trace, each ``{"a", "b", "delta"}`` over each run's own steps.
        ``stage``: ``{"a", "b", "delta"}`` from ``run_info``. ``placement``: see
        :func:`placement_diff`, plus ``step_a``/``step_b`` of the records compared.

    Raises:
        InvalidArgumentError: either run has no memory_hierarchy data (names it).
        DataContractError: undecodable data.
    """
    _require(reader, ctx, experiment, "a", run_a)
    _require(reader, ctx, experiment, "b", run_b)
    steps_a, rows_a = _run_rows(reader, ctx, experiment, run_a)
    steps_b, rows_b = _run_rows(reader, ctx, experiment, run_b)
    common, at_a, at_b = np.intersect1d(steps_a, steps_b, return_indices=True)
    names = _step_names()
    delta = rows_b[at_b] - rows_a[at_a]  # [K, D]
    layout = Layout(
        1, metadata.KIND_VECTOR, (), tuple(n for n, _ in names), tuple(u for _, u in names)
    )
    levels = SeriesLevels(layout)
    levels.append(common, np.zeros(len(common)), delta)
    keep = np.arange(len(common)) if points == FULL_POINTS else levels.indices(max(points, 2))
    kept = delta[keep]
    traced = tuple(
        _columns(reader, ctx, experiment, run, metadata.TAG_TIMING, [("", "traced")])
        for run in (run_a, run_b)
    )
    traced_masks = tuple(
        _traced_mask(steps, t_steps, t_vals[:, 0])
        for steps, (t_steps, t_vals) in zip((steps_a, steps_b), traced)
    )
    (_sa, info_a), (_sb, info_b) = (
        _latest_value(reader, ctx, experiment, run, metadata.TAG_RUN_INFO) for run in (run_a, run_b)
    )
    stage_a, stage_b = (i.get("stage") if isinstance(i, dict) else None for i in (info_a, info_b))
    step_pa, place_a = _latest_value(reader, ctx, experiment, run_a, metadata.TAG_PLACEMENT)
    step_pb, place_b = _latest_value(reader, ctx, experiment, run_b, metadata.TAG_PLACEMENT)
    placement = placement_diff(place_a, place_b, stage_a, stage_b)
    placement.update(step_a=step_pa, step_b=step_pb)

    def span(steps: np.ndarray) -> list[int] | None:
        return [int(steps[0]), int(steps[-1])] if len(steps) else None

    return {
        "a": run_a,
        "b": run_b,
        "steps": common[keep].tolist(),
        "columns": [n for n, _ in names],
        "units": [u for _, u in names],
        "values": {n: [_number(v) for v in kept[:, j].tolist()] for j, (n, _) in enumerate(names)},
        "total_steps": len(common),
        "downsampled": len(keep) < len(common),
        "alignment": {
            "rule": "by step: steps both runs recorded; the others are counted, not compared",
            "common_steps": len(common),
            "only_a": len(steps_a) - len(common),
            "only_b": len(steps_b) - len(common),
            "a_steps": span(steps_a),
            "b_steps": span(steps_b),
        },
        "summary": _summary(rows_a, rows_b, traced_masks),
        "stage": _pair(*(s if isinstance(s, int) else None for s in (stage_a, stage_b))),
        "placement": placement,
    }


def _traced_mask(steps: np.ndarray, t_steps: np.ndarray, traced: np.ndarray) -> np.ndarray:
    """``[N]`` bool over ``steps``: the step traced its step function (timing ``traced``
    is 1); False where not recorded."""
    mask = np.zeros(len(steps), dtype=bool)
    _c, at, at_t = np.intersect1d(steps, t_steps, return_indices=True)
    mask[at] = traced[at_t] == 1
    return mask


def diff_csv(body: dict[str, Any], part: str) -> str:
    """CSV text of a ``/diff`` answer: ``part`` ``"steps"`` (one row per step: ``step``
    and each column's ``b - a``, empty where not measured) or ``"placement"`` (one row
    per differing variable: name, status, changed fields, then each field for A and B,
    held bytes A, B and delta as held_bytes_a, held_bytes_b, held_bytes_delta)."""
    if part == "steps":
        cols = body["columns"]
        rows = ([s, *(body["values"][c][i] for c in cols)] for i, s in enumerate(body["steps"]))
        return export.table_csv(["step", *cols], rows)
    place = body["placement"]
    fields = place["fields"]
    header = ["name", "status", "changed", "stage_a", "stage_b"]
    header += [f"{f}_{side}" for f in fields for side in ("a", "b")]
    header += ["held_bytes_a", "held_bytes_b", "held_bytes_delta"]
    out = []
    for row in place["rows"]:
        cells = [
            row["name"],
            row["status"],
            " ".join(row["changed"]),
            row["stage_a"],
            row["stage_b"],
        ]
        for f in fields:
            cells += [(row[side] or {}).get(f) for side in ("a", "b")]
        out.append(cells + [row["bytes_a"], row["bytes_b"], row["bytes_delta"]])
    return export.table_csv(header, out)


@wrappers.Request.application
@routing.json_errors
def diff_route(reader: Reader, request: wrappers.Request) -> wrappers.Response:
    """GET /diff?a=A&b=B[&points=N][&format=json|csv][&part=steps|placement]: see
    :func:`diff_impl`. 400 for a missing, empty or over-long ``a`` or ``b``, a run
    without memory_hierarchy data (named), a bad ``points``, ``format`` or ``part``.
    With ``format`` a download (``<a>_vs_<b>_diff_<part>.csv`` or ``..._all.json``)."""
    run_a = routing.required_arg(request, "a")
    run_b = routing.required_arg(request, "b")
    points = points_arg(request)
    fmt = routing.format_arg(request)
    part = request.args.get("part", "steps")
    if part not in CSV_PARTS:
        raise errors.InvalidArgumentError(
            f"query parameter 'part' must be one of {list(CSV_PARTS)}, got {part[:40]!r}"
        )
    ctx, experiment = routing.scope(request)
    body = diff_impl(reader, ctx, experiment, run_a, run_b, points)
    if fmt is None:
        return routing.respond_json(request, body)
    name = f"{run_a}_vs_{run_b}"
    if fmt == "json":
        answer = routing.download(body, fmt, json.dumps, name, "diff", "all")
    else:
        answer = routing.download(body, fmt, lambda b: diff_csv(b, part), name, "diff", part)
    return routing.respond_answer(request, answer)
