"""Live tuning: the control-file channel between the Memory Hierarchy tab and a running job.

The channel is two small JSON files in the run's log directory, so it works when
TensorBoard and the job run on different machines that share the log directory:

- ``memory_hierarchy_control.json`` — the *request*, written only by the plugin (or
  :func:`write_request`), atomically (temporary file, then ``os.replace``)::

      {"version": 3, "updates": {"device_budget_bytes": 268435456}, "requested_at": 1.7e9}

  ``version`` increases monotonically; ``updates`` holds only keys of
  ``zero_runtime.config.TUNABLE_KEYS``.
- ``memory_hierarchy_control_ack.json`` — the *acknowledgement*, written only by the
  runtime, atomically, after each request it has decided on::

      {"version": 3, "status": "applied", "step": 120, "changes": {...}, "reason": null}

At every step boundary the runtime's :class:`ControlPoller` calls :meth:`ControlChannel.poll`
(or, across workers, adopts the chief's decision), which costs one
``os.stat`` when nothing changed (the file's inode, modification time and size are
compared).
A newer valid version is applied before the next step; an invalid one is rejected with
its reason and the job continues; a version not newer than the last one decided on is
ignored (an out-of-order or replayed request).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from zero_runtime.atomic_file import write_json_atomic  # also the plugin's (tb_plugin.whatif)
from zero_runtime.config import TUNABLE_KEYS, ZeroConfig, ZeroConfigError, validate_tunable_update

log = logging.getLogger(__name__)

REQUEST_FILE = "memory_hierarchy_control.json"
ACK_FILE = "memory_hierarchy_control_ack.json"
#: Written by the job when it closes (``{"step": next step, "closed_at": unix s}``) and
#: removed when a job starts in the run directory: no job reads requests after it.
CLOSED_FILE = "memory_hierarchy_job_closed.json"
#: Largest control file read, bytes; a larger one is rejected unread.
MAX_REQUEST_BYTES = 64 * 1024


class Status(enum.Enum):
    """What the runtime decided about one request."""

    APPLIED = "applied"  # valid and newer: in effect from ``step`` on
    REJECTED = "rejected"  # malformed or invalid: not applied, ``reason`` says why
    IGNORED = "ignored"  # version not newer than the last decided one


@dataclasses.dataclass(frozen=True)
class ControlOutcome:
    """The decision about one control request.

    Attributes:
        version: the request's version (-1 when the file could not be parsed).
        status: applied, rejected or ignored.
        step: the step from which an applied change is in effect (the next step), or at
            which the request was rejected / ignored.
        changes: key -> ``{"old": value, "new": value}`` (applied requests only).
        reason: why a request was rejected or ignored; None when a user's request was
            applied; for the runtime's own decisions, why it made them.
        decided_at: seconds since the epoch.
        source: ``"user"`` (a control request, e.g. from the tab) or ``"auto"`` (the
            runtime's headroom controller, zero_runtime/runtime/headroom.py).
    """

    version: int
    status: Status
    step: int
    changes: dict[str, dict[str, Any]]
    reason: str | None
    decided_at: float
    source: str = "user"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (the ack file and the ``config_event`` summary)."""
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d


class ControlChannel:
    """Reads a run's control file at step boundaries and decides on each new request.

    Args:
        run_dir: the run's log directory (where the plugin writes the request).
        config: the job's configuration at start (version 0).

    Attributes:
        config: the configuration in effect now.
        version: the version of ``config`` (0 = as started).
        history: every decision so far, oldest first.
    """

    def __init__(self, run_dir: str, config: ZeroConfig) -> None:
        self.run_dir = str(run_dir)
        self.config = config
        self.version = 0
        self.history: list[ControlOutcome] = []
        self._last_decided_version = 0
        self._seen_stat: tuple[int, int, int] | None = None
        try:  # a job starting in this run directory: it reads requests again
            os.remove(os.path.join(self.run_dir, CLOSED_FILE))
        except FileNotFoundError:
            pass

    def mark_closed(self, next_step: int) -> None:
        """Record in the run directory that this job reads no more requests (it closed
        before ``next_step``, a 0-based step): the plugin then refuses live tuning of the
        run (``tb_plugin.routes.tune.job_ended``). An unwritable directory is logged,
        not raised (closing must not fail on it)."""
        try:
            write_json_atomic(
                os.path.join(self.run_dir, CLOSED_FILE),
                {"step": int(next_step), "closed_at": time.time()},
            )
        except OSError as exc:
            log.warning("could not record the job's close in %s: %s", self.run_dir, exc)

    @property
    def request_path(self) -> str:
        """Path of the request file."""
        return os.path.join(self.run_dir, REQUEST_FILE)

    def poll(self, step: int) -> ControlOutcome | None:
        """Check the request file; decide on it if it changed since the last poll.

        Args:
            step: the step about to start (an applied change is in effect from it).

        Returns:
            The outcome when a changed file was decided on, else None. An applied outcome
            has already replaced :attr:`config` and :attr:`version`.
        """
        try:
            st = os.stat(self.request_path)
        except FileNotFoundError:
            return None
        # A request is replaced atomically, so a new request is a new inode; mtime and size
        # catch an in-place edit.
        stat_key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stat_key == self._seen_stat:
            return None
        self._seen_stat = stat_key
        outcome = self._decide(step, st.st_size)
        self.history.append(outcome)
        write_json_atomic(os.path.join(self.run_dir, ACK_FILE), outcome.to_dict())
        return outcome

    def adopt(self, decision: Mapping[str, Any], step: int) -> ControlOutcome:
        """Take a decision made by another channel (the chief's, across workers).

        Multi-worker live tuning: the chief polls its own run's request file and every
        worker adopts its decision at the same step boundary, so the workers never run
        with different configs. An applied decision's changes replace :attr:`config` and
        :attr:`version` (validated against this worker's config); a rejected or ignored
        one is recorded as it is. The acknowledgement is written to this worker's run.

        Args:
            decision: ``ControlOutcome.to_dict()`` of the chief's outcome.
            step: the step about to start (the decision's own step on the chief).

        Returns:
            This worker's outcome (same version, status, changes and reason).

        Raises:
            ZeroConfigError: an applied decision whose values this worker cannot take
                (it would otherwise diverge from the chief).
        """
        status = Status(decision["status"])
        version = int(decision["version"])
        changes = {k: dict(v) for k, v in (decision.get("changes") or {}).items()}
        if status is Status.APPLIED:
            if changes:  # an applied request may change nothing (values already in effect)
                updates = {k: v["new"] for k, v in changes.items()}
                self.config = validate_tunable_update(self.config, updates)
            self.version = version
            self._last_decided_version = max(self._last_decided_version, version)
        outcome = self._outcome(version, status, step, decision.get("reason"), changes)
        self.history.append(outcome)
        write_json_atomic(os.path.join(self.run_dir, ACK_FILE), outcome.to_dict())
        return outcome

    def apply_auto(self, updates: Mapping[str, Any], step: int, reason: str) -> ControlOutcome:
        """Apply the runtime's own decision (``device_budget_bytes='auto'``).

        The change is validated like a request and replaces :attr:`config`; the version
        stays (it numbers the user's requests), and the outcome, with ``source='auto'``
        and ``reason``, is recorded in :attr:`history` (not acknowledged: the ack file
        answers the user's requests).

        Args:
            updates: tunable key -> new value (may be empty: a decision that only reports).
            step: the step from which the change is in effect.
            reason: why (one sentence with the figures).

        Raises:
            ZeroConfigError: an update outside ``TUNABLE_KEYS`` bounds.
        """
        new = validate_tunable_update(self.config, dict(updates))
        changes = {
            k: {"old": getattr(self.config, k), "new": getattr(new, k)}
            for k in updates
            if getattr(self.config, k) != getattr(new, k)
        }
        self.config = new
        outcome = ControlOutcome(
            self.version, Status.APPLIED, step, changes, reason, time.time(), "auto"
        )
        self.history.append(outcome)
        return outcome

    def _decide(self, step: int, size: int) -> ControlOutcome:
        if size > MAX_REQUEST_BYTES:
            return self._outcome(
                -1, Status.REJECTED, step, f"request larger than {MAX_REQUEST_BYTES} bytes"
            )
        try:
            with open(self.request_path, encoding="utf-8") as fh:
                request = json.load(fh)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return self._outcome(-1, Status.REJECTED, step, f"unreadable request: {exc}")
        version = request.get("version") if isinstance(request, dict) else None
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            return self._outcome(
                -1, Status.REJECTED, step, f"'version' must be an int >= 1, got {version!r}"
            )
        if version <= self._last_decided_version:
            return self._outcome(
                version,
                Status.IGNORED,
                step,
                f"version {version} is not newer than {self._last_decided_version}",
            )
        self._last_decided_version = version
        updates = request.get("updates")
        try:
            new = validate_tunable_update(self.config, updates)
        except ZeroConfigError as exc:
            return self._outcome(version, Status.REJECTED, step, str(exc))
        changes = {
            k: {"old": getattr(self.config, k), "new": getattr(new, k)}
            for k in updates
            if getattr(self.config, k) != getattr(new, k)
        }
        self.config = new
        self.version = version
        return self._outcome(version, Status.APPLIED, step, None, changes)

    @staticmethod
    def _outcome(version, status, step, reason, changes=None) -> ControlOutcome:
        return ControlOutcome(version, status, step, changes or {}, reason, time.time())


#: Replaces :meth:`ControlChannel.poll` at a step boundary across workers:
#: ``(channel, next_step) -> ControlOutcome | None`` (the chief decides, every worker adopts;
#: ``MultiWorkerZeroInfinityStrategy._sync_control``).
ControlSync = Callable[[ControlChannel, int], "ControlOutcome | None"]


class ControlPoller:
    """The step boundary's live-tuning decision for one runtime.

    One process: the run's own :class:`ControlChannel` decides (:meth:`ControlChannel.poll`).
    Multi-worker: ``sync`` (passed per call, as it is set after the runtime is built)
    makes the chief's decision every worker's. Each decision is logged; applying an
    applied change to the runtime (its config, the stage-3 pools, the summary) is the
    caller's.

    Args:
        channel: the run's control channel.
    """

    def __init__(self, channel: ControlChannel) -> None:
        self.channel = channel

    def poll(self, next_step: int, sync: ControlSync | None = None) -> ControlOutcome | None:
        """Decide on a new control request before ``next_step`` runs.

        Args:
            next_step: the step about to start (an applied change is in effect from it).
            sync: None in one process, else the multi-worker decision (:data:`ControlSync`).

        Returns:
            The outcome, or None when there was nothing new. An applied outcome has
            replaced ``channel.config`` and ``channel.version``.

        Raises:
            ZeroConfigError: ``sync`` adopted a decision this worker cannot take.
        """
        if sync is not None:
            outcome = sync(self.channel, next_step)
        else:
            outcome = self.channel.poll(next_step)
        if outcome is None:
            return None
        if outcome.status is Status.APPLIED:
            log.info(
                "live tuning: applied version %d at step %d: %s",
                outcome.version,
                next_step,
                outcome.changes,
            )
        else:
            log.warning(
                "live tuning: %s version %d: %s",
                outcome.status.value,
                outcome.version,
                outcome.reason,
            )
        return outcome


def write_request(run_dir: str, updates: Mapping[str, Any]) -> int:
    """Write a new control request for a run, atomically; returns its version.

    The version is one more than the version in the existing request file (1 if none).
    When the runtime has not yet acknowledged the existing request, its updates are kept
    in the new one (the new values win), so no request is lost between two step
    boundaries. Only keys of ``TUNABLE_KEYS`` within their bounds are accepted; nothing is
    written otherwise.

    Args:
        run_dir: the run's log directory (must exist).
        updates: key -> new value (ints, see ``TUNABLE_KEYS``).

    Raises:
        ZeroConfigError: an unknown or non-tunable key, or a value out of bounds or of the
            wrong type (NaN and infinities included).
        FileNotFoundError: ``run_dir`` does not exist.
    """
    if not isinstance(updates, Mapping) or not updates:
        raise ZeroConfigError(f"updates must be a non-empty mapping, got {updates!r}")
    checked = {}
    for key, value in updates.items():
        if key not in TUNABLE_KEYS:
            raise ZeroConfigError(
                f"key {key!r} cannot be tuned live; tunable keys: {', '.join(TUNABLE_KEYS)}",
                key=key,
                value=value,
                accepted=", ".join(TUNABLE_KEYS),
            )
        checked[key] = TUNABLE_KEYS[key].check(value)
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory {run_dir!r} does not exist")
    path = os.path.join(run_dir, REQUEST_FILE)
    previous, pending = 0, {}
    try:
        with open(path, encoding="utf-8") as fh:
            old = json.load(fh)
        if isinstance(old, dict) and isinstance(old.get("version"), int):
            previous = old["version"]
            ack = read_ack(run_dir)
            decided = ack.get("version") if isinstance(ack, dict) else None
            if not isinstance(decided, int) or isinstance(decided, bool):
                decided = 0  # no (well-formed) acknowledgement: nothing decided yet
            if previous > decided and isinstance(old.get("updates"), dict):
                # The runtime has not decided on the previous request yet: keep its changes,
                # so that a request written before the next step boundary is not lost.
                pending = {k: v for k, v in old["updates"].items() if k in TUNABLE_KEYS}
    except (OSError, ValueError):
        pass
    checked = {**pending, **checked}
    version = previous + 1
    write_json_atomic(path, {"version": version, "updates": checked, "requested_at": time.time()})
    return version


def read_closed(run_dir: str) -> dict[str, Any] | None:
    """The job's close record of a run (:meth:`ControlChannel.mark_closed`), or None while
    no job has closed there (or a new one started)."""
    try:
        with open(os.path.join(run_dir, CLOSED_FILE), encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def read_ack(run_dir: str) -> dict[str, Any] | None:
    """The runtime's last acknowledgement for a run, or None when there is none yet."""
    try:
        with open(os.path.join(run_dir, ACK_FILE), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None
