"""One worker group: N worker processes on 127.0.0.1 with the right ``TF_CONFIG``, from
start to the end of the last one.

:func:`run_group` starts the command N times, each with a ``TF_CONFIG`` that names the
same N-worker cluster on loopback ports and its own task index (TensorFlow's
MultiWorkerMirroredStrategy reads it), streams every worker's output prefixed by its
rank, and, when one worker fails, stops all the others and returns what failed
(:class:`GroupOutcome`). The cluster format is TensorFlow's
(``tf.distribute.cluster_resolver.TFConfigClusterResolver``).

No worker outlives the group: each is started in its own session and stopped with its
whole process group (SIGTERM and SIGINT, then SIGKILL after
:data:`TERMINATE_GRACE_SECONDS`), and a launcher killed outright (SIGKILL) takes its
workers with it: each worker is started with ``PR_SET_PDEATHSIG`` = SIGKILL (Linux
``prctl``), so the kernel kills it when the launcher's thread that started it dies.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import dataclasses
import enum
import json
import math
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

#: Seconds a worker gets to exit after SIGTERM + SIGINT before it is killed. Short on
#: purpose: once a MultiWorkerMirroredStrategy exists, TensorFlow's coordination service
#: catches SIGTERM (its preemption notifier), so a worker only stops on SIGINT (between
#: ops) or SIGKILL; checkpoints are atomic (docs/checkpoint.md), so nothing is lost.
TERMINATE_GRACE_SECONDS = 3.0

#: A stopped worker that uses less CPU than this (seconds) over :data:`IDLE_WINDOW_SECONDS`
#: waits (a collective whose peer died) and is killed then, not after the whole grace.
IDLE_CPU_SECONDS = 0.02
IDLE_WINDOW_SECONDS = 0.5

#: Exit status of a worker that saved after a preemption signal and asks to be restarted
#: (TensorFlow's PreemptionCheckpointHandler; ``zero_runtime.preemption``).
PREEMPTED_EXIT_STATUS = 42

#: Lines of each worker's output kept to name its failure.
TAIL_LINES = 40

#: A worker's own report that a peer failed (``multiworker.describe_failure``, printed by
#: the failure hook as ``zero_runtime: worker rank R (host:port) <what it did>; ...``).
_PEER_REPORT = re.compile(r"zero_runtime: (worker rank (\d+) \([^)]*\) [^;]*);")

#: Signals the launcher forwards to its workers (it stops them all, then exits 128 + signal;
#: a first SIGTERM preempts them instead when the launcher restarts: :func:`forward_signals`).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: The signal that asks a shrunk job to grow back to its full size.
GROW_SIGNAL = signal.SIGUSR1

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


class LauncherSignalError(Exception):
    """The launcher received one of :data:`FORWARDED_SIGNALS` (raised in its main thread)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


class Requests:
    """What was asked of the launcher by signal while a group runs (set by the handlers of
    :func:`forward_signals`, read by :func:`run_group`'s supervision loop).

    Attributes:
        stop: SIGTERM arrived: preempt the workers (each saves at an agreed step and
            exits 42), then end the job without a restart.
        grow: SIGUSR1 arrived: run the job at its full size again (docs/multiworker/restarts.md).
        can_grow: whether the running group is below the full size (set by the launcher
            before each group); a ``grow`` request at full size is dropped.
    """

    def __init__(self) -> None:
        self.stop = False
        self.grow = False
        self.can_grow = False

    def preempting(self) -> str | None:
        """``"stop"`` or ``"grow"`` when the running group must be preempted, else None."""
        if self.stop:
            return "stop"
        if self.grow and self.can_grow:
            return "grow"
        return None


class WorkerState(enum.Enum):
    """Lifecycle of one launched worker: RUNNING -> EXITED (any status) or STOPPED (by us)."""

    RUNNING = "running"
    EXITED = "exited"
    STOPPED = "stopped"


@dataclasses.dataclass
class Worker:
    """One worker process.

    Attributes:
        rank: the task index in the cluster (0 is the chief).
        process: the ``subprocess.Popen`` object.
        state: its lifecycle state.
        returncode: exit status once it ended (negative: killed by that signal).
        blames: the peer this worker reported as failed (rank, description), if any: a
            stalled peer is still running when the worker that timed out exits, so the
            launcher names the stalled rank from this report.
        tail: its last :data:`TAIL_LINES` output lines (to name its own failure).
        started: ``time.time()`` when it was started, seconds since the epoch.
    """

    rank: int
    process: subprocess.Popen
    state: WorkerState = WorkerState.RUNNING
    returncode: int | None = None
    blames: tuple[int, str] | None = None  # (peer rank, what it did), from its own output
    pump: threading.Thread | None = None  # copies its output, prefixed by rank
    tail: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    started: float = dataclasses.field(default_factory=time.time)


@dataclasses.dataclass(frozen=True)
class GroupOutcome:
    """How a worker group ended.

    Attributes:
        status: the job's exit status: 0 when every worker exited 0, else the first
            failed worker's (a signal S gives ``128 + S``).
        failed: the first worker that failed (its rank, returncode, output tail, blamed
            peer), or None.
        still_running: ranks that were running when the failure was seen (then stopped).
        pids: every worker's pid, by rank.
        ports: the TCP ports of the cluster, by rank.
        ended_at: ``time.time()`` when the first failure was seen (or the last worker
            exited), seconds since the epoch.
        preempted: ``"stop"`` or ``"grow"`` when the launcher preempted the group itself
            (:class:`Requests`), else None.
        returncodes: every worker's exit status as ``Popen.returncode``, by rank.
    """

    status: int
    failed: Worker | None
    still_running: tuple[int, ...]
    pids: tuple[int, ...]
    ports: tuple[int, ...]
    ended_at: float = 0.0
    preempted: str | None = None
    returncodes: tuple[int | None, ...] = ()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now (bound, then released).

    Raises:
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"need at least one port, got n={n}")
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(ports: Sequence[int], rank: int, host: str = "127.0.0.1") -> str:
    """The ``TF_CONFIG`` JSON for worker ``rank`` of a cluster on ``host:ports``.

    Args:
        ports: one TCP port per worker, in rank order.
        rank: this worker's task index, ``0 <= rank < len(ports)``.
        host: the address every worker listens on (default loopback).

    Raises:
        ValueError: ``rank`` out of range.
    """
    if not 0 <= rank < len(ports):
        raise ValueError(f"rank {rank} out of range for {len(ports)} workers")
    cluster = {"worker": [f"{host}:{p}" for p in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}})


def run_group(
    command: Sequence[str],
    ports: Sequence[int],
    base_env: dict[str, str],
    out: IO[str],
    lock: threading.Lock,
    preempted_wait_seconds: float,
    extra_env: dict[str, str] | None = None,
    requests: Requests | None = None,
    tick: Callable[[], None] | None = None,
) -> GroupOutcome:
    """Run ``command`` as one worker per port until every worker ended; return how.

    Args:
        command: the program and its arguments.
        ports: worker ``r`` listens on ``127.0.0.1:ports[r]``.
        base_env: the workers' environment; each also gets ``TF_CONFIG``,
            ``ZERO_RUNTIME_RANK``, ``ZERO_RUNTIME_WORLD_SIZE`` and ``extra_env``.
        out: where the rank-prefixed output goes.
        lock: serialises writes to ``out``.
        preempted_wait_seconds: after a worker exits with :data:`PREEMPTED_EXIT_STATUS`,
            seconds the others get to finish their own save and exit before they are
            stopped.
        extra_env: more variables for every worker.
        requests: the launcher's signal requests (:class:`Requests`): when
            :meth:`Requests.preempting` says so, every running worker gets SIGTERM (a
            preemption: each saves at an agreed step and exits 42) and up to
            ``preempted_wait_seconds`` + :data:`TERMINATE_GRACE_SECONDS` to exit before
            it is stopped.
        tick: called about every 50 ms while the workers run (the launcher reads their
            progress there).

    Returns:
        The :class:`GroupOutcome`. On a failure (non-zero exit or signal) the others are
        stopped at once (SIGTERM and SIGINT to their process groups, SIGKILL after
        :data:`TERMINATE_GRACE_SECONDS`), except after a preempted exit (above).

    Raises:
        LauncherSignalError, KeyboardInterrupt: the launcher was signalled; every worker
            of the group is stopped first (and that is printed).
    """
    workers: list[Worker] = []
    nproc = len(ports)
    try:
        for rank in range(nproc):
            worker_env = dict(
                base_env,
                TF_CONFIG=tf_config(ports, rank),
                ZERO_RUNTIME_RANK=str(rank),
                ZERO_RUNTIME_WORLD_SIZE=str(nproc),
                PYTHONUNBUFFERED="1",
                **(extra_env or {}),
            )
            worker = Worker(rank, _spawn(command, worker_env))
            workers.append(worker)
            worker.pump = threading.Thread(
                target=_pump, args=(worker.process.stdout, worker, out, lock), daemon=True
            )
            worker.pump.start()
        failed, running, preempted = _supervise(
            workers, out, lock, preempted_wait_seconds, requests or Requests(), tick
        )
    except (LauncherSignalError, KeyboardInterrupt) as stop:
        signum = getattr(stop, "signum", signal.SIGINT)
        with lock:
            out.write(
                f"[launcher] received {signal.Signals(signum).name}; stopping "
                f"{sum(w.state is WorkerState.RUNNING for w in workers)} running worker(s)\n"
            )
            out.flush()
        _end(workers)
        raise
    except BaseException:
        _end(workers)
        raise
    ended_at = time.time()
    _end(workers)
    status = 0 if failed is None else exit_status(failed.returncode)
    if failed is None and preempted is not None:  # stopped before any worker exited
        status = 128 + signal.SIGTERM
    return GroupOutcome(
        status,
        failed,
        running,
        tuple(w.process.pid for w in workers),
        tuple(ports),
        ended_at=ended_at,
        preempted=preempted,
        returncodes=tuple(w.process.returncode for w in workers),
    )


def _end(workers: list[Worker]) -> None:
    """Stop the running workers, kill what the others left in their process groups (a
    child they started), and wait for the output pumps."""
    _stop_all(workers)
    for w in workers:
        kill_group_leftovers(w.process.pid)
    for w in workers:
        if w.pump is not None:
            w.pump.join(timeout=5)


def _spawn(command: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
    """Start one worker in its own session (we stop its whole process group), tied to this
    thread's life by ``PR_SET_PDEATHSIG`` = SIGKILL."""
    parent = os.getpid()

    def die_with_parent() -> None:  # runs in the child between fork and exec
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return subprocess.Popen(
        list(command),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,  # its own process group: we stop the whole group
        preexec_fn=die_with_parent,  # a prctl call only: safe after fork
    )


def forward_signals(requests: Requests | None = None) -> Callable[[], None]:
    """In the main thread, take the launcher's signals. Returns the function that
    restores the previous handlers (a no-op elsewhere: Python only delivers signals to
    the main thread).

    - SIGTERM, the first time and with ``requests``: sets ``requests.stop`` (the running
      group is preempted: its workers save at an agreed step and exit 42; then the job
      ends). Otherwise, and a second SIGTERM:
    - SIGTERM, SIGINT, SIGHUP (:data:`FORWARDED_SIGNALS`) raise
      :class:`LauncherSignalError` (once: a later signal during the stop is ignored, the
      stop is bounded anyway): every worker is stopped at once;
    - SIGUSR1 (:data:`GROW_SIGNAL`) with ``requests``: sets ``requests.grow``.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    raised = []

    def handler(signum, frame) -> None:
        if signum == signal.SIGTERM and requests is not None and not requests.stop:
            requests.stop = True
            return
        if not raised:
            raised.append(signum)
            raise LauncherSignalError(signum)

    def grow(signum, frame) -> None:
        requests.grow = True

    previous = {sig: signal.signal(sig, handler) for sig in FORWARDED_SIGNALS}
    if requests is not None:
        previous[GROW_SIGNAL] = signal.signal(GROW_SIGNAL, grow)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def _pump(stream: IO[str], worker: Worker, out: IO[str], lock: threading.Lock) -> None:
    rank = worker.rank
    for line in stream:
        report = _PEER_REPORT.search(line)
        if report and worker.blames is None:
            worker.blames = (int(report.group(2)), report.group(1))
        if line.strip():
            worker.tail.append(line.rstrip("\n"))
        with lock:
            out.write(f"[rank {rank}] {line}" if line.endswith("\n") else f"[rank {rank}] {line}\n")
            out.flush()


def _supervise(
    workers: list[Worker],
    out: IO[str],
    lock: threading.Lock,
    preempted_wait_seconds: float,
    requests: Requests,
    tick: Callable[[], None] | None,
) -> tuple[Worker | None, tuple[int, ...], str | None]:
    """Wait for the workers; on the first failure stop the rest (after a preempted exit,
    give them ``preempted_wait_seconds`` to exit on their own first). Preempt them when
    ``requests`` asks (SIGTERM to each; those still running after
    ``preempted_wait_seconds`` + :data:`TERMINATE_GRACE_SECONDS` are stopped). Returns
    the first failed worker (None: all exited 0, or were stopped), the ranks still
    running when it failed, and the launcher's own preemption (``"stop"``, ``"grow"``)
    or None."""
    preempted, deadline = None, math.inf
    while any(w.state is WorkerState.RUNNING for w in workers):
        if tick is not None:
            tick()
        if requests.grow and not requests.can_grow:
            requests.grow = False
            _say_locked(out, lock, "[launcher] SIGUSR1: the job already runs at its full size")
        asked = requests.preempting()
        if asked is not None and preempted is None:
            preempted = asked
            deadline = time.monotonic() + preempted_wait_seconds + TERMINATE_GRACE_SECONDS
            running = [w for w in workers if w.state is WorkerState.RUNNING]
            why = "SIGTERM" if asked == "stop" else "SIGUSR1 (grow)"
            _say_locked(
                out,
                lock,
                f"[launcher] {why}: preempting {len(running)} worker(s): each saves at a "
                f"step they agree on and exits {PREEMPTED_EXIT_STATUS} (grace "
                f"{preempted_wait_seconds:g} s)",
            )
            for w in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.process.pid, signal.SIGTERM)
        if time.monotonic() > deadline:
            _say_locked(out, lock, "[launcher] the grace period ran out; stopping the workers")
            _stop_all(workers)
            return None, (), preempted
        for w in workers:
            if w.state is not WorkerState.RUNNING:
                continue
            code = w.process.poll()
            if code is None:
                continue
            w.state, w.returncode = WorkerState.EXITED, code
            if code == 0:
                continue
            if w.pump is not None:
                w.pump.join(timeout=2.0)  # its last lines may name a failed peer
            running = tuple(p.rank for p in workers if p.state is WorkerState.RUNNING)
            cause = ""
            if w.blames is not None:
                peer, what = w.blames
                cause = f" because {what}" + (" (it is still running)" if peer in running else "")
            elif code == PREEMPTED_EXIT_STATUS:
                cause = " (preempted: saved a checkpoint)"
            with lock:
                out.write(
                    f"[launcher] rank {w.rank} exited with status {exit_status(code)}"
                    f"{cause}; stopping the other workers\n"
                )
                out.flush()
            if code == PREEMPTED_EXIT_STATUS:
                _wait_exit(workers, preempted_wait_seconds)
            _stop_all(workers)
            return w, running, preempted
        time.sleep(0.05)
    return None, (), preempted


def _say_locked(out: IO[str], lock: threading.Lock, line: str) -> None:
    with lock:
        out.write(line + "\n")
        out.flush()


def _wait_exit(workers: list[Worker], seconds: float) -> None:
    """Let the running workers exit on their own for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    for w in workers:
        if w.state is not WorkerState.RUNNING:
            continue
        try:
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            continue
        w.state, w.returncode = WorkerState.EXITED, w.process.returncode


def _stop_all(workers: list[Worker]) -> None:
    """Stop every running worker's process group: SIGTERM and SIGINT, then SIGKILL after
    :data:`TERMINATE_GRACE_SECONDS`, or as soon as the worker used less than
    :data:`IDLE_CPU_SECONDS` of CPU over :data:`IDLE_WINDOW_SECONDS` (it waits, e.g. in
    a collective whose peer died, where SIGINT cannot reach its Python code: waiting out
    the grace period would only delay the restart)."""
    running = [w for w in workers if w.state is WorkerState.RUNNING]
    for w in running:
        _signal_group(w.process, signal.SIGTERM)
        _signal_group(w.process, signal.SIGINT)  # SIGTERM alone is caught by TF (see above)
    deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
    seen = {w.rank: (time.monotonic(), _cpu_seconds(w.process.pid)) for w in running}
    while running:
        for w in list(running):
            if w.process.poll() is not None:
                running.remove(w)
                continue
            since, cpu = seen[w.rank]
            now, used = time.monotonic(), _cpu_seconds(w.process.pid)
            idle = now - since >= IDLE_WINDOW_SECONDS and used - cpu < IDLE_CPU_SECONDS
            if idle or now >= deadline:
                _signal_group(w.process, signal.SIGKILL)
                w.process.wait()
                running.remove(w)
            elif now - since >= IDLE_WINDOW_SECONDS:
                seen[w.rank] = (now, used)
        time.sleep(0.05)
    for w in workers:
        if w.state is WorkerState.RUNNING:
            w.state, w.returncode = WorkerState.STOPPED, w.process.returncode


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads; ``/proc/<pid>/stat``
    fields 14 and 15, in clock ticks); 0.0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kill_group_leftovers(pgid: int) -> list[int]:
    """SIGKILL the processes left in the process group ``pgid`` of a worker that has
    exited (children it started that are still running). Read from ``/proc``; the group
    is only signalled when no process is its leader any more (a pid reused by a new
    group leader is never touched). Returns the pids signalled."""
    members, leader = [], False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat (after pid, comm, state, ppid)
            leader = leader or int(entry) == pgid
            members.append(int(entry))
    if not members or leader:
        return []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    return members


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: ``128 + S`` for signal S."""
    return 128 - returncode if returncode < 0 else returncode
