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

With ``--min-nproc M`` a rank that keeps failing (:class:`ShrinkPolicy`) makes the job
continue on fewer workers (world sizes that divide N; the workers keep the global batch
by raising gradient accumulation, :mod:`zero_runtime.elastic`), and SIGUSR1 grows it
back to N. SIGTERM to the launcher preempts the workers (they save at an agreed step
and exit 42) and ends the job. Rank 0 reports its progress (:mod:`zero_runtime.progress`),
from which each restart's steps and seconds lost and the job's goodput are computed
(:mod:`.goodput`) and written as events, also into ``--logdir`` for the Memory Hierarchy
tab.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import IO

from zero_runtime.elastic import MAX_WORLD_SIZE_ENV, world_sizes
from zero_runtime.launch.dir_lock import DirectoryLock, DirectoryLockedError
from zero_runtime.launch.goodput import Ledger
from zero_runtime.launch.group import (
    FORWARDED_SIGNALS,
    GROW_SIGNAL,
    PREEMPTED_EXIT_STATUS,
    TERMINATE_GRACE_SECONDS,
    LauncherSignalError,
    Requests,
    exit_status,
    forward_signals,
    free_ports,
    run_group,
    tf_config,
)
from zero_runtime.launch.restarts import (
    EVENTS_FILE,
    LOGDIR_EVENTS_FILE,
    EventLog,
    Failure,
    describe,
)
from zero_runtime.progress import PROGRESS_ENV

__all__ = [
    "DEFAULT_PREEMPTION_GRACE_SECONDS",
    "DEFAULT_SHRINK_AFTER",
    "EVENTS_FILE",
    "FORWARDED_SIGNALS",
    "GROW_SIGNAL",
    "PREEMPTED_EXIT_STATUS",
    "TERMINATE_GRACE_SECONDS",
    "DirectoryLockedError",
    "Failure",
    "ShrinkPolicy",
    "exit_status",
    "free_ports",
    "launch",
    "tf_config",
]

#: Seconds a preempted worker has to save and exit (``--preemption-grace``); exported to
#: the workers as ``ZERO_RUNTIME_PREEMPTION_GRACE_SECONDS`` (zero_runtime/preemption.py).
DEFAULT_PREEMPTION_GRACE_SECONDS = 30.0

#: Failures in a row blamed on one rank before the job continues with fewer workers
#: (``--shrink-after``; :class:`ShrinkPolicy`).
DEFAULT_SHRINK_AFTER = 2


def launch(
    nproc: int,
    command: Sequence[str],
    port_base: int | None = None,
    out: IO[str] | None = None,
    env: dict[str, str] | None = None,
    max_restarts: int = 0,
    checkpoint_dir: str | None = None,
    preemption_grace_seconds: float = DEFAULT_PREEMPTION_GRACE_SECONDS,
    min_nproc: int | None = None,
    shrink_after: int = DEFAULT_SHRINK_AFTER,
    logdir: str | None = None,
) -> int:
    """Run ``command`` as ``nproc`` workers of one cluster, restarting the group after a
    failure up to ``max_restarts`` times, on fewer workers (down to ``min_nproc``) when a
    rank keeps failing; return the job's exit status.

    Args:
        nproc: number of worker processes (int >= 1), the job's full size.
        command: the program and its arguments, e.g. ``[sys.executable, "train.py"]``.
        port_base: worker ``r`` listens on ``port_base + r``; None picks free ports (new
            ones for each restart).
        out: where the rank-prefixed output goes (default ``sys.stdout``).
        env: base environment for the workers (default ``os.environ``); each worker also
            gets ``TF_CONFIG``, ``ZERO_RUNTIME_RANK``, ``ZERO_RUNTIME_WORLD_SIZE`` (the
            group's size), ``ZERO_RUNTIME_MAX_WORLD_SIZE`` (``nproc``),
            ``ZERO_RUNTIME_RESTART_COUNT`` (the group's number: 0, then one more for each
            restart or resize), ``ZERO_RUNTIME_PREEMPTION_GRACE_SECONDS``,
            ``ZERO_RUNTIME_PROGRESS_FILE`` (:mod:`zero_runtime.progress`) and, when
            given, ``ZERO_RUNTIME_CHECKPOINT_DIR`` and ``ZERO_RUNTIME_LOGDIR``.
        max_restarts: restarts of the whole group allowed after failures (int >= 0;
            default 0: the first failure ends the job). More than 0 needs
            ``checkpoint_dir``. A resize after a failure is a restart; growing back on
            request is not.
        checkpoint_dir: the job's checkpoint directory (created if missing): locked for
            the job's life; restart events go to ``<checkpoint_dir>/restarts.jsonl``.
        preemption_grace_seconds: a preempted worker's time to save and exit, seconds
            (> 0); the launcher also gives the other workers this long to exit after one
            exits 42.
        min_nproc: the fewest workers the job may continue with (default ``nproc``: never
            shrink). Below ``nproc`` it needs ``max_restarts`` >= 1; the job runs only at
            world sizes that divide ``nproc`` (:func:`zero_runtime.elastic.world_sizes`).
        shrink_after: a rank blamed for this many failures in a row (int >= 1, default
            :data:`DEFAULT_SHRINK_AFTER`) makes the next group the next smaller world
            size, when that is >= ``min_nproc`` (:class:`ShrinkPolicy`). SIGUSR1 to the
            launcher grows a shrunk job back to ``nproc``: the group is preempted (saves at
            an agreed step, exits 42) and restarted at full size.
        logdir: the job's TensorBoard log directory (the one the script gives the
            strategy): the restart events are also written to
            ``<logdir>/memory_hierarchy_restarts.jsonl`` for the Memory Hierarchy tab.

    Returns:
        0 when every worker of a group exited 0; otherwise the status of the first worker
        that failed in the last group (a signal S gives ``128 + S``). SIGTERM to the
        launcher (main thread only) preempts the running workers (each saves at an
        agreed step and exits 42) and ends the job without a restart: 42 when every
        worker saved, else ``128 + 15``; a second SIGTERM, or SIGINT or SIGHUP (S), stops
        every worker at once and returns ``128 + S``.

    Raises:
        ValueError: ``nproc`` < 1, an empty command, a port range outside 1..65535,
            ``max_restarts`` < 0, restarts without ``checkpoint_dir``, a grace period
            that is not > 0, ``min_nproc`` outside 1..``nproc``, below ``nproc`` without
            restarts or with no smaller divisor of ``nproc`` at or above it,
            ``shrink_after`` < 1. Nothing is started or written.
        DirectoryLockedError: another job holds ``checkpoint_dir`` (nothing is started).
        NotADirectoryError: ``checkpoint_dir`` or ``logdir`` is a file.
    """
    _check_arguments(
        nproc, command, max_restarts, checkpoint_dir, preemption_grace_seconds, port_base
    )
    policy = ShrinkPolicy(nproc, nproc if min_nproc is None else min_nproc, shrink_after)
    if policy.min_nproc < nproc and max_restarts < 1:
        raise ValueError(
            f"--min-nproc {policy.min_nproc} below --nproc {nproc} needs --max-restarts >= 1 "
            "(the job shrinks when it restarts)"
        )
    if logdir is not None and os.path.exists(logdir) and not os.path.isdir(logdir):
        raise NotADirectoryError(f"--logdir {logdir!r} is not a directory")
    out = out or sys.stdout
    lock = threading.Lock()
    dir_lock = DirectoryLock(checkpoint_dir).acquire() if checkpoint_dir else None
    scratch = tempfile.mkdtemp(prefix="zero-launch-")
    mirror = None
    if logdir is not None and dir_lock is not None:
        os.makedirs(logdir, exist_ok=True)
        mirror = os.path.join(os.path.abspath(logdir), LOGDIR_EVENTS_FILE)
    events = EventLog(os.path.join(dir_lock.path, EVENTS_FILE) if dir_lock else None, mirror)
    ledger = Ledger(os.path.join(scratch, "progress"))
    extra = {
        "ZERO_RUNTIME_PREEMPTION_GRACE_SECONDS": f"{preemption_grace_seconds:g}",
        MAX_WORLD_SIZE_ENV: str(nproc),
        PROGRESS_ENV: ledger.path,
    }
    if dir_lock is not None:
        extra["ZERO_RUNTIME_CHECKPOINT_DIR"] = dir_lock.path
    if logdir is not None:
        extra["ZERO_RUNTIME_LOGDIR"] = os.path.abspath(logdir)
    base_env = dict(os.environ if env is None else env)
    requests = Requests()
    restore = forward_signals(requests)
    restarts, status, attempt, world, cause, kind = 0, 0, 0, nproc, None, None

    def tick() -> None:
        record = ledger.poll()
        if record is not None:
            events.resume(record)

    try:
        while True:
            if requests.stop:  # SIGTERM between two groups: nothing runs, nothing to save
                status = 128 + signal.SIGTERM
                events.exit(status, restarts, "the launcher received SIGTERM", ledger.goodput())
                break
            if requests.grow and world < nproc:
                cause, kind = f"resize {world} -> {nproc} workers: asked (SIGUSR1)", "resize"
                _say(out, lock, f"[launcher] {cause}")
                events.resize(attempt, world, nproc, "asked (SIGUSR1)")
                world = nproc
                policy.reset()
            requests.grow, requests.can_grow = False, world < nproc
            ports = free_ports(world) if port_base is None else range(port_base, port_base + world)
            events.start(attempt, world, tuple(ports))
            ledger.start(attempt, world, cause, kind)
            outcome = run_group(
                command,
                list(ports),
                base_env,
                out,
                lock,
                preemption_grace_seconds,
                dict(extra, ZERO_RUNTIME_RESTART_COUNT=str(attempt)),
                requests,
                tick,
            )
            record = ledger.end(outcome.ended_at)
            if record is not None:
                events.resume(record)
            last_step = ledger.attempts[-1].last_step
            status = outcome.status
            failure = describe(outcome)
            attempt += 1
            if outcome.preempted == "stop":
                saved = all(code == PREEMPTED_EXIT_STATUS for code in outcome.returncodes)
                # Not saved: the launcher's own status, whatever the workers died of on
                # the way down (a peer's lost connection, an abort in a collective).
                status = PREEMPTED_EXIT_STATUS if saved else 128 + signal.SIGTERM
                why = (
                    f"every worker saved and exited {PREEMPTED_EXIT_STATUS}"
                    if saved
                    else f"not every worker saved (exit statuses {list(outcome.returncodes)})"
                )
                _say(out, lock, f"[launcher] received SIGTERM: {why}; not restarted")
                events.exit(
                    status, restarts, f"the launcher received SIGTERM: {why}", ledger.goodput()
                )
                break
            if failure is None:
                events.exit(0, restarts, "every worker exited 0", ledger.goodput())
                break
            if outcome.preempted == "grow":
                cause = kind = None
                continue  # the grow request is applied at the top of the loop
            if not failure.restartable or restarts >= max_restarts:
                why = (
                    "a restart would fail the same way"
                    if not failure.restartable
                    else (f"no restart left (--max-restarts {max_restarts})")
                )
                _say(out, lock, f"[launcher] {failure.line()}; not restarted: {why}")
                events.exit(status, restarts, f"{failure.line()}; {why}", ledger.goodput())
                break
            restarts += 1
            _say(
                out,
                lock,
                f"[launcher] restart {restarts}/{max_restarts} after {failure.line()} "
                f"(exit status {failure.exit_status}, {failure.uptime_seconds:.1f} s after "
                "the group started)",
            )
            events.restart(restarts, max_restarts, failure, last_step)
            cause = f"restart {restarts}/{max_restarts} after {failure.line()}"
            preempted = failure.exit_status == PREEMPTED_EXIT_STATUS
            kind = "preemption" if preempted else "restart"
            smaller = policy.after_failure(world, failure)
            if smaller is not None:
                reason = (
                    f"rank {failure.rank} failed {policy.shrink_after} time(s) in a row "
                    f"(--shrink-after {policy.shrink_after}, --min-nproc {policy.min_nproc})"
                )
                _say(out, lock, f"[launcher] resize {world} -> {smaller} workers: {reason}")
                events.resize(attempt, world, smaller, reason)
                cause += f"; resize {world} -> {smaller} workers: {reason}"
                world, kind = smaller, "resize"
    except (LauncherSignalError, KeyboardInterrupt) as stop:
        signum = getattr(stop, "signum", signal.SIGINT)
        status = 128 + signum
        events.exit(
            status,
            restarts,
            f"the launcher received {signal.Signals(signum).name}",
            ledger.goodput(),
        )
    finally:
        restore()
        shutil.rmtree(scratch, ignore_errors=True)
        if dir_lock is not None:
            dir_lock.release()
    return status


def _check_arguments(
    nproc: int,
    command: Sequence[str],
    max_restarts: int,
    checkpoint_dir: str | None,
    preemption_grace_seconds: float,
    port_base: int | None,
) -> None:
    """Raise ``ValueError`` for bad :func:`launch` arguments (its docstring)."""
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


class ShrinkPolicy:
    """When the job continues with fewer workers.

    The rule: a rank blamed (:attr:`Failure.rank`: the worker that failed, or the peer a
    survivor named) for ``shrink_after`` failures in a row, with no failure blamed on
    another rank between them, makes the next group the next smaller world size that
    divides ``nproc`` and is >= ``min_nproc`` (:func:`zero_runtime.elastic.world_sizes`;
    the global batch is kept by raising gradient accumulation, :mod:`zero_runtime.elastic`).
    A host that does not come back shows as its rank failing at every start (the
    survivors' start-up barrier names it), so it counts the same. A preemption (exit 42)
    neither counts nor breaks a run of failures; a resize starts the count again. At
    ``min_nproc`` the job keeps restarting at that size until ``--max-restarts`` runs out.

    Args:
        nproc: the full size.
        min_nproc: the fewest workers (1..``nproc``).
        shrink_after: failures in a row (int >= 1).

    Raises:
        ValueError: ``min_nproc`` outside 1..``nproc``; ``min_nproc`` < ``nproc`` but no
            divisor of ``nproc`` in ``[min_nproc, nproc)``; ``shrink_after`` < 1.
    """

    def __init__(self, nproc: int, min_nproc: int, shrink_after: int) -> None:
        if isinstance(min_nproc, bool) or not isinstance(min_nproc, int):
            raise ValueError(f"--min-nproc must be an int, got {min_nproc!r}")
        if not 1 <= min_nproc <= nproc:
            raise ValueError(
                f"--min-nproc {min_nproc} must be between 1 and --nproc {nproc}"
                + (" (it is above --nproc)" if min_nproc > nproc else "")
            )
        if isinstance(shrink_after, bool) or not isinstance(shrink_after, int) or shrink_after < 1:
            raise ValueError(f"--shrink-after must be an int >= 1, got {shrink_after!r}")
        self.sizes = world_sizes(nproc, min_nproc)
        if min_nproc < nproc and len(self.sizes) < 2:
            raise ValueError(
                f"--min-nproc {min_nproc}: no world size from {min_nproc} to {nproc - 1} "
                f"divides --nproc {nproc} (the global batch is kept by multiplying the "
                f"gradient accumulation by {nproc}/w, a whole number): lower --min-nproc "
                f"to {max(w for w in range(1, nproc) if nproc % w == 0)}"
            )
        self.nproc, self.min_nproc, self.shrink_after = nproc, min_nproc, shrink_after
        self._rank: int | None = None
        self._count = 0

    def reset(self) -> None:
        """Forget the run of failures (after a resize)."""
        self._rank, self._count = None, 0

    def after_failure(self, world: int, failure: Failure) -> int | None:
        """Count ``failure`` of a group of ``world`` workers; the smaller world size the
        next group runs at, or None to keep ``world``."""
        if failure.exit_status == PREEMPTED_EXIT_STATUS:
            return None
        if failure.rank == self._rank:
            self._count += 1
        else:
            self._rank, self._count = failure.rank, 1
        if self._count < self.shrink_after:
            return None
        smaller = [w for w in self.sizes if w < world]
        if not smaller:
            return None
        self.reset()
        return smaller[0]


def _say(out: IO[str], lock: threading.Lock, line: str) -> None:
    with lock:
        out.write(line + "\n")
        out.flush()
