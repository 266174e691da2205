"""Local multi-worker launcher: N worker processes on 127.0.0.1 with the right ``TF_CONFIG``.

``zero-runtime launch --nproc 2 script.py [args]`` starts ``script.py`` N times, each with
a ``TF_CONFIG`` that names the same N-worker cluster on loopback ports and its own task
index (TensorFlow's MultiWorkerMirroredStrategy reads it), streams every worker's output
prefixed by its rank, and, when one worker fails, stops all the others and exits with the
failed worker's status. This is the single-machine counterpart of a cluster scheduler;
the cluster format is TensorFlow's (``tf.distribute.cluster_resolver.TFConfigClusterResolver``).

No worker outlives the launcher: SIGTERM or SIGINT to the launcher stops every worker
(:func:`launch`), and a launcher killed outright (SIGKILL) takes its workers with it: each
worker is started with ``PR_SET_PDEATHSIG`` = SIGKILL (Linux ``prctl``), so the kernel kills
it when the launcher's thread that started it dies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import enum
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

#: Seconds a worker gets to exit after SIGTERM + SIGINT before it is killed. Short on
#: purpose: once a MultiWorkerMirroredStrategy exists, TensorFlow's coordination service
#: catches SIGTERM (its preemption notifier), so a worker only stops on SIGINT (between
#: ops) or SIGKILL; checkpoints are atomic (docs/checkpoint.md), so nothing is lost.
TERMINATE_GRACE_SECONDS = 3.0


#: A worker's own report that a peer failed (``multiworker.describe_failure``, printed by
#: the failure hook as ``zero_runtime: worker rank R (host:port) <what it did>; ...``).
_PEER_REPORT = re.compile(r"zero_runtime: (worker rank (\d+) \([^)]*\) [^;]*);")


#: Signals the launcher forwards to its workers (it stops them all, then exits 128 + signal).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


class LauncherSignalError(Exception):
    """The launcher received one of :data:`FORWARDED_SIGNALS` (raised in its main thread)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


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
    """

    rank: int
    process: subprocess.Popen
    state: WorkerState = WorkerState.RUNNING
    returncode: int | None = None
    blames: tuple[int, str] | None = None  # (peer rank, what it did), from its own output
    pump: threading.Thread | None = None  # copies its output, prefixed by rank


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


def launch(
    nproc: int,
    command: Sequence[str],
    port_base: int | None = None,
    out: IO[str] | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run ``command`` as ``nproc`` workers of one cluster; return the job's exit status.

    Args:
        nproc: number of worker processes (int >= 1).
        command: the program and its arguments, e.g. ``[sys.executable, "train.py"]``.
        port_base: worker ``r`` listens on ``port_base + r``; None picks free ports.
        out: where the rank-prefixed output goes (default ``sys.stdout``).
        env: base environment for the workers (default ``os.environ``); each worker also
            gets ``TF_CONFIG``, ``ZERO_RUNTIME_RANK`` and ``ZERO_RUNTIME_WORLD_SIZE``.

    Returns:
        0 when every worker exited 0; otherwise the status of the first worker that
        failed (the others are stopped: SIGTERM and SIGINT, then SIGKILL after
        ``TERMINATE_GRACE_SECONDS``). A worker killed by signal S gives ``128 + S``.
        When the launcher itself receives one of :data:`FORWARDED_SIGNALS` (S; only
        handled when ``launch`` runs in the main thread), every running worker is stopped
        the same way and the status is ``128 + S``. Workers die with the thread that
        started them (``PR_SET_PDEATHSIG`` = SIGKILL), e.g. when the launcher is SIGKILLed.

    Raises:
        ValueError: ``nproc`` < 1, an empty command, or a port range outside 1..65535.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if not command:
        raise ValueError("no command to launch")
    if port_base is None:
        ports = free_ports(nproc)
    else:
        if not 1 <= port_base <= 65535 - (nproc - 1):
            raise ValueError(f"--port-base {port_base} leaves no room for {nproc} ports")
        ports = [port_base + r for r in range(nproc)]
    out = out or sys.stdout
    base_env = dict(os.environ if env is None else env)
    lock = threading.Lock()
    workers: list[Worker] = []
    restore = _forward_signals()
    try:
        for rank in range(nproc):
            worker_env = dict(
                base_env,
                TF_CONFIG=tf_config(ports, rank),
                ZERO_RUNTIME_RANK=str(rank),
                ZERO_RUNTIME_WORLD_SIZE=str(nproc),
                PYTHONUNBUFFERED="1",
            )
            workers.append(Worker(rank, _spawn(command, worker_env)))
            pump = threading.Thread(
                target=_pump, args=(workers[-1].process.stdout, workers[-1], out, lock), daemon=True
            )
            workers[-1].pump = pump
            pump.start()
        status = _supervise(workers, out, lock)
    except (LauncherSignalError, KeyboardInterrupt) as stop:
        signum = getattr(stop, "signum", signal.SIGINT)
        with lock:
            out.write(
                f"[launcher] received {signal.Signals(signum).name}; stopping "
                f"{sum(w.state is WorkerState.RUNNING for w in workers)} running worker(s)\n"
            )
            out.flush()
        _stop_all(workers)
        status = 128 + signum
    finally:
        restore()
    for w in workers:
        if w.pump is not None:
            w.pump.join(timeout=5)
    return status


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


def _forward_signals() -> Callable[[], None]:
    """In the main thread, make :data:`FORWARDED_SIGNALS` raise :class:`LauncherSignalError`
    (once: a second signal during the stop is ignored, the stop is bounded anyway).
    Returns the function that restores the previous handlers (a no-op elsewhere: Python
    only delivers signals to the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    raised = []

    def handler(signum, frame) -> None:
        if not raised:
            raised.append(signum)
            raise LauncherSignalError(signum)

    previous = {sig: signal.signal(sig, handler) for sig in FORWARDED_SIGNALS}

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
        with lock:
            out.write(f"[rank {rank}] {line}" if line.endswith("\n") else f"[rank {rank}] {line}\n")
            out.flush()


def _supervise(workers: list[Worker], out: IO[str], lock: threading.Lock) -> int:
    """Wait for the workers; on the first failure stop the rest. Returns the job status."""
    while any(w.state is WorkerState.RUNNING for w in workers):
        for w in workers:
            if w.state is not WorkerState.RUNNING:
                continue
            code = w.process.poll()
            if code is None:
                continue
            w.state, w.returncode = WorkerState.EXITED, code
            if code != 0:
                if w.pump is not None:
                    w.pump.join(timeout=2.0)  # its last lines may name a failed peer
                cause = ""
                if w.blames is not None:
                    peer, what = w.blames
                    alive = any(p.rank == peer and p.state is WorkerState.RUNNING for p in workers)
                    cause = f" because {what}" + (" (it is still running)" if alive else "")
                with lock:
                    out.write(
                        f"[launcher] rank {w.rank} exited with status {_status(code)}"
                        f"{cause}; stopping the other workers\n"
                    )
                    out.flush()
                _stop_all(workers)
                return _status(code)
        time.sleep(0.05)
    return 0


def _stop_all(workers: list[Worker]) -> None:
    running = [w for w in workers if w.state is WorkerState.RUNNING]
    for w in running:
        _signal_group(w.process, signal.SIGTERM)
        _signal_group(w.process, signal.SIGINT)  # SIGTERM alone is caught by TF (see above)
    deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
    for w in running:
        try:
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(w.process, signal.SIGKILL)
            w.process.wait()
        w.state, w.returncode = WorkerState.STOPPED, w.process.returncode


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode
