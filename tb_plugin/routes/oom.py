"""``GET /oom``: a run's latest out-of-memory post-mortem (the ``memory_hierarchy/oom`` tag)."""

from __future__ import annotations

from typing import Any

from tensorboard import errors
from werkzeug import wrappers

from tb_plugin import metadata, routing
from tb_plugin.reader import Reader


def oom_impl(reader: Reader, ctx: Any, experiment: str, run: str) -> dict[str, Any]:
    """A run's latest out-of-memory post-mortem.

    Args:
        reader: reads the run's ``memory_hierarchy/oom`` records.
        ctx: the request context.
        experiment: the experiment id.
        run: the run whose post-mortem to return.

    Returns:
        ``{"run", "step", "wall_time", "count", "postmortem"}``: ``postmortem`` is the
        latest record's object as the runtime wrote it (the shared OOM contract, see
        ``docs/http/reports.md``), ``count`` how many post-mortems the run recorded,
        ``wall_time`` in seconds since the epoch.

    Raises:
        NotFoundError: no such run ("no memory_hierarchy run ..."), or a run that did not
            run out of memory: "run 'R' has no OOM record (it did not run out of memory);
            runs with one: [...]" (the runs of the logdir that have, sorted; ``[]`` when
            none has).
        DataContractError: a record that is not UTF-8 JSON.
    """
    reader.require_run(ctx, experiment, run)
    events = reader.records_if_any(ctx, experiment, run, metadata.TAG_OOM)
    if not events:
        listing = reader.listing(ctx, experiment)
        with_oom = sorted(r for r, t in listing.items() if metadata.TAG_OOM in t)
        raise errors.NotFoundError(
            f"run {run[:80]!r} has no OOM record (it did not run out of memory); "
            f"runs with one: {with_oom}"
        )
    last = events[-1]
    return {
        "run": run,
        "step": last["step"],
        "wall_time": last["wall_time"],
        "count": len(events),
        "postmortem": last["value"],
    }


@wrappers.Request.application
@routing.json_errors
def oom_route(reader: Reader, request: wrappers.Request) -> wrappers.Response:
    """GET /oom?run=R: see :func:`oom_impl`."""
    run = routing.required_arg(request, "run")
    ctx, experiment = routing.scope(request)
    return routing.respond_json(request, oom_impl(reader, ctx, experiment, run))
