"""Live tuning from the Memory Hierarchy tab: the plugin's side of the control channel.

The runtime side is :mod:`zero_runtime.control`: the job polls
``<run_dir>/memory_hierarchy_control.json`` at every step boundary and answers in
``<run_dir>/memory_hierarchy_control_ack.json`` and with a ``memory_hierarchy/config_event``
summary. This module holds what the plugin needs to take part safely, with no HTTP in it:

- :func:`parse_tune_body`: the ``POST /tune`` body, strictly (size, JSON, no NaN or
  infinities, no duplicate keys, only tunable keys, ints within their bounds, no bools),
  so that a refused request writes nothing.
- :func:`resolve_run_dir`: a run name to a directory inside the log directory (no ``..``,
  no absolute path, no symlink leading out), for a run the data provider knows.
- :func:`request_state`: the latest request and what the runtime decided about it
  (pending / applied at step N / rejected with reason / ignored).
- :func:`current_values`: the tunable values in effect, from run_info's config plus the
  applied config events.
- :func:`record_problem`: what is wrong with a ``config_event`` record or the
  acknowledgement file (a version or step that is not an int, not a JSON object), so the
  plugin skips and reports it instead of failing the request.
- :func:`job_chief_run`: for a non-chief worker's run of a multi-worker job
  (``<job>/worker_<k>``, k >= 1), the chief's run (``<job>/worker_0``): live tuning applies
  to the whole job, and only the chief reads requests (docs/multiworker/index.md), so the
  plugin writes a request for any worker's run into the chief's.

Only files are used, so TensorBoard and the job may run on different machines that share
the log directory. TensorBoard writes only when started with ``--memory_hierarchy_tuning``
(see :mod:`tb_plugin.loader`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tensorboard import errors

from zero_runtime import control
from zero_runtime.config import TUNABLE_KEYS, ZeroConfig, ZeroConfigError

FLAG_NAME = "memory_hierarchy_tuning"  # the TensorBoard flag that lets the tab write
MAX_BODY_BYTES = 4 * 1024  # largest POST /tune body read, bytes; larger is refused (413)
HEADER_NAME = "X-Memory-Hierarchy-Tuning"  # required on POST /tune; a form cannot set it
HEADER_VALUE = "1"
CONTENT_TYPE = "application/json"  # the only accepted POST /tune Content-Type
#: The file a multi-worker job's chief writes in the job's log directory (the parent of its
#: ``worker_<rank>`` runs): ``zero_runtime.multiworker.CLUSTER_FILE``, not imported from
#: there because that module imports TensorFlow.
CLUSTER_FILE = "cluster.json"
CHIEF_RUN = "worker_0"  # the chief's run directory name inside the job's log directory
_WORKER_RUN = re.compile(r"worker_([0-9]+)")

# Request states shown by the view.
STATE_NONE = "none"  # no request was ever written for the run
STATE_PENDING = "pending"  # written; the job has not decided yet (next step boundary)
STATE_APPLIED = control.Status.APPLIED.value
STATE_REJECTED = control.Status.REJECTED.value
STATE_IGNORED = control.Status.IGNORED.value


def tunable_keys() -> list[dict[str, Any]]:
    """The keys that may be tuned live, from ``zero_runtime.config.TUNABLE_KEYS``.

    Returns:
        ``[{"key", "unit", "min", "max", "description", "takes_effect"}]`` in declaration
        order; ``min`` and ``max`` are inclusive ints in ``unit`` (bytes, elements or
        steps); ``takes_effect`` says when an applied change acts on the running job.
    """
    return [
        {
            "key": t.key,
            "unit": t.unit,
            "min": t.minimum,
            "max": t.maximum,
            "description": t.description,
            "takes_effect": t.takes_effect,
        }
        for t in TUNABLE_KEYS.values()
    ]


def _reject_constant(name: str) -> Any:
    raise errors.InvalidArgumentError(f"{name} is not a number here; values must be finite ints")


def _no_duplicates(pairs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise errors.InvalidArgumentError(f"duplicate key {key!r} in the JSON body")
        out[key] = value
    return out


def parse_json_strictly(text: str, what: str = "the body") -> Any:
    """Decode JSON refusing ``NaN``/``Infinity`` and duplicate keys.

    Args:
        text: the JSON text.
        what: what ``text`` is, for the error message (default ``"the body"``; a query
            parameter's reader names it, e.g. ``"the updates parameter"``).

    Raises:
        tensorboard.errors.InvalidArgumentError: not valid JSON, a non-finite constant, or
            a duplicate key.
    """
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except ValueError as exc:  # json.JSONDecodeError, or int() of too many digits
        raise errors.InvalidArgumentError(f"{what} is not valid JSON: {exc}") from exc


def parse_tune_body(body: bytes) -> dict[str, int]:
    """Decode and check a ``POST /tune`` body: ``{"updates": {key: int, ...}}``.

    Every check runs before anything is written: a body refused here leaves the run's
    directory untouched.

    Args:
        body: the raw request body (at most :data:`MAX_BODY_BYTES`, checked by the caller).

    Returns:
        key -> int value, every key in ``TUNABLE_KEYS`` and within its bounds.

    Raises:
        tensorboard.errors.InvalidArgumentError: not UTF-8 JSON; ``NaN``, ``Infinity`` or
            ``-Infinity`` anywhere (Python's json accepts them; they are refused here); a
            duplicate key; not an object with exactly the key ``updates``; ``updates``
            empty or not an object; an unknown key; a known key that is not tunable; a
            value that is a bool, a float (``3.0`` included), a string, null, or out of the
            key's bounds. The message names the key, the value and what is accepted.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.InvalidArgumentError("the body is not UTF-8") from exc
    parsed = parse_json_strictly(text)
    if not isinstance(parsed, dict) or set(parsed) != {"updates"}:
        raise errors.InvalidArgumentError(
            'the body must be a JSON object {"updates": {key: value, ...}} and nothing else'
        )
    return check_updates(parsed["updates"])


def check_updates(updates: Any) -> dict[str, int]:
    """Check a decoded ``updates`` object: non-empty, only tunable keys, ints within their
    bounds (the checks of :func:`parse_tune_body`, also used by ``GET /whatif``).

    Returns:
        key -> int value.

    Raises:
        tensorboard.errors.InvalidArgumentError: as :func:`parse_tune_body`, naming the
            key, the value and what is accepted.
    """
    if not isinstance(updates, dict) or not updates:
        raise errors.InvalidArgumentError('"updates" must be a non-empty JSON object')
    tunable = ", ".join(TUNABLE_KEYS)
    checked: dict[str, int] = {}
    for key, value in updates.items():
        if key not in TUNABLE_KEYS:
            if key in ZeroConfig.keys():
                raise errors.InvalidArgumentError(
                    f"key {key!r} cannot be tuned live on a running job; tunable keys: {tunable}"
                )
            raise errors.InvalidArgumentError(f"unknown key {key[:80]!r}; tunable keys: {tunable}")
        if isinstance(value, float) and not math.isfinite(value):  # belt and braces
            raise errors.InvalidArgumentError(f"{key}: values must be finite")
        try:
            checked[key] = TUNABLE_KEYS[key].check(value)
        except ZeroConfigError as exc:
            raise errors.InvalidArgumentError(str(exc)) from exc
    return checked


def resolve_run_dir(logdir: str, run: str, known_runs: Iterable[str]) -> str:
    """The directory of a known run, inside the log directory.

    Args:
        logdir: TensorBoard's ``--logdir`` (a local path).
        run: the run name as the data provider reports it (``"."`` for the logdir itself,
            else a relative path such as ``"exp1/seed0"``).
        known_runs: the runs the data provider lists.

    Returns:
        The real (symlink-free) path of the run's directory.

    Raises:
        tensorboard.errors.InvalidArgumentError: no local ``--logdir`` (for example
            ``--logdir_spec`` or a ``gs://`` path); ``run`` absolute, holding ``..``, a
            NUL or a backslash; the run's directory resolving (through symlinks) to a
            place outside the log directory, or not being a directory.
        tensorboard.errors.NotFoundError: ``run`` is not a run the data provider knows.
    """
    if not logdir or "://" in logdir:
        raise errors.InvalidArgumentError(
            "live tuning needs TensorBoard's --logdir to be a local directory"
        )
    if (
        "\0" in run
        or "\\" in run
        or os.path.isabs(run)
        or run.startswith("/")
        or any(part == ".." for part in run.split("/"))
    ):
        raise errors.InvalidArgumentError(f"run {run[:80]!r} is not a path inside the logdir")
    if run not in set(known_runs):
        raise errors.NotFoundError(f"no memory_hierarchy run {run[:80]!r} in this logdir")
    root = os.path.realpath(logdir)
    path = os.path.realpath(os.path.join(root, run))
    if path != root and not path.startswith(root + os.sep):
        raise errors.InvalidArgumentError(
            f"run {run[:80]!r} resolves to a directory outside the logdir"
        )
    if not os.path.isdir(path):
        raise errors.InvalidArgumentError(f"run {run[:80]!r} is not a directory")
    return path


def read_request(run_dir: str) -> dict[str, Any] | None:
    """The run's current control request file, or None when there is none (or unreadable)."""
    try:
        with open(os.path.join(run_dir, control.REQUEST_FILE), encoding="utf-8") as fh:
            obj = json.load(fh)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def record_problem(record: Any) -> str | None:
    """What is wrong with a control decision record, or None when it can be used.

    A decision record is the acknowledgement file's object or a ``config_event``
    summary's value (both ``ControlOutcome.to_dict()``). It is usable when it is a JSON
    object whose ``version`` is an int (not a bool; ``-1`` for an unparseable request) and
    whose ``step``, when present, is an int >= 0. Other fields are read defensively
    where they are used.

    Args:
        record: the decoded JSON (any type).

    Returns:
        None, or a short reason naming the field and the bad value (``"'version' must be
        an int, got 'two'"``).
    """
    if not isinstance(record, Mapping):
        return f"not a JSON object (got {type(record).__name__})"
    version = record.get("version")
    if not _is_int(version):
        return f"'version' must be an int, got {_short_repr(version)}"
    step = record.get("step", 0)
    if not _is_int(step) or step < 0:
        return f"'step' must be an int >= 0, got {_short_repr(step)}"
    return None


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def request_state(
    request: Mapping[str, Any] | None, ack: Mapping[str, Any] | None
) -> dict[str, Any]:
    """What became of the latest request, from the request and acknowledgement files.

    Args:
        request: the request file's object (``{"version", "updates", "requested_at"}``)
            or None.
        ack: the acknowledgement file's object (``ControlOutcome.to_dict()``) or None;
            one :func:`record_problem` finds fault with counts as None.

    Returns:
        ``{"state", "version", "updates", "requested_at", "step", "changes", "reason",
        "decided_at"}``. ``state`` is ``"none"`` (no request), ``"pending"`` (the job has
        not decided on this version yet: it does at its next step boundary, never if it
        has stopped), ``"applied"`` (in effect from ``step``), ``"rejected"`` (``reason``
        says why) or ``"ignored"`` (a version not newer than the last one decided).
        Times are seconds since the epoch; absent fields are null.
    """
    out: dict[str, Any] = {
        "state": STATE_NONE,
        "version": None,
        "updates": None,
        "requested_at": None,
        "step": None,
        "changes": None,
        "reason": None,
        "decided_at": None,
    }
    version = request.get("version") if request else None
    if isinstance(version, int) and not isinstance(version, bool):
        out.update(
            state=STATE_PENDING,
            version=version,
            updates=request.get("updates"),
            requested_at=request.get("requested_at"),
        )
    if not ack or record_problem(ack) is not None:
        return out
    ack_version = ack["version"]
    requested_at = out["requested_at"]
    decided_at = ack.get("decided_at")
    about_this = out["version"] is not None and ack_version >= out["version"]
    # An unparseable request is acknowledged with version -1: it concerns the request file
    # present when it was decided, so it counts when decided after this request was made.
    unreadable = (
        ack_version == -1
        and isinstance(decided_at, int | float)
        and (not isinstance(requested_at, int | float) or decided_at >= requested_at)
    )
    if about_this or unreadable or out["version"] is None:
        out.update(
            state=str(ack.get("status")),
            step=ack.get("step"),
            changes=ack.get("changes"),
            reason=ack.get("reason"),
            decided_at=decided_at,
        )
        if out["version"] is None or about_this:
            out["version"] = ack_version
    return out


def current_values(
    config: Mapping[str, Any] | None,
    config_events: Sequence[Mapping[str, Any]],
    ack: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """The tunable values in effect: the started config plus every applied change.

    Args:
        config: the latest ``run_info`` record's ``config`` (``ZeroConfig.to_dict()``), or
            None when the run recorded none.
        config_events: the run's ``memory_hierarchy/config_event`` records, oldest first,
            as ``{"step", "value"}``; only values with ``status == "applied"`` count, and
            a value :func:`record_problem` finds fault with is skipped.
        ack: the acknowledgement file; an applied decision newer than every recorded
            event counts too (the event may not have been loaded by TensorBoard yet);
            skipped when :func:`record_problem` finds fault with it.

    Returns:
        key -> ``{"value": int | None, "recorded": bool, "since_step": int | None,
        "version": int}`` for every key of ``TUNABLE_KEYS``; ``recorded`` False (and
        ``value`` None) when the run never recorded the key, ``value`` None when it was
        recorded as unset (a budget of None: unbounded),
        ``since_step`` the step from which a live change is in effect (None: as started),
        ``version`` the request version that set it (0: as started).
    """
    started = config if isinstance(config, Mapping) else {}
    values: dict[str, dict[str, Any]] = {
        key: {
            "value": started.get(key),
            "recorded": key in started,
            "since_step": None,
            "version": 0,
        }
        for key in TUNABLE_KEYS
    }
    decided: list[tuple[int, int, Mapping[str, Any]]] = []  # (version, step, changes)
    for event in config_events:
        value = event.get("value")
        if record_problem(value) is None and value.get("status") == STATE_APPLIED:
            decided.append((value["version"], int(event.get("step", 0)), value.get("changes")))
    newest = max((v for v, _s, _c in decided), default=0)
    if record_problem(ack) is None and ack.get("status") == STATE_APPLIED:
        if ack["version"] > newest:
            decided.append((ack["version"], ack.get("step", 0), ack.get("changes")))
    for version, step, changes in sorted(decided, key=lambda d: (d[1], d[0])):
        if not isinstance(changes, Mapping):
            continue
        for key, change in changes.items():
            if key in values and isinstance(change, Mapping) and "new" in change:
                values[key] = {
                    "value": change["new"],
                    "recorded": True,
                    "since_step": step,
                    "version": version,
                }
    return values


def job_chief_run(logdir: str, run: str) -> str | None:
    """The chief's run of the multi-worker job ``run`` belongs to, when ``run`` is another
    worker's; None for the chief's own run and for any run not of a multi-worker job.

    A multi-worker job writes one run per worker, ``<job>/worker_<rank>``, and its chief
    (rank 0) writes ``<logdir>/<job>/cluster.json`` whose ``runs`` lists them
    (``zero_runtime.multiworker``). Only the chief reads control requests; it decides for
    every worker at the same step boundary. So a run counts as a non-chief worker's run
    when its last path component is ``worker_<k>`` with k >= 1 and its parent directory
    holds a ``cluster.json`` whose ``runs`` lists both it and ``worker_0``.

    Args:
        logdir: TensorBoard's ``--logdir`` (a local path; anything else gives None).
        run: a run name (``"job/worker_1"``; ``"worker_1"`` for a job written straight
            into the logdir).

    Returns:
        The chief's run name (``"job/worker_0"`` / ``"worker_0"``), or None.
    """
    if not logdir or "://" in logdir or "\0" in run or os.path.isabs(run):
        return None
    if any(part == ".." for part in run.replace("\\", "/").split("/")):
        return None
    parent, _, base = run.rpartition("/")
    match = _WORKER_RUN.fullmatch(base)
    if match is None or int(match.group(1)) == 0:
        return None
    try:
        with open(os.path.join(logdir, parent, CLUSTER_FILE), encoding="utf-8") as fh:
            cluster = json.load(fh)
    except (OSError, ValueError):
        return None
    runs = cluster.get("runs") if isinstance(cluster, dict) else None
    if not isinstance(runs, list) or base not in runs or CHIEF_RUN not in runs:
        return None
    return f"{parent}/{CHIEF_RUN}" if parent else CHIEF_RUN


def redirect_note(run: str, chief: str) -> str:
    """The text the view shows for a worker run whose tuning goes to the chief's run."""
    return (
        f"{run!r} is a worker of a multi-worker job: live tuning applies to the whole job. "
        f"Requests are written to the chief's run {chief!r}, which decides for every "
        "worker at the same step boundary."
    )
