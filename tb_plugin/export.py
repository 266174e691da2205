"""Downloads of the view's data: CSV text and attachment headers (no HTTP routing here).

A ``/series`` answer becomes one CSV row per step: ``step, wall_time`` and then one column
per series, named ``row/column`` for a matrix tag (``device/used_bytes``) and ``column`` for
a vector tag. A value that was not measured (JSON null) is an empty cell, never 0.

A ``/json`` answer becomes one row per record (``step, wall_time, value`` with the value
as JSON text), except ``memory_hierarchy/placement``, which becomes one row per variable
and record. Text cells that a spreadsheet would take for a formula (leading ``=``, ``+``,
``-``, ``@``, tab or carriage return) are prefixed with an apostrophe.
"""

from __future__ import annotations

import csv
import io
import json
import re
import urllib.parse
from collections.abc import Iterable, Sequence
from typing import Any

from tb_plugin import metadata

# Columns of one placement variable, in the order of the CSV (and of the view's table).
PLACEMENT_COLUMNS = (
    "name",
    "shape",
    "dtype",
    "bytes",
    "partitioning",
    "shard_bytes_per_replica",
    "param_tier",
    "grad_tier",
    "optimizer_tier",
)
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_UNSAFE_FILENAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
MAX_FILENAME_CHARS = 120  # characters of the ASCII download name


def _cell(value: Any) -> Any:
    """A CSV cell: '' for None, numbers as they are, text defused against formulas."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(float(value)) if isinstance(value, float) else str(value)
    if not isinstance(value, str):
        value = json.dumps(value, sort_keys=True)
    return "'" + value if value.startswith(_FORMULA_START) else value


def _to_csv(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow([_cell(v) for v in row])
    return out.getvalue()


def series_csv(answer: dict[str, Any]) -> str:
    """CSV text of a ``/series`` answer (see the module docstring for the columns)."""
    names: list[str] = []
    columns: list[list[float | None]] = []
    if answer["kind"] == metadata.KIND_MATRIX:
        for row in answer["rows"]:
            for col in answer["columns"]:
                names.append(f"{row}/{col}")
                columns.append(answer["values"][row][col])
    else:
        for col in answer["columns"]:
            names.append(col)
            columns.append(answer["values"][col])
    rows = (
        [step, wall, *(c[i] for c in columns)]
        for i, (step, wall) in enumerate(zip(answer["steps"], answer["wall_times"]))
    )
    return _to_csv(["step", "wall_time", *names], rows)


def json_csv(answer: dict[str, Any]) -> str:
    """CSV text of a ``/json`` answer (placement: one row per variable and record)."""
    if answer["tag"] == metadata.TAG_PLACEMENT:
        rows = []
        for event in answer["events"]:
            variables = (
                event["value"].get("variables", []) if isinstance(event["value"], dict) else []
            )
            for var in variables:
                if isinstance(var, dict):
                    rows.append(
                        [
                            event["step"],
                            event["wall_time"],
                            *(var.get(c) for c in PLACEMENT_COLUMNS),
                        ]
                    )
        return _to_csv(["step", "wall_time", *PLACEMENT_COLUMNS], rows)
    rows = ([e["step"], e["wall_time"], e["value"]] for e in answer["events"])
    return _to_csv(["step", "wall_time", "value"], rows)


def download_name(run: str, tag: str, suffix: str, extension: str) -> str:
    """An ASCII file name for a download: ``<run>_<tag basename>_<suffix>.<extension>``."""
    stem = f"{run}_{tag.rsplit('/', 1)[-1]}_{suffix}"
    stem = _UNSAFE_FILENAME_CHARS.sub("_", stem).strip("._") or "memory_hierarchy"
    return f"{stem[:MAX_FILENAME_CHARS]}.{extension}"


def content_disposition(run: str, tag: str, suffix: str, extension: str) -> str:
    """A ``Content-Disposition: attachment`` value with an ASCII and a UTF-8 file name."""
    ascii_name = download_name(run, tag, suffix, extension)
    utf8_stem = f"{run}_{tag.rsplit('/', 1)[-1]}_{suffix}"[:MAX_FILENAME_CHARS]
    quoted = urllib.parse.quote(f"{utf8_stem}.{extension}", safe="")
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quoted}"
