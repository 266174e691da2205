"""``GET /json``: every record of one json tag of one run (run info, placement, estimate,
config events, ...), as JSON or as a download."""

from __future__ import annotations

from typing import Any

from werkzeug import wrappers

from tb_plugin import export, metadata, routing
from tb_plugin.reader import Reader


def json_impl(reader: Reader, ctx: Any, experiment: str, run: str, tag: str) -> dict[str, Any]:
    """Every record of one json tag of one run.

    Args:
        reader: the plugin's reader.
        ctx: the request context.
        experiment: the experiment id.
        run: the run name.
        tag: a json tag.

    Returns:
        ``{"run", "tag", "kind": "json", "events": [{"step", "wall_time", "value"}]}``
        with ``value`` the decoded JSON object, sorted by step (``wall_time`` in seconds
        since the epoch).

    Raises:
        NotFoundError: no such run or tag.
        InvalidArgumentError: the tag is not a json tag.
        DataContractError: undecodable metadata or a record that is not JSON.
    """
    events = reader.records(ctx, experiment, run, tag)
    return {"run": run, "tag": tag, "kind": metadata.KIND_JSON, "events": events}


@wrappers.Request.application
@routing.json_errors
def json_route(reader: Reader, request: wrappers.Request) -> wrappers.Response:
    """GET /json?run=R&tag=T[&format=json|csv]: see :func:`json_impl`.

    With ``format`` the answer is a download: the same JSON, or CSV
    (:func:`tb_plugin.export.json_csv`; placement as one row per variable).
    """
    run = routing.required_arg(request, "run")
    tag = routing.required_arg(request, "tag")
    fmt = routing.format_arg(request)
    ctx, experiment = routing.scope(request)
    body = json_impl(reader, ctx, experiment, run, tag)
    if fmt is None:
        return routing.respond_json(request, body)
    answer = routing.download(body, fmt, export.json_csv, run, tag, "all")
    return routing.respond_answer(request, answer)
