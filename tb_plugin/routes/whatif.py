"""``GET /whatif``: a proposed live-tuning change's predicted effect, before it is applied.

The prediction replays the run's recorded access trace through the pool's own core
(:mod:`tb_plugin.whatif`, :mod:`zero_runtime.memory.simulate`); nothing is written and
nothing is asked of the job, so the route answers whether or not TensorBoard may tune.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from werkzeug import wrappers

from tb_plugin import metadata, routing, tuning, whatif
from tb_plugin.reader import Reader
from tb_plugin.routes.diff import _columns
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
        ``stall_seconds_per_miss``, ``notes`` (docs/http/tuning.md), ``scope`` (what the
        replay covers) and ``run_recorded`` (:func:`run_recorded`).

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
    out["scope"] = SCOPE
    out["run_recorded"] = run_recorded(reader, ctx, experiment, run, out["steps"])
    return out


#: What the replay covers: the access trace is the stage-3 pool's only.
SCOPE = (
    "the stage-3 pool's pages only (parameter shards and their gathers); the page moves "
    "of the job's other pools, such as the NVMe optimizer-state store (its own pool), are "
    "not in the trace and not replayed, and these keys do not change them in the running job"
)


#: Directions of page moves (``zero_runtime.memory.counters.DIRECTIONS``; ``h2n_clean``:
#: a clean page evicted to NVMe with no write, absent from runs written before it).
_DIRECTIONS = ("d2h", "h2d", "h2n", "n2h", "h2n_clean")
_RUN_PAGE_FIELDS = [("", f"{d}_pages") for d in _DIRECTIONS] + [
    ("", "prefetch_misses"),
    ("", "stall_seconds"),
]


def run_recorded(
    reader: Reader, ctx: Any, experiment: str, run: str, steps: list[int]
) -> dict[str, Any] | None:
    """The whole run's recorded figures over the replayed ``steps``, as the Page moves and
    tiers panels show them (``memory_hierarchy/pages`` and ``tiers``: every pool of the
    job, the optimizer-state store's included), to set beside the pool's ``recorded``.

    Returns:
        ``{"moves_per_step": {"d2h"|"h2d"|"h2n"|"n2h"|"h2n_clean": pages per step (mean;
        None: not measured)},
        "prefetch_misses": pages per step, "stall_seconds": seconds per step,
        "nvme_used_bytes": NVMe used at the last of those steps (bytes) or None,
        "steps": how many of ``steps`` the run's series holds}``, or None when it holds
        none of them.
    """
    got, values = _columns(reader, ctx, experiment, run, metadata.TAG_PAGES, _RUN_PAGE_FIELDS)
    rows = values[np.isin(got, steps)]
    if not len(rows):
        return None
    means = [
        float(np.nanmean(rows[:, j])) if np.isfinite(rows[:, j]).any() else None
        for j in range(rows.shape[1])
    ]
    t_steps, nvme = _columns(
        reader, ctx, experiment, run, metadata.TAG_TIERS, [("nvme", "used_bytes")]
    )
    nvme = nvme[np.isin(t_steps, steps), 0]
    return {
        "moves_per_step": dict(zip(_DIRECTIONS, means[:5], strict=True)),
        "prefetch_misses": means[5],
        "stall_seconds": means[6],
        "nvme_used_bytes": float(nvme[-1]) if len(nvme) and np.isfinite(nvme[-1]) else None,
        "steps": len(rows),
    }


@wrappers.Request.application
@routing.json_errors
def whatif_route(reader: Reader, request: wrappers.Request) -> wrappers.Response:
    """GET /whatif?run=R&updates={"key": value, ...}: see :func:`whatif_impl`. ``updates``
    is a JSON object checked as ``POST /tune``'s (400 otherwise)."""
    run = routing.required_arg(request, "run")
    text = routing.required_arg(request, "updates")
    updates = tuning.check_updates(tuning.parse_json_strictly(text, "the updates parameter"))
    ctx, experiment = routing.scope(request)
    return routing.respond_json(request, whatif_impl(reader, ctx, experiment, run, updates))
