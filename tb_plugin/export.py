"""Downloads of the view's data: CSV text and attachment headers (no HTTP routing here).

A ``/series`` answer becomes one CSV row per step: ``step, wall_time`` and then one column
per series, named ``row/column`` for a matrix tag (``device/used_bytes``) and ``column`` for
a vector tag. A value that was not measured (JSON null) is an empty cell, never 0.

Every step of a series (``points=0``) is streamed: :func:`stream_series` produces the
same JSON or CSV chunk by chunk from the series' levels (:mod:`tb_plugin.levels`).

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
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from werkzeug import wrappers

from tb_plugin import metadata
from tb_plugin.levels import SeriesLevels

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


def table_csv(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """CSV text of a table: ``header`` then one line per row, cells as :func:`_cell`
    writes them (empty for None, text defused against spreadsheet formulas)."""
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
    return table_csv(["step", "wall_time", *names], rows)


STREAM_ROWS = 32_768  # steps per chunk of a streamed export


def _float_texts(values: np.ndarray) -> list[str]:
    """CSV cells of float64 values: ``repr`` (exact), '' where not finite (not measured)."""
    texts = list(map(repr, values.tolist()))
    for i in np.flatnonzero(~np.isfinite(values)).tolist():
        texts[i] = ""
    return texts


def _json_list_body(values: np.ndarray) -> str:
    """The inside of a JSON list of float64 values (``null`` where not finite)."""
    return ", ".join("null" if t == "" else t for t in _float_texts(values))


def _series_columns(levels: SeriesLevels) -> list[tuple[str, str | None, str, int]]:
    """(CSV name, matrix row or None, column, index into a row of cells) per series."""
    layout = levels.layout
    if layout.kind == metadata.KIND_MATRIX:
        width = len(layout.columns)
        return [
            (f"{row}/{col}", row, col, r * width + c)
            for r, row in enumerate(layout.rows)
            for c, col in enumerate(layout.columns)
        ]
    return [(col, None, col, c) for c, col in enumerate(layout.columns)]


def series_csv_chunks(levels: SeriesLevels) -> Iterator[str]:
    """CSV text of every step of a series (the rows of :func:`series_csv`), in chunks of
    STREAM_ROWS steps, from a snapshot of ``levels``."""
    steps, walls, cells = levels.snapshot()
    columns = _series_columns(levels)
    yield ",".join(["step", "wall_time", *(name for name, *_ in columns)]) + "\n"
    for start in range(0, len(steps), STREAM_ROWS):
        stop = min(len(steps), start + STREAM_ROWS)
        block = cells[start:stop]
        texts = [list(map(str, steps[start:stop].tolist())), _float_texts(walls[start:stop])]
        texts += [_float_texts(block[:, i]) for *_n, i in columns]
        yield "\n".join(map(",".join, zip(*texts))) + "\n"


def series_json_chunks(levels: SeriesLevels, run: str, tag: str) -> Iterator[str]:
    """JSON text of every step of a series (the ``/series`` answer with ``points=0``), in
    chunks: one column of STREAM_ROWS values at a time, from a snapshot of ``levels``."""
    steps, walls, cells = levels.snapshot()
    layout, n = levels.layout, len(steps)
    head = {
        "run": run,
        "tag": tag,
        "kind": layout.kind,
        "rows": list(layout.rows),
        "columns": list(layout.columns),
        "units": list(layout.units),
    }

    def listed(values: np.ndarray, as_int: bool = False) -> Iterator[str]:
        yield "["
        for start in range(0, n, STREAM_ROWS):
            part = values[start : start + STREAM_ROWS]
            text = ", ".join(map(str, part.tolist())) if as_int else _json_list_body(part)
            yield (", " if start else "") + text
        yield "]"

    yield json.dumps(head)[:-1] + ', "steps": '
    yield from listed(steps, as_int=True)
    yield ', "wall_times": '
    yield from listed(walls)
    yield ', "values": {'
    columns = _series_columns(levels)
    if layout.kind == metadata.KIND_MATRIX:
        for r, row in enumerate(layout.rows):
            yield (", " if r else "") + json.dumps(row) + ": {"
            mine = [(col, i) for _name, owner, col, i in columns if owner == row]
            for k, (col, i) in enumerate(mine):
                yield (", " if k else "") + json.dumps(col) + ": "
                yield from listed(cells[:, i])
            yield "}"
    else:
        for k, (_name, _row, col, i) in enumerate(columns):
            yield (", " if k else "") + json.dumps(col) + ": "
            yield from listed(cells[:, i])
    yield f'}}, "total_steps": {n}, "downsampled": false}}'


def stream_series(
    request: wrappers.Request, levels: SeriesLevels, run: str, tag: str, fmt: str | None
) -> wrappers.Response:
    """A chunked (streamed) answer of every step of a series: JSON (``fmt`` None or
    ``"json"``) or CSV; a download (``Content-Disposition: attachment``) with ``fmt``.
    Gzipped on the fly for clients that accept it. The body is produced from a snapshot
    of ``levels`` chunk by chunk (STREAM_ROWS steps), so no more than a chunk of text is
    held at a time.
    """
    chunks = series_csv_chunks(levels) if fmt == "csv" else series_json_chunks(levels, run, tag)
    headers = [("X-Content-Type-Options", "nosniff")]
    if fmt is not None:
        headers.append(("Content-Disposition", content_disposition(run, tag, "full", fmt)))
    gzipped = "gzip" in request.headers.get("Accept-Encoding", "")
    if gzipped:
        headers.append(("Content-Encoding", "gzip"))

    def body() -> Iterator[bytes]:
        packer = zlib.compressobj(3, zlib.DEFLATED, 31) if gzipped else None  # 31: gzip
        for text in chunks:
            data = text.encode("utf-8")
            data = packer.compress(data) if packer else data
            if data:
                yield data
        if packer:
            yield packer.flush()

    content_type = "text/csv; charset=utf-8" if fmt == "csv" else "application/json"
    return wrappers.Response(
        body(), status=200, content_type=content_type, headers=headers, direct_passthrough=True
    )


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
        return table_csv(["step", "wall_time", *PLACEMENT_COLUMNS], rows)
    rows = ([e["step"], e["wall_time"], e["value"]] for e in answer["events"])
    return table_csv(["step", "wall_time", "value"], rows)


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
