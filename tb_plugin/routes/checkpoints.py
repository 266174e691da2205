"""``GET /checkpoints``: a run's checkpoint saves and restores, with their bandwidth."""

from __future__ import annotations

import math
from typing import Any

from werkzeug import wrappers

from tb_plugin import metadata, routing
from tb_plugin.layout import DataContractError
from tb_plugin.reader import Reader

# Fields of a memory_hierarchy/checkpoint record served by /checkpoints (docs/events.md).
CHECKPOINT_FIELDS = (
    "op",
    "tag",
    "path",
    "bytes",
    "seconds",
    "replicas",
    "rank",
    "saved_replicas",
)
# Order of a save and a restore at one step in /checkpoints (a record of another op: last).
_CHECKPOINT_OP_ORDER = {"save": 0, "restore": 1}


def _checkpoint_op_order(op: Any) -> int:
    """Sort rank of a checkpoint record's ``op``: save 0, restore 1, anything else 2."""
    return _CHECKPOINT_OP_ORDER.get(op, 2) if isinstance(op, str) else 2


def _rate(amount: Any, seconds: Any) -> float | None:
    """``amount / seconds`` (per second), or None unless both are finite numbers, s > 0."""
    numbers = (int, float)
    if (
        not isinstance(amount, numbers)
        or not isinstance(seconds, numbers)
        or isinstance(amount, bool)
        or isinstance(seconds, bool)
        or not math.isfinite(amount)
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        return None
    return float(amount) / float(seconds)


def checkpoints_impl(reader: Reader, ctx: Any, experiment: str, run: str) -> dict[str, Any]:
    """A run's checkpoint saves and restores: the ``memory_hierarchy/checkpoint`` and
    ``memory_hierarchy/checkpoint_restore`` tags merged (two tags so that TensorBoard's
    ``--load_fast``, one value per run, tag and step, keeps a save and a restore at one
    step; a run written before the restore tag existed has restores under the first).

    Args:
        reader: reads the run's listing and both checkpoint tags.
        ctx: the request context.
        experiment: the experiment id.
        run: the run whose saves and restores to list.

    Returns:
        ``{"run", "checkpoints": [{"step", "wall_time", "op", "tag", "path", "bytes",
        "seconds", "bytes_per_second", "replicas", "rank", "saved_replicas"}]}``
        sorted by ``(step, op)`` with a save before a restore (records of one step and
        op in the order read, an op other than these after both). Fields as the
        runtime wrote them (docs/events.md; a field it did not write is null):
        ``bytes`` (save: shard bytes this worker wrote; restore: bytes verified and
        read), ``seconds`` (wall time of the operation on this worker, s),
        ``saved_replicas`` (restore only). ``bytes_per_second`` is
        ``bytes / seconds`` (write bandwidth of a save, read bandwidth of a restore,
        bytes/s), null when either is missing, not a number or ``seconds <= 0``.
        A run without checkpoint records answers an empty list.

    Raises:
        NotFoundError: the run has no memory_hierarchy data.
        DataContractError: a record that is not a UTF-8 JSON object.
    """
    tags = reader.require_run(ctx, experiment, run)
    rows = []
    for tag in (metadata.TAG_CHECKPOINT, metadata.TAG_CHECKPOINT_RESTORE):
        if tag not in tags:
            continue
        for event in reader.records(ctx, experiment, run, tag):
            value = event["value"]
            if not isinstance(value, dict):
                raise DataContractError(
                    f"run {run!r}, tag {tag!r}, step {event['step']}: record is not a JSON object"
                )
            row = {key: value.get(key) for key in CHECKPOINT_FIELDS}
            row["step"], row["wall_time"] = event["step"], event["wall_time"]
            row["bytes_per_second"] = _rate(row["bytes"], row["seconds"])
            rows.append(row)
    # Stable: records of one step and op keep the order read.
    rows.sort(key=lambda r: (r["step"], _checkpoint_op_order(r["op"])))
    return {"run": run, "checkpoints": rows}


@wrappers.Request.application
@routing.json_errors
def checkpoints_route(reader: Reader, request: wrappers.Request) -> wrappers.Response:
    """GET /checkpoints?run=R: see :func:`checkpoints_impl`.

    400 for a missing, empty or over-long run, or one that is not a relative path
    inside the logdir (absolute, ``..``, a backslash or a NUL:
    :func:`tb_plugin.routing.run_path_arg`); 404 for a run without memory_hierarchy data.
    """
    run = routing.run_path_arg(request)
    ctx, experiment = routing.scope(request)
    return routing.respond_json(request, checkpoints_impl(reader, ctx, experiment, run))
