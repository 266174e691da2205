"""``GET /restarts``: a job's restarts and resizes (``zero-runtime launch --logdir``), as
markers on the step axis with what each lost, and its goodput."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from werkzeug import wrappers

from tb_plugin import metadata, routing
from tb_plugin.layout import DataContractError
from tb_plugin.reader import Reader

# Largest events file read, bytes (a job restarting every minute for a month is ~20 MB).
MAX_FILE_BYTES = 64 * 2**20


def events_file(reader: Reader, ctx: Any, experiment: str, run: str) -> str | None:
    """The restart events file of ``run``: ``<run dir>/RESTARTS_FILE``, else (a
    multi-worker run ``<job>/worker_<rank>``) the one of its parent directory when that is
    inside the logdir; None when neither exists.

    Raises:
        InvalidArgumentError: no local logdir, or a run outside it.
        NotFoundError: not a run with memory_hierarchy data.
    """
    run_dir = reader.run_dir(ctx, experiment, run)
    root = os.path.realpath(reader.logdir)
    for directory in (run_dir, os.path.dirname(run_dir)):
        if directory != root and not directory.startswith(root + os.sep):
            break  # the parent of a run at the logdir's top is outside it
        path = os.path.join(directory, metadata.RESTARTS_FILE)
        if os.path.isfile(path):
            return path
    return None


def read_events(path: str) -> list[dict[str, Any]]:
    """The events of ``path``, in order. A last line without its newline (the launcher is
    writing it) is left for the next read.

    Raises:
        DataContractError: a file larger than :data:`MAX_FILE_BYTES`, not UTF-8, or a
            complete line that is not a JSON object with a string ``event``.
    """
    if os.path.getsize(path) > MAX_FILE_BYTES:
        raise DataContractError(f"{metadata.RESTARTS_FILE} is larger than {MAX_FILE_BYTES} bytes")
    with open(path, "rb") as f:
        raw = f.read(MAX_FILE_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataContractError(f"{metadata.RESTARTS_FILE} is not UTF-8: {exc}") from None
    lines = text.split("\n")[:-1]  # the part after the last newline is still being written
    events = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError as exc:
            raise DataContractError(
                f"{metadata.RESTARTS_FILE} line {number} is not JSON: {exc}"
            ) from None
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            raise DataContractError(
                f"{metadata.RESTARTS_FILE} line {number} is not an object with an 'event'"
            )
        events.append(event)
    return events


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def marker(event: dict[str, Any]) -> dict[str, Any] | None:
    """The step-axis marker of a ``resume`` event after a restart or resize (None for the
    first group's, or one without a step): ``step``, ``kind`` (:data:`RESTART_KINDS`),
    ``attempt``, ``nproc``, ``cause``, ``steps_lost``, ``seconds_lost``,
    ``restart_seconds`` (null when not known) and ``label`` (one line)."""
    step = event.get("step")
    if event.get("event") != "resume" or not event.get("attempt") or not isinstance(step, int):
        return None
    kind = event.get("kind") if event.get("kind") in metadata.RESTART_KINDS else "restart"
    lost, seconds = event.get("steps_lost"), _number(event.get("seconds_lost"))
    restart = _number(event.get("restart_seconds"))
    cost = []
    if isinstance(lost, int):
        cost.append(f"{lost} step{'' if lost == 1 else 's'}")
    if seconds is not None:
        cost.append(f"{seconds:.1f} s")
    label = f"{kind}: {event.get('cause') or 'cause not recorded'}"
    label += f"; lost {' and '.join(cost)}" if cost else ""
    if restart is not None:
        label += f"; {restart:.1f} s to the first new step"
    return {
        "step": step,
        "kind": kind,
        "attempt": event.get("attempt"),
        "nproc": event.get("nproc"),
        "cause": event.get("cause"),
        "steps_lost": lost if isinstance(lost, int) else None,
        "seconds_lost": seconds,
        "restart_seconds": restart,
        "label": label,
    }


def restarts_impl(reader: Reader, ctx: Any, experiment: str, run: str) -> dict[str, Any]:
    """A job's restarts, resizes and goodput, from the events file of ``run``.

    Args:
        reader: resolves the run's directory.
        ctx: the request context.
        experiment: the experiment id.
        run: the run (its directory, or its parent for ``<job>/worker_<rank>``, holds
            :data:`tb_plugin.metadata.RESTARTS_FILE`).

    Returns:
        ``{"run", "file", "events", "markers", "goodput", "restarts", "resizes",
        "finished", "status"}``: ``file`` the events file's path relative to the logdir
        (null when the run has none: then every list is empty and the rest null or 0);
        ``events`` every event as the launcher wrote it (docs/multiworker/restarts.md);
        ``markers`` one per restart or resize (:func:`marker`), in order; ``goodput`` the
        latest (the ``exit`` event's once the job ended): ``useful_steps``,
        ``all_steps``, ``steps_ratio``, ``useful_seconds``, ``wall_seconds`` (s),
        ``time_ratio``; ``restarts`` and ``resizes`` counted; ``finished`` whether the
        launcher wrote its ``exit`` event, with the job's exit ``status``.

    Raises:
        InvalidArgumentError: no local logdir, or a run outside it.
        NotFoundError: not a run with memory_hierarchy data.
        DataContractError: an events file that is not JSON lines (:func:`read_events`).
    """
    path = events_file(reader, ctx, experiment, run)
    events = read_events(path) if path else []
    goodput = None
    for event in events:
        if isinstance(event.get("goodput"), dict):
            goodput = event["goodput"]
    exits = [e for e in events if e["event"] == "exit"]
    root = os.path.realpath(reader.logdir)
    return {
        "run": run,
        "file": os.path.relpath(path, root) if path else None,
        "events": events,
        "markers": [m for m in map(marker, events) if m is not None],
        "goodput": goodput,
        "restarts": sum(e["event"] == "restart" for e in events),
        "resizes": sum(e["event"] == "resize" for e in events),
        "finished": bool(exits),
        "status": exits[-1].get("status") if exits else None,
    }


@wrappers.Request.application
@routing.json_errors
def restarts_route(reader: Reader, request: wrappers.Request) -> wrappers.Response:
    """GET /restarts?run=R: see :func:`restarts_impl`.

    400 for a missing, empty or over-long run, one that is not a relative path inside the
    logdir (:func:`tb_plugin.routing.run_path_arg`), or no local logdir; 404 for a run
    without memory_hierarchy data; 500 for an events file that is not JSON lines.
    """
    run = routing.run_path_arg(request)
    ctx, experiment = routing.scope(request)
    return routing.respond_json(request, restarts_impl(reader, ctx, experiment, run))
