"""``GET /runs``: the runs that have memory_hierarchy data, with their tags."""

from __future__ import annotations

from typing import Any

from werkzeug import wrappers

from tb_plugin import routing
from tb_plugin.layout import DataContractError, cached_layout
from tb_plugin.reader import Reader


def runs_impl(reader: Reader, ctx: Any, experiment: str) -> dict[str, Any]:
    """List the runs that have memory_hierarchy data, with their tags.

    Args:
        reader: the plugin's reader.
        ctx: the request context.
        experiment: the experiment id.

    Returns:
        ``{"runs": [{"run": name, "tags": {tag: {"kind", "max_step",
        "max_wall_time"}}}]}`` sorted by run name (``max_wall_time`` in seconds since the
        epoch). A tag whose metadata this reader cannot decode has ``"kind": null`` and an
        ``"error"`` message instead.
    """
    listing = reader.listing(ctx, experiment)
    runs = []
    for run in sorted(listing):
        tags = {}
        for tag, series in sorted(listing[run].items()):
            entry: dict[str, Any] = {
                "max_step": series.max_step,
                "max_wall_time": series.max_wall_time,
            }
            try:
                entry["kind"] = cached_layout(series.plugin_content, run, tag).kind
            except DataContractError as exc:
                entry["kind"] = None
                entry["error"] = str(exc)
            tags[tag] = entry
        runs.append({"run": run, "tags": tags})
    return {"runs": runs}


@wrappers.Request.application
@routing.json_errors
def runs_route(reader: Reader, request: wrappers.Request) -> wrappers.Response:
    """GET /runs: see :func:`runs_impl`."""
    ctx, experiment = routing.scope(request)
    return routing.respond_json(request, runs_impl(reader, ctx, experiment))
