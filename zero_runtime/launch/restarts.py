"""What failed in a worker group, whether a restart can help, and the restart events file.

:func:`describe` turns a :class:`~zero_runtime.launch.group.GroupOutcome` into a
:class:`Failure`: the rank to blame (the worker that failed, or the peer it named: a
stalled worker is still running when its peer's collective times out), its exit status or
signal, and the named failure (the peer report, or the last exception line of its output).

A failure is restartable unless a restart would fail the same way: exit status 2 (bad
arguments, argparse's and this project's convention), or an exception that depends only on
the input (:data:`NOT_RESTARTABLE_ERRORS`: a checkpoint of another model, a damaged
checkpoint, a bad config, an import error). Everything else is restarted: a non-zero exit,
a signal (kill -9, the kernel's out-of-memory killer), an out-of-memory error, a hang the
collective watchdog named, a preemption (exit 42).

:class:`EventLog` appends one JSON object per line (docs/multiworker/restarts.md, "A job that heals
itself"); it writes nothing until the first restart, so a job that never restarts (or
fails on bad input) leaves its directory as it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import time
from typing import Any

from zero_runtime.launch.group import PREEMPTED_EXIT_STATUS, GroupOutcome, exit_status

#: Exit status of a usage error (argparse; ``zero-runtime``): the same arguments fail again.
USAGE_EXIT_STATUS = 2

#: Exceptions that fail the same way on every restart (matched by class name in the
#: worker's last exception line).
NOT_RESTARTABLE_ERRORS = (
    "CheckpointMismatchError",
    "CheckpointCorruptError",
    "CheckpointNotFoundError",
    "ZeroConfigError",
    "TFConfigError",
    "NotImplementedError",
    "SyntaxError",
    "ImportError",
    "ModuleNotFoundError",
)

#: The events file's name in the checkpoint directory.
EVENTS_FILE = "restarts.jsonl"
#: Its copy in the job's TensorBoard log directory (``launch --logdir``), which the
#: Memory Hierarchy tab reads (``tb_plugin.metadata.RESTARTS_FILE``, the same name).
LOGDIR_EVENTS_FILE = "memory_hierarchy_restarts.jsonl"

# "pkg.mod.SomeError: message" as Python prints an exception's last traceback line.
_EXCEPTION_LINE = re.compile(r"^(?:\[rank \d+\] )?([A-Za-z_][\w.]*(?:Error|Exception|Exit)): (.*)$")

_SIGNAL_NOTES = {
    signal.SIGKILL: "kill -9, or the kernel's out-of-memory killer",
    signal.SIGALRM: "its preemption grace period ran out before it saved",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGABRT: "an abort in native code",
}


@dataclasses.dataclass(frozen=True)
class Failure:
    """One worker group's failure.

    Attributes:
        rank: the rank blamed (the failed worker, or the peer it named).
        reported_by: the rank whose exit revealed it (== ``rank`` unless a peer named it).
        pid: the blamed worker's pid.
        exit_status: the first failed worker's status (``128 + S`` for signal S).
        signal: the signal's name when a signal ended the first failed worker, else None.
        cause: one line: what happened, e.g. ``"killed by SIGKILL (kill -9, or the kernel's
            out-of-memory killer)"`` or ``"exited with status 1: DeadlineExceededError:
            ..."``.
        restartable: False when a restart would fail the same way.
        uptime_seconds: seconds from the group's start to the failure.
    """

    rank: int
    reported_by: int
    pid: int
    exit_status: int
    signal: str | None
    cause: str
    restartable: bool
    uptime_seconds: float

    def line(self) -> str:
        """The failure in one line, naming the rank."""
        by = f" (reported by rank {self.reported_by})" if self.reported_by != self.rank else ""
        return f"rank {self.rank}{by}: {self.cause}"


def last_exception(tail: list[str]) -> tuple[str, str] | None:
    """``(exception class name, message)`` of the last exception line in ``tail``."""
    for line in reversed(tail):
        found = _EXCEPTION_LINE.match(line.strip())
        if found:
            return found.group(1).rsplit(".", 1)[-1], found.group(2)
    return None


def describe(outcome: GroupOutcome) -> Failure | None:
    """The :class:`Failure` of a group that failed, or None when it succeeded."""
    w = outcome.failed
    if w is None:
        return None
    code = int(w.returncode)
    status = exit_status(code)
    uptime = max(0.0, time.time() - w.started)
    tail = list(w.tail)
    raised = last_exception(tail)
    restartable = status != USAGE_EXIT_STATUS and not (
        raised and raised[0] in NOT_RESTARTABLE_ERRORS
    )
    sig = signal.Signals(-code).name if code < 0 else None
    if w.blames is not None:
        peer, what = w.blames
        alive = " (it was still running)" if peer in outcome.still_running else ""
        cause = f"{what}{alive}"
        pid = outcome.pids[peer] if 0 <= peer < len(outcome.pids) else w.process.pid
        return Failure(peer, w.rank, pid, status, sig, cause, restartable, uptime)
    if code == PREEMPTED_EXIT_STATUS:
        cause = f"preempted: saved a checkpoint and exited {PREEMPTED_EXIT_STATUS}"
    elif code < 0:
        note = _SIGNAL_NOTES.get(signal.Signals(-code))
        cause = f"killed by {sig}" + (f" ({note})" if note else "")
    else:
        last = f"{raised[0]}: {raised[1]}" if raised else (tail[-1] if tail else "no output")
        cause = f"exited with status {status}: {last[:400]}"
    return Failure(w.rank, w.rank, w.process.pid, status, sig, cause, restartable, uptime)


class EventLog:
    """Restart events as JSON lines in ``path`` and, when given, ``mirror`` (appended;
    nothing is written before the first restart: the events before it are held until
    then).

    Each line is one object with ``event`` (``"start"``, ``"restart"``, ``"resize"``,
    ``"resume"``, ``"exit"``) and ``time`` (seconds since the epoch); see :meth:`start`,
    :meth:`restart`, :meth:`resize`, :meth:`resume`, :meth:`exit`. ``mirror`` is the
    file the Memory Hierarchy tab reads in the run's log directory
    (``tb_plugin.metadata.RESTARTS_FILE``).
    """

    def __init__(self, path: str | None, mirror: str | None = None) -> None:
        self.path = path
        self.mirror = mirror
        self._held: list[dict[str, Any]] = []
        self._open = False

    def _emit(self, record: dict[str, Any], flush: bool = False) -> None:
        record = {"event": record.pop("event"), "time": round(time.time(), 3), **record}
        self._held.append(record)
        if self.path is None or not (flush or self._open):
            return
        self._open = True
        lines = "".join(json.dumps(held, sort_keys=False) + "\n" for held in self._held)
        for path in (self.path, self.mirror):
            if path is None:
                continue
            with open(path, "a", encoding="utf-8") as f:
                f.write(lines)
                f.flush()
                os.fsync(f.fileno())
        self._held = []

    def start(self, attempt: int, nproc: int, ports: tuple[int, ...]) -> None:
        """A worker group starts: ``attempt`` (0 first, then one more for each restart or
        resize), its size and ports."""
        self._emit({"event": "start", "attempt": attempt, "nproc": nproc, "ports": list(ports)})

    def resize(self, attempt: int, from_nproc: int, to_nproc: int, reason: str) -> None:
        """The next group (``attempt``) runs ``to_nproc`` workers instead of
        ``from_nproc``, for ``reason`` (one line)."""
        record = {"event": "resize", "attempt": attempt, "from_nproc": from_nproc}
        record.update(to_nproc=to_nproc, reason=reason)
        self._emit(record, flush=True)

    def resume(self, record: dict[str, Any]) -> None:
        """A group resumed and completed its first step (or ended before one): the
        fields of :meth:`zero_runtime.launch.goodput.Ledger.resume_record`."""
        self._emit({"event": "resume", **record})

    def restart(
        self, attempt: int, max_restarts: int, failure: Failure, last_step: int | None = None
    ) -> None:
        """The group failed and restart ``attempt`` (1-based) of ``max_restarts`` follows:
        ``rank``, ``reported_by``, ``pid``, ``exit_status``, ``signal``, ``cause``,
        ``uptime_seconds`` of the failure, and ``last_step``: the last step the group
        reported done (None when it reported none)."""
        record = {"event": "restart", "restart": attempt, "max_restarts": max_restarts}
        record.update(dataclasses.asdict(failure))
        record.pop("restartable")
        record["uptime_seconds"] = round(failure.uptime_seconds, 3)
        record["last_step"] = last_step
        self._emit(record, flush=True)

    def exit(
        self, status: int, restarts: int, reason: str, goodput: dict[str, Any] | None = None
    ) -> None:
        """The job ends with ``status`` after ``restarts`` restarts, for ``reason``, with
        its ``goodput`` (:meth:`zero_runtime.launch.goodput.Ledger.goodput`)."""
        record = {"event": "exit", "status": status, "restarts": restarts, "reason": reason}
        if goodput is not None:
            record["goodput"] = goodput
        self._emit(record)
