"""``GET /tuning`` and ``POST /tune``: the live-tuning panel's routes.

``GET /tuning`` shows a run's tunable keys, their values in effect and the latest
request's state; ``POST /tune`` writes a request through
:func:`zero_runtime.control.write_request`, only when TensorBoard was started with
``--memory_hierarchy_tuning`` (:mod:`tb_plugin.loader`) and only from a page this
TensorBoard serves (:mod:`tb_plugin.origin`). The checks and the channel's state live in
:mod:`tb_plugin.tuning`; the typed HTTP errors of the write route live here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from tensorboard import errors
from werkzeug import wrappers

from tb_plugin import metadata, origin, routing, tuning, whatif
from tb_plugin.reader import Reader
from zero_runtime import control


class TuningDisabledError(errors.PublicError):
    """POST /tune while TensorBoard runs without ``--memory_hierarchy_tuning`` (HTTP 403)."""

    http_code = 403


class MethodNotAllowedError(errors.PublicError):
    """A route asked with a method it does not serve (HTTP 405, ``Allow`` header set)."""

    http_code = 405

    def __init__(self, details: str, allow: str) -> None:
        super().__init__(details)
        self.headers = [("Allow", allow)]


class ChiefRunMissingError(errors.PublicError):
    """POST /tune for a non-chief worker's run whose chief run this TensorBoard does not
    list (HTTP 409): the request cannot reach the job, so nothing is written."""

    http_code = 409


class ControlFileError(errors.PublicError):
    """POST /tune over a run whose acknowledgement file is malformed (HTTP 409): the
    request's version cannot be derived from it, so nothing is written; the message names
    the file, the bad field and how to recover."""

    http_code = 409


class JobEndedError(errors.PublicError):
    """POST /tune over a run whose job has ended: an out-of-memory failure (its
    ``memory_hierarchy/oom`` post-mortem exists) or a normal close (its close marker);
    HTTP 409: no job reads the request, so nothing is written."""

    http_code = 409


def job_ended(reader: Reader, ctx: Any, experiment: str, run: str) -> dict[str, Any] | None:
    """How the run's job ended, or None while it may still run (and read requests).

    ``{"reason": "oom", "step": int, "summary": str | None}`` when the run's last record is
    an out-of-memory post-mortem (the job is dead: a post-mortem is written as it fails);
    ``{"reason": "closed", "step": int, "summary": None}`` when the job closed normally
    (its ``zero_runtime.control.CLOSED_FILE`` marker, removed when a job starts again in
    the run directory; ``step`` is the step after its last). A run with step records
    after its post-mortem (a job started again in the same run directory) is not ended.
    """
    records = reader.records_if_any(ctx, experiment, run, metadata.TAG_OOM)
    if records:
        last = records[-1]
        steps = reader.listing(ctx, experiment).get(run, {}).get(metadata.TAG_TIERS)
        if steps is None or int(getattr(steps, "max_step", -1)) <= int(last["step"]):
            value = last["value"] if isinstance(last.get("value"), dict) else {}
            summary = value.get("summary") if isinstance(value.get("summary"), str) else None
            return {"reason": "oom", "step": int(last["step"]), "summary": summary}
    try:
        run_dir = reader.run_dir(ctx, experiment, run)
    except (errors.InvalidArgumentError, errors.NotFoundError):
        return None
    closed = control.read_closed(run_dir)
    if closed is None:
        return None
    return {"reason": "closed", "step": closed["step"], "summary": None}


def require_running(reader: Reader, ctx: Any, experiment: str, run: str) -> None:
    """Raise JobEndedError (409) when the run's job has ended (:func:`job_ended`)."""
    ended = job_ended(reader, ctx, experiment, run)
    if ended is None:
        return
    how = (
        f"ended with an out-of-memory failure at step {ended['step']}"
        if ended["reason"] == "oom"
        else f"closed after step {ended['step'] - 1}"
    )
    raise JobEndedError(
        f"the job of {run[:80]!r} has ended ({how}): no job reads live-tuning requests "
        "any more; nothing was written (apply the change to the next run's config)"
    )


class PayloadTooLargeError(errors.PublicError):
    """A POST body larger than :data:`tb_plugin.tuning.MAX_BODY_BYTES` (HTTP 413)."""

    http_code = 413


class UnsupportedMediaTypeError(errors.PublicError):
    """A POST body whose Content-Type is not ``application/json`` (HTTP 415)."""

    http_code = 415


@dataclass
class TuningAccess:
    """What the tuning routes need besides the reader: whether and from where to write.

    Attributes:
        enabled: TensorBoard was started with ``--memory_hierarchy_tuning``.
        flags: TensorBoard's parsed flags (``host``, ``bind_all`` for
            :func:`tb_plugin.origin.check_same_origin`); None in a bare test context.
        lock: one request written at a time, so versions do not collide.
    """

    enabled: bool = False
    flags: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def require_enabled(self) -> None:
        """Raise TuningDisabledError unless started with ``--memory_hierarchy_tuning``."""
        if not self.enabled:
            raise TuningDisabledError(
                f"live tuning is off: start TensorBoard with --{tuning.FLAG_NAME} to let "
                "the tab change running jobs"
            )


def _ack_problem(run: str, ack: Any) -> str | None:
    """What is wrong with a run's acknowledgement file (naming it), or None (also absent)."""
    problem = None if ack is None else tuning.record_problem(ack)
    return None if problem is None else f"{control.ACK_FILE} of run {run[:80]!r}: {problem}"


def _ack_errors(run: str, ack: Any) -> list[str]:
    """``[reason]`` for /tuning's ``data_errors`` when the ack is malformed, else ``[]``."""
    problem = _ack_problem(run, ack)
    return [] if problem is None else [f"{problem}; skipped"]


def _event_errors(events: list[dict[str, Any]]) -> list[str]:
    """``data_errors`` entries for the ``config_event`` records that are malformed."""
    out = []
    for event in events:
        problem = tuning.record_problem(event["value"])
        if problem is not None:
            out.append(f"{metadata.TAG_CONFIG_EVENT} at step {event['step']}: {problem}; skipped")
    return out


def tuning_impl(
    reader: Reader, access: TuningAccess, ctx: Any, experiment: str, run: str
) -> dict[str, Any]:
    """A run's tunable keys, the values in effect and the latest request's state.

    Args:
        reader: the plugin's reader.
        access: whether this TensorBoard may write requests.
        ctx: the request context.
        experiment: the experiment id.
        run: the run name.

    Returns:
        ``{"run", "enabled", "flag", "keys": [{"key", "unit", "min", "max",
        "description", "takes_effect", "acts", "value", "recorded", "since_step",
        "version"}],
        "config_version", "job_ended", "predictions", "trace_steps",
        "request": tuning.request_state(...), "run_dir_error", "tuning_run",
        "tuning_note", "data_errors"}``: ``enabled`` is whether
        this TensorBoard may write requests; ``value`` the value in effect (null when
        the run never recorded it); ``config_version`` the version of the newest
        applied request (0: as started); ``run_dir_error`` says why the run's
        directory cannot be read (null normally; the request state is then "none").
        ``tuning_run`` is the run ``POST /tune`` writes to: ``run`` itself, or for a
        non-chief worker of a multi-worker job the chief's run
        (:func:`tuning.job_chief_run`), whose request and decision ``request`` then
        shows (the job's); ``tuning_note`` says so (null for an ordinary run).
        ``acts``: whether an applied change of the key acts on this run's job
        (``zero_runtime.config.Tunable.acts_in`` of its recorded config; null: unknown).
        ``job_ended`` is :func:`job_ended` (null while the job may still run).
        ``predictions`` is :func:`tb_plugin.whatif.outcomes`: each request predicted at
        ``POST /tune``, with what the job measured once it applied it. ``trace_steps``
        the steps of the run's recorded access trace (:func:`tb_plugin.whatif.trace_steps`;
        ``[]``: nothing to replay): with any, ``GET /whatif`` can predict a change even
        when this TensorBoard may not tune or the job has ended. ``page_size_bytes``: the
        page size of a stage-3 run's paged pool (its device budget counts whole pages),
        null for other stages.
        ``data_errors`` lists the malformed ``config_event`` records and
        acknowledgements that were skipped (:func:`tuning.record_problem`), each naming
        the record and what is wrong; empty normally.

    Raises:
        NotFoundError: the run has no memory_hierarchy data.
    """
    reader.require_run(ctx, experiment, run)
    run_infos = reader.records_if_any(ctx, experiment, run, metadata.TAG_RUN_INFO)
    config = run_infos[-1]["value"].get("config") if run_infos else None
    events = reader.records_if_any(ctx, experiment, run, metadata.TAG_CONFIG_EVENT)
    data_errors = _event_errors(events)
    request = ack = None
    run_dir_error = None
    try:
        run_dir = reader.run_dir(ctx, experiment, run)
        request, ack = tuning.read_request(run_dir), control.read_ack(run_dir)
    except errors.InvalidArgumentError as exc:
        run_dir_error = str(exc)
    data_errors += _ack_errors(run, ack)
    values = tuning.current_values(config if isinstance(config, dict) else None, events, ack)
    started = config if isinstance(config, dict) else None
    keys = [
        {**spec, **values[spec["key"]], "acts": tuning.TUNABLE_KEYS[spec["key"]].acts_in(started)}
        for spec in tuning.tunable_keys()
    ]
    # A non-chief worker: the job's request and decision live in the chief's run.
    chief = None if run_dir_error else tuning.job_chief_run(reader.logdir, run)
    note = None
    if chief is not None:
        note = tuning.redirect_note(run, chief)
        try:
            chief_dir = reader.run_dir(ctx, experiment, chief)
            request, ack = tuning.read_request(chief_dir), control.read_ack(chief_dir)
            data_errors += _ack_errors(chief, ack)
        except (errors.InvalidArgumentError, errors.NotFoundError):
            note += " This TensorBoard does not list that run, so it cannot tune the job."
    predictions = []
    trace_steps: list[int] = []
    if not run_dir_error:
        try:
            where = reader.run_dir(ctx, experiment, chief or run)
            predictions = whatif.outcomes(where, events, ack, persist=access.enabled)
            trace_steps = whatif.trace_steps(reader.run_dir(ctx, experiment, run))
        except (errors.InvalidArgumentError, errors.NotFoundError):
            pass
    return {
        "run": run,
        "enabled": access.enabled,
        "flag": f"--{tuning.FLAG_NAME}",
        "keys": keys,
        "predictions": predictions,
        "trace_steps": trace_steps,
        "page_size_bytes": _stage3_page_size(started),
        "config_version": max((v["version"] for v in values.values()), default=0),
        "job_ended": job_ended(reader, ctx, experiment, run),
        "request": tuning.request_state(request, ack),
        "run_dir_error": run_dir_error,
        "tuning_run": chief or run,
        "tuning_note": note,
        "data_errors": data_errors,
    }


@wrappers.Request.application
@routing.json_errors
def tuning_route(
    reader: Reader, access: TuningAccess, request: wrappers.Request
) -> wrappers.Response:
    """GET /tuning?run=R: see :func:`tuning_impl`."""
    run = routing.required_arg(request, "run")
    ctx, experiment = routing.scope(request)
    return routing.respond_json(request, tuning_impl(reader, access, ctx, experiment, run))


MAX_TUNING_RUNS = 1000  # runs one GET /tuning_states may name


def tuning_states_impl(
    reader: Reader, access: TuningAccess, ctx: Any, experiment: str, runs: list[str] | None
) -> dict[str, Any]:
    """Every named run's :func:`tuning_impl` answer in one (the view's poll).

    Args:
        reader: the plugin's reader.
        access: whether this TensorBoard may write requests.
        ctx: the request context.
        experiment: the experiment id.
        runs: the runs to answer for; None = every run with memory_hierarchy data.

    Returns:
        ``{"runs": {run: tuning_impl answer, or {"error": {"code", "message"}} for a run
        that cannot be answered (404: not a run of this logdir)}}``.
    """
    if runs is None:
        runs = sorted(reader.listing(ctx, experiment))
    out: dict[str, Any] = {}
    for run in runs:
        try:
            out[run] = tuning_impl(reader, access, ctx, experiment, run)
        except errors.PublicError as exc:
            out[run] = {"error": {"code": exc.http_code, "message": str(exc)}}
    return {"runs": out}


@wrappers.Request.application
@routing.json_errors
def tuning_states_route(
    reader: Reader, access: TuningAccess, request: wrappers.Request
) -> wrappers.Response:
    """GET /tuning_states[?run=A&run=B...]: see :func:`tuning_states_impl` (no ``run``:
    every run)."""
    names = request.args.getlist("run")
    if len(names) > MAX_TUNING_RUNS:
        raise errors.InvalidArgumentError(
            f"at most {MAX_TUNING_RUNS} 'run' parameters, got {len(names)}"
        )
    for name in names:
        if not name or len(name) > routing.MAX_QUERY_VALUE_CHARS:
            raise errors.InvalidArgumentError(
                f"each 'run' must be 1 to {routing.MAX_QUERY_VALUE_CHARS} characters"
            )
    ctx, experiment = routing.scope(request)
    body = tuning_states_impl(reader, access, ctx, experiment, names or None)
    return routing.respond_json(request, body)


def tune_impl(
    reader: Reader,
    access: TuningAccess,
    ctx: Any,
    experiment: str,
    run: str,
    updates: dict[str, int],
) -> dict[str, Any]:
    """Write a live-tuning request for a run (``zero_runtime.control.write_request``).

    Args:
        reader: the plugin's reader.
        access: whether this TensorBoard may write requests, and the write lock.
        ctx: the request context.
        experiment: the experiment id.
        run: the run name.
        updates: checked key -> int (see :func:`tuning.parse_tune_body`).

    Returns:
        ``{"run", "version", "updates", "request", "tuning_run", "redirected",
        "tuning_note", "prediction"}``: the version written, the updates
        the request file now holds (a pending earlier request's are merged in) and
        its state (``"pending"`` until the job's next step boundary).
        ``tuning_run`` is the run written to: ``run``, or for a non-chief worker of a
        multi-worker job the chief's run (:func:`tuning.job_chief_run`: tuning
        applies to the whole job and only the chief reads requests), in which case
        ``redirected`` is true and ``tuning_note`` says so (else null).

    Raises:
        TuningDisabledError: TensorBoard runs without ``--memory_hierarchy_tuning``.
        InvalidArgumentError: the run's directory is not inside the logdir.
        NotFoundError: not a run of this logdir.
        ChiefRunMissingError: a non-chief worker's run whose chief run this
            TensorBoard does not list (409; nothing written).
        ControlFileError: the run's acknowledgement file is malformed (409; nothing
            written).
        JobEndedError: the run's job ended, by an out-of-memory failure or a normal
            close (409; nothing written).
    """
    access.require_enabled()
    run_dir = reader.run_dir(ctx, experiment, run)
    require_running(reader, ctx, experiment, run)
    chief = tuning.job_chief_run(reader.logdir, run)
    if chief is not None:
        try:
            run_dir = reader.run_dir(ctx, experiment, chief)
        except (errors.InvalidArgumentError, errors.NotFoundError) as exc:
            raise ChiefRunMissingError(
                f"{run[:80]!r} is a worker of a multi-worker job whose live tuning is "
                f"decided by the chief's run {chief[:80]!r}, which cannot be written "
                f"here ({exc}); nothing was written"
            ) from exc
    with access.lock:
        problem = _ack_problem(chief or run, control.read_ack(run_dir))
        if problem is not None:
            raise ControlFileError(
                f"{problem}. Only the runtime writes that file: remove it (the job writes "
                "a new one at its next decision) and try again; nothing was written"
            )
        version = control.write_request(run_dir, updates)
        written = tuning.read_request(run_dir)
        ack = control.read_ack(run_dir)
        merged = (written or {}).get("updates", updates)
        prediction = whatif.record(
            run_dir, version, merged if isinstance(merged, dict) else updates
        )
    return {
        "run": run,
        "version": version,
        "updates": (written or {}).get("updates", updates),
        "request": tuning.request_state(written, ack),
        "tuning_run": chief or run,
        "redirected": chief is not None,
        "tuning_note": tuning.redirect_note(run, chief) if chief else None,
        "prediction": prediction,
    }


@wrappers.Request.application
@routing.json_errors
def tune_route(
    reader: Reader, access: TuningAccess, request: wrappers.Request
) -> wrappers.Response:
    """POST /tune?run=R with ``{"updates": {...}}``: see :func:`tune_impl`.

    Refused, with nothing written: another method (405); a run whose job has ended
    (409, whether tuning is on or off); tuning off (403); a ``Host``
    or ``Origin`` that is not an address this TensorBoard serves (403, a DNS rebinding
    guard: :func:`tb_plugin.origin.check_same_origin`); without the header
    ``X-Memory-Hierarchy-Tuning: 1`` (403, so a cross-site form cannot post it); a
    Content-Type other than ``application/json`` (415); a body over
    ``tuning.MAX_BODY_BYTES`` (413); a body :func:`tuning.parse_tune_body` refuses or a
    run outside the logdir (400); an unknown run (404); a non-chief worker's run whose
    chief run is not listed, a malformed acknowledgement file or a job that ended with an
    out-of-memory failure (409). A worker's run
    is written to its chief's.
    """
    if request.method != "POST":
        raise MethodNotAllowedError("/tune accepts only POST", allow="POST")
    if not access.enabled and request.args.get("run"):
        # a job that has ended takes no request whatever the flag: say so, not "restart"
        ctx, experiment = routing.scope(request)
        require_running(reader, ctx, experiment, request.args["run"])
    access.require_enabled()
    origin.check_same_origin(request.environ, access.flags, "POST /tune")
    if request.headers.get(tuning.HEADER_NAME) != tuning.HEADER_VALUE:
        raise errors.PermissionDeniedError(
            f"POST /tune needs the header {tuning.HEADER_NAME}: {tuning.HEADER_VALUE}"
        )
    if request.mimetype != tuning.CONTENT_TYPE:
        raise UnsupportedMediaTypeError(
            f"POST /tune needs Content-Type {tuning.CONTENT_TYPE}, got {request.mimetype[:80]!r}"
        )
    limit = tuning.MAX_BODY_BYTES
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLargeError(f"the body is larger than {limit} bytes")
    body = request.stream.read(limit + 1)
    if len(body) > limit:
        raise PayloadTooLargeError(f"the body is larger than {limit} bytes")
    run = routing.required_arg(request, "run")
    updates = tuning.parse_tune_body(body)
    ctx, experiment = routing.scope(request)
    answer = tune_impl(reader, access, ctx, experiment, run, updates)
    return routing.respond_json(request, answer)


def _stage3_page_size(config: dict | None) -> int | None:
    """The paged pool's page size of a stage-3 run's started config (bytes), else None."""
    if not isinstance(config, dict) or config.get("stage") != 3:
        return None
    size = config.get("page_size_bytes")
    return size if isinstance(size, int) and not isinstance(size, bool) else None
