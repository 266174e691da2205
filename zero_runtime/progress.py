"""A worker's training progress, told to ``zero-runtime launch``: the step it resumed at,
then each step it completed, with the time.

The launcher gives every worker ``ZERO_RUNTIME_PROGRESS_FILE`` (a file in a directory of
its own, not the checkpoint directory). Rank 0 overwrites one of the file's two fixed-size
records in place at each report (``os.pwrite``, no fsync: one system call, a few
microseconds a step) and the launcher reads it about every 50 ms. From it the launcher
knows, for each worker group, where it resumed and how far it got before it failed: the
steps and seconds each failure lost, and the job's goodput (``zero_runtime/launch/
goodput.py``).

Reports come from the code that already runs at every step boundary: the preemption
watcher's :meth:`~zero_runtime.preemption.PreemptionWatcher.boundary` (``fit`` with
``ZeroBackupAndRestore``, a custom loop's ``CheckpointManager.after_step``) and the
resume point from ``ZeroBackupAndRestore.on_train_begin`` /
``CheckpointManager.restore_or_initialize``. Steps are those callers' step counts
(optimizer steps: the same count at any world size).

Two records, ASCII, :data:`RECORD_BYTES` long each, space-padded::

    r <steps> <unix time, s>\\n      at byte 0: steps already done when training (re)started
    s <steps> <unix time, s>\\n      at byte RECORD_BYTES: steps done, the latest

The resume record has a place of its own, so a reader polling slower than the steps
never misses it.
"""

from __future__ import annotations

import dataclasses
import os
import time

#: Environment variable naming the progress file (set by ``zero-runtime launch``).
PROGRESS_ENV = "ZERO_RUNTIME_PROGRESS_FILE"
#: Bytes of the record (padded with spaces, ends with a newline).
RECORD_BYTES = 48

_fd: int | None = None
_path: str | None = None


@dataclasses.dataclass(frozen=True)
class Report:
    """One progress record.

    Attributes:
        resumed: True for the resume point (``r``), False for a completed step (``s``).
        steps: steps done (int >= 0).
        time: when it was written, seconds since the epoch.
    """

    resumed: bool
    steps: int
    time: float


def report(steps: int, resumed: bool = False, rank: int = 0) -> None:
    """Write the progress record, when the launcher asked for one and ``rank`` is 0.

    Args:
        steps: steps done (int >= 0).
        resumed: True at the resume point (before the first step of a (re)started run).
        rank: this worker's rank; only rank 0 writes.

    Never raises: a file that cannot be written is given up (the launcher then reports
    the steps as unknown), training goes on.
    """
    global _fd, _path
    path = os.environ.get(PROGRESS_ENV)
    if not path or rank != 0:
        return
    try:
        if _fd is None or _path != path:
            _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            _path = path
        line = f"{'r' if resumed else 's'} {int(steps)} {time.time():.3f}"
        data = line.ljust(RECORD_BYTES - 1).encode("ascii") + b"\n"
        os.pwrite(_fd, data, 0 if resumed else RECORD_BYTES)
    except OSError:
        os.environ.pop(PROGRESS_ENV, None)  # give up quietly: progress is advisory


def read(path: str) -> tuple[Report | None, Report | None]:
    """``(resume record, latest step record)`` of ``path``; each None when not written
    yet, or torn or malformed (a read that raced a write: the next read sees it whole)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(2 * RECORD_BYTES)
    except OSError:
        return None, None
    return _parse(raw[:RECORD_BYTES], "r"), _parse(raw[RECORD_BYTES:], "s")


def _parse(raw: bytes, kind: str) -> Report | None:
    fields = raw.decode("ascii", errors="replace").split()
    if len(raw) != RECORD_BYTES or len(fields) != 3 or fields[0] != kind:
        return None
    try:
        return Report(kind == "r", int(fields[1]), float(fields[2]))
    except ValueError:
        return None
