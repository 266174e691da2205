"""Local multi-worker launcher that restarts its worker group after a failure.

``zero-runtime launch --nproc 2 [--max-restarts K --checkpoint-dir DIR] script.py [args]``
starts ``script.py`` N times on 127.0.0.1, each with a ``TF_CONFIG`` naming the same
cluster and its own rank (:mod:`.group`). When any worker fails (a non-zero exit, a
signal, an out-of-memory error, a hang the collective watchdog named, a preemption exit
42), every worker of the group is stopped and, up to K times, the whole group is started
again on fresh ports, with ``ZERO_RUNTIME_RESTART_COUNT`` set to the restart number (the
workers resume from the checkpoint directory: ``ZeroBackupAndRestore``,
``CheckpointManager.restore_or_initialize``). Each restart's cause (rank, exit status or
signal, the named failure) is printed and appended to ``DIR/restarts.jsonl``
(:mod:`.restarts`). A failure a restart cannot fix (bad arguments, a checkpoint of
another model) ends the job at once.

``DIR`` is locked for the job's whole life (:mod:`.dir_lock`): a second job on it is
refused before any worker starts. No worker outlives the launcher (:mod:`.group`), and no
port stays held: each worker's whole process group is stopped before the next start.
This is the single-machine counterpart of a cluster scheduler (TorchElastic's
``torchrun --max-restarts``).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import IO

from zero_runtime.launch.dir_lock import DirectoryLock, DirectoryLockedError
from zero_runtime.launch.group import (
    FORWARDED_SIGNALS,
    PREEMPTED_EXIT_STATUS,
    TERMINATE_GRACE_SECONDS,
    LauncherSignalError,
    exit_status,
    forward_signals,
    free_ports,
    run_group,
    tf_config,
)
from zero_runtime.launch.restarts import EVENTS_FILE, EventLog, Failure, describe

__all__ = [
    "DEFAULT_PREEMPTION_GRACE_SECONDS",
    "EVENTS_FILE",
    "FORWARDED_SIGNALS",
    "PREEMPTED_EXIT_STATUS",
    "TERMINATE_GRACE_SECONDS",
    "DirectoryLockedError",
    "Failure",
    "exit_status",
    "free_ports",
    "launch",
    "tf_config",
]

#: Seconds a preempted worker has to save and exit (``--preemption-grace``); exported to
#: the workers as ``ZERO_RUNTIME_PREEMPTION_GRACE_SECONDS`` (zero_runtime/preemption.py).
DEFAULT_PREEMPTION_GRACE_SECONDS = 30.0


def launch(
    nproc: int,
    command: Sequence[str],
    port_base: int | None = None,
    out: IO[str] | None = None,
    env: dict[str, str] | None = None,
    max_restarts: int = 0,
    checkpoint_dir: str | None = None,
    preemption_grace_seconds: float = DEFAULT_PREEMPTION_GRACE_SECONDS,
) -> int:
    """Run ``command`` as ``nproc`` workers of one cluster, restarting the group after a
    failure up to ``max_restarts`` times; return the job's exit status.

    Args:
        nproc: number of worker processes (int >= 1).
        command: the program and its arguments, e.g. ``[sys.executable, "train.py"]``.
        port_base: worker ``r`` listens on ``port_base + r``; None picks free ports (new
            ones for each restart).
        out: where the rank-prefixed output goes (default ``sys.stdout``).
        env: base environment for the workers (default ``os.environ``); each worker also
            gets ``TF_CONFIG``, ``ZERO_RUNTIME_RANK``, ``ZERO_RUNTIME_WORLD_SIZE``,
            ``ZERO_RUNTIME_RESTART_COUNT``, ``ZERO_RUNTIME_PREEMPTION_GRACE_SECONDS`` and,
            with ``checkpoint_dir``, ``ZERO_RUNTIME_CHECKPOINT_DIR``.
        max_restarts: restarts of the whole group allowed after failures (int >= 0;
            default 0: the first failure ends the job). More than 0 needs
            ``checkpoint_dir``.
        checkpoint_dir: the job's checkpoint directory (created if missing): locked for
            the job's life; restart events go to ``<checkpoint_dir>/restarts.jsonl``.
        preemption_grace_seconds: a preempted worker's time to save and exit, seconds
            (> 0); the launcher also gives the other workers this long to exit after one
            exits 42.

    Returns:
        0 when every worker of a group exited 0; otherwise the status of the first worker
        that failed in the last group (a signal S gives ``128 + S``). When the launcher
        itself receives one of :data:`FORWARDED_SIGNALS` (S; only handled when ``launch``
        runs in the main thread), every running worker is stopped and the status is
        ``128 + S``.

    Raises:
        ValueError: ``nproc`` < 1, an empty command, a port range outside 1..65535,
            ``max_restarts`` < 0, restarts without ``checkpoint_dir``, or a grace period
            that is not > 0. Nothing is started or written.
        DirectoryLockedError: another job holds ``checkpoint_dir`` (nothing is started).
        NotADirectoryError: ``checkpoint_dir`` is a file.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if not command:
        raise ValueError("no command to launch")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"--max-restarts must be an int >= 0, got {max_restarts!r}")
    if max_restarts > 0 and not checkpoint_dir:
        raise ValueError(
            "--max-restarts needs --checkpoint-dir DIR: a restarted group resumes from it, "
            "and the launcher locks it and writes the restart events there"
        )
    if not (math.isfinite(preemption_grace_seconds) and preemption_grace_seconds > 0):
        raise ValueError(f"--preemption-grace must be > 0 seconds, got {preemption_grace_seconds}")
    if port_base is not None and not 1 <= port_base <= 65535 - (nproc - 1):
        raise ValueError(f"--port-base {port_base} leaves no room for {nproc} ports")
    out = out or sys.stdout
    lock = threading.Lock()
    dir_lock = DirectoryLock(checkpoint_dir).acquire() if checkpoint_dir else None
    events = EventLog(os.path.join(dir_lock.path, EVENTS_FILE) if dir_lock else None)
    extra = {"ZERO_RUNTIME_PREEMPTION_GRACE_SECONDS": f"{preemption_grace_seconds:g}"}
    if dir_lock is not None:
        extra["ZERO_RUNTIME_CHECKPOINT_DIR"] = dir_lock.path
    base_env = dict(os.environ if env is None else env)
    restore = forward_signals()
    restarts, status = 0, 0
    try:
        while True:
            ports = free_ports(nproc) if port_base is None else range(port_base, port_base + nproc)
            events.start(restarts, nproc, tuple(ports))
            outcome = run_group(
                command,
                list(ports),
                base_env,
                out,
                lock,
                preemption_grace_seconds,
                dict(extra, ZERO_RUNTIME_RESTART_COUNT=str(restarts)),
            )
            status = outcome.status
            failure = describe(outcome)
            if failure is None:
                events.exit(0, restarts, "every worker exited 0")
                break
            if not failure.restartable or restarts >= max_restarts:
                why = (
                    "a restart would fail the same way"
                    if not failure.restartable
                    else (f"no restart left (--max-restarts {max_restarts})")
                )
                _say(out, lock, f"[launcher] {failure.line()}; not restarted: {why}")
                events.exit(status, restarts, f"{failure.line()}; {why}")
                break
            restarts += 1
            _say(
                out,
                lock,
                f"[launcher] restart {restarts}/{max_restarts} after {failure.line()} "
                f"(exit status {failure.exit_status}, {failure.uptime_seconds:.1f} s after "
                "the group started)",
            )
            events.restart(restarts, max_restarts, failure)
    except (LauncherSignalError, KeyboardInterrupt) as stop:
        signum = getattr(stop, "signum", signal.SIGINT)
        status = 128 + signum
        events.exit(status, restarts, f"the launcher received {signal.Signals(signum).name}")
    finally:
        restore()
        if dir_lock is not None:
            dir_lock.release()
    return status


def _say(out: IO[str], lock: threading.Lock, line: str) -> None:
    with lock:
        out.write(line + "\n")
        out.flush()
