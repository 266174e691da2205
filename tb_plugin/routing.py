"""What every route shares: request parsing, typed errors as JSON, encoded answers.

Each route module of :mod:`tb_plugin.routes` splits a route in two, as TensorBoard's
scalar plugin does: a ``*_route(deps..., request)`` that parses and validates the request
with the helpers here (raising :class:`tensorboard.errors.InvalidArgumentError`, 400) and
a ``*_impl(deps..., plain arguments)`` that returns JSON-ready data (raising
``NotFoundError``, 404, or :class:`tb_plugin.layout.DataContractError`, 500). Routes are
decorated with :func:`json_errors`, so each typed error becomes the JSON body
``{"error": {"code": <http status>, "message": <text>}}`` with its status, never an HTML
page. ``docs/http/`` documents every route with its JSON shape and units.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from werkzeug import wrappers

from tb_plugin import export

MAX_QUERY_VALUE_CHARS = 1024  # characters; a longer run or tag is refused with 400
FORMATS = ("json", "csv")  # accepted ?format values; either answers as a download
GZIP_LEVEL = 3  # the level TensorBoard's http_util uses
JSON = "application/json"
CSV = "text/csv; charset=utf-8"


def json_errors(route: Callable[..., wrappers.Response]) -> Callable[..., wrappers.Response]:
    """Wrap a route ``route(*deps, request)`` so typed errors become JSON bodies with their
    HTTP status (and headers, e.g. ``Allow`` on a 405)."""

    @functools.wraps(route)
    def wrapper(*args: Any) -> wrappers.Response:
        try:
            return route(*args)
        except errors.PublicError as exc:
            request = args[-1]
            body = {"error": {"code": exc.http_code, "message": str(exc)}}
            return http_util.Respond(request, body, JSON, code=exc.http_code, headers=exc.headers)

    return wrapper


def scope(request: wrappers.Request) -> tuple[Any, str]:
    """``(ctx, experiment)`` of a request: TensorBoard's request context and experiment id."""
    return plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)


def required_arg(request: wrappers.Request, name: str) -> str:
    """A non-empty query value of at most MAX_QUERY_VALUE_CHARS characters.

    Raises:
        InvalidArgumentError: missing, empty or longer.
    """
    value = request.args.get(name)
    if not value:
        raise errors.InvalidArgumentError(f"query parameter {name!r} is required")
    if len(value) > MAX_QUERY_VALUE_CHARS:
        raise errors.InvalidArgumentError(
            f"query parameter {name!r} is longer than {MAX_QUERY_VALUE_CHARS} characters"
        )
    return value


def run_path_arg(request: wrappers.Request) -> str:
    """The ?run of a route that names a run's directory: required, bounded, and a relative
    path inside the logdir (no absolute path, ``..`` part, backslash or NUL), else
    InvalidArgumentError (400). The same rule as :func:`tb_plugin.tuning.resolve_run_dir`.
    """
    run = required_arg(request, "run")
    if (
        "\0" in run
        or "\\" in run
        or os.path.isabs(run)
        or any(part == ".." for part in run.split("/"))
    ):
        raise errors.InvalidArgumentError(f"run {run[:80]!r} is not a path inside the logdir")
    return run


#: The values a 0/1 flag query parameter accepts (e.g. ``/runs?levels=1``).
FLAG_VALUES = ("0", "1")


def flag_arg(request: wrappers.Request, name: str) -> bool:
    """A 0/1 flag query parameter: absent or ``0`` -> False, ``1`` -> True.

    Raises:
        InvalidArgumentError: any other value (e.g. ``abc``, ``true``), naming it and the
            accepted values.
    """
    raw = request.args.get(name)
    if raw is None:
        return False
    if raw not in FLAG_VALUES:
        raise errors.InvalidArgumentError(
            f"query parameter {name!r} must be one of {list(FLAG_VALUES)}, got {raw[:40]!r}"
        )
    return raw == "1"


def format_arg(request: wrappers.Request) -> str | None:
    """The ?format of a download: None (plain answer), 'json' or 'csv'.

    Raises:
        InvalidArgumentError: any other value (case matters).
    """
    raw = request.args.get("format")
    if raw is None:
        return None
    if raw not in FORMATS:
        raise errors.InvalidArgumentError(
            f"query parameter 'format' must be one of {list(FORMATS)}, got {raw[:40]!r}"
        )
    return raw


def respond_json(request: wrappers.Request, body: Any) -> wrappers.Response:
    """A 200 JSON answer (TensorBoard's ``Respond`` gzips it for clients that accept it)."""
    return http_util.Respond(request, body, JSON)


@dataclass(frozen=True)
class Answer:
    """An encoded, gzipped HTTP answer body (a cache entry of ``/series``)."""

    gzipped: bytes
    content_type: str
    headers: tuple[tuple[str, str], ...]


def encode(text: str, content_type: str, headers: tuple[tuple[str, str], ...] = ()) -> Answer:
    """Gzip an answer's text once (deterministically: mtime 0) for sending and caching."""
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=GZIP_LEVEL, mtime=0) as f:
        f.write(text.encode("utf-8"))
    return Answer(out.getvalue(), content_type, headers)


def respond_answer(request: wrappers.Request, answer: Answer) -> wrappers.Response:
    """Send a pre-gzipped answer (TensorBoard's Respond gunzips it for clients that must)."""
    return http_util.Respond(
        request,
        answer.gzipped,
        answer.content_type,
        content_encoding="gzip",
        headers=list(answer.headers),
    )


def download(
    body: dict[str, Any],
    fmt: str,
    to_csv: Callable[[dict[str, Any]], str],
    run: str,
    tag: str,
    scope_name: str,
) -> Answer:
    """A route's answer as a download (``Content-Disposition: attachment``).

    Args:
        body: the route's JSON answer.
        fmt: ``"json"`` (the same body) or ``"csv"`` (``to_csv(body)``).
        to_csv: :func:`tb_plugin.export.series_csv` or :func:`~tb_plugin.export.json_csv`.
        run: the run name, for the file name.
        tag: the tag, for the file name.
        scope_name: ``"full"``, ``"<N>points"`` or ``"all"``, for the file name.
    """
    text = json.dumps(body) if fmt == "json" else to_csv(body)
    disposition = export.content_disposition(run, tag, scope_name, fmt)
    return encode(text, JSON if fmt == "json" else CSV, (("Content-Disposition", disposition),))
