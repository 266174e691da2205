"""``GET /runs``: the runs that have memory_hierarchy data, with their tags."""

from __future__ import annotations

from typing import Any

from werkzeug import wrappers

from tb_plugin import metadata, routing
from tb_plugin.layout import DataContractError, cached_layout
from tb_plugin.reader import Reader


def runs_impl(reader: Reader, ctx: Any, experiment: str, levels: bool = False) -> dict[str, Any]:
    """List the runs that have memory_hierarchy data, with their tags.

    Args:
        reader: the plugin's reader.
        ctx: the request context.
        experiment: the experiment id.
        levels: also report each matrix and vector tag's ``levels_step``.

    Returns:
        ``{"runs": [{"run": name, "tags": {tag: {"kind", "max_step",
        "max_wall_time"}}}]}`` sorted by run name (``max_wall_time`` in seconds since the
        epoch). With ``levels``, matrix and vector tags add ``levels_step``: the last
        step the plugin's precomputed levels hold (null before the series was first
        read), which reaches ``max_step`` once the background indexer has caught up. A
        tag whose metadata this reader cannot decode has ``"kind": null`` and an
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
            if levels and entry["kind"] in (metadata.KIND_MATRIX, metadata.KIND_VECTOR):
                entry["levels_step"] = reader.levels_step(experiment, run, tag)
            tags[tag] = entry
        runs.append({"run": run, "tags": tags})
    return {"runs": runs}


@wrappers.Request.application
@routing.json_errors
def runs_route(reader: Reader, request: wrappers.Request) -> wrappers.Response:
    """GET /runs[?levels=0|1]: see :func:`runs_impl`; another ``levels`` value is a 400
    naming it."""
    levels = routing.flag_arg(request, "levels")
    ctx, experiment = routing.scope(request)
    return routing.respond_json(request, runs_impl(reader, ctx, experiment, levels))
