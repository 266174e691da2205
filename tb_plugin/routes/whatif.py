"""``GET /whatif``: a proposed live-tuning change's predicted effect, before it is applied.

The prediction replays the run's recorded access trace through the pool's own core
(:mod:`tb_plugin.whatif`, :mod:`zero_runtime.memory.simulate`); nothing is written and
nothing is asked of the job, so the route answers whether or not TensorBoard may tune.
"""

from __future__ import annotations

from typing import Any

from werkzeug import wrappers

from tb_plugin import routing, tuning, whatif
from tb_plugin.reader import Reader
from zero_runtime.memory.simulate import ReplayError


def whatif_impl(
    reader: Reader, ctx: Any, experiment: str, run: str, updates: dict[str, int]
) -> dict[str, Any]:
    """The predicted effect of ``updates`` on the run's job.

    Args:
        reader: the plugin's reader.
        ctx: the request context.
        experiment: the experiment id.
        run: the run name.
        updates: checked key -> int (:func:`tuning.check_updates`).

    Returns:
        ``{"run", "updates", "available", "reason", ...}``: ``available`` False (and
        ``reason`` saying why: no trace recorded yet, e.g. a run below stage 3, or a value
        the pool cannot take) or True with ``simulate.predict``'s fields: ``steps``
        (the replayed steps), ``page_size``, ``recorded``, ``replayed``,
        ``replay_exact``, ``predicted`` (``first``, ``steady``), ``oom``,
        ``stall_seconds_per_miss``, ``notes`` (docs/http_api.md).

    Raises:
        NotFoundError: not a run of this logdir.
        InvalidArgumentError: the run's directory is not inside the logdir.
    """
    reader.require_run(ctx, experiment, run)
    run_dir = reader.run_dir(ctx, experiment, run)
    out: dict[str, Any] = {"run": run, "updates": updates, "available": False, "reason": None}
    try:
        out.update(whatif.predict(run_dir, updates), available=True)
    except ReplayError as exc:
        out["reason"] = str(exc)
    return out


@wrappers.Request.application
@routing.json_errors
def whatif_route(reader: Reader, request: wrappers.Request) -> wrappers.Response:
    """GET /whatif?run=R&updates={"key": value, ...}: see :func:`whatif_impl`. ``updates``
    is a JSON object checked as ``POST /tune``'s (400 otherwise)."""
    run = routing.required_arg(request, "run")
    text = routing.required_arg(request, "updates")
    updates = tuning.check_updates(tuning.parse_json_strictly(text))
    ctx, experiment = routing.scope(request)
    return routing.respond_json(request, whatif_impl(reader, ctx, experiment, run, updates))
