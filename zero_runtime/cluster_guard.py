"""Bounded, interruptible cluster waits: start-up and the exit barrier of a multi-worker job.

Two waits of a ``MultiWorkerMirroredStrategy`` worker block inside TensorFlow's C++ code,
holding the GIL (no Python thread, signal handler or timer of ours runs meanwhile):

- **start-up**: the strategy's constructor connects to TensorFlow's coordination service
  and waits for every task of ``TF_CONFIG``. TensorFlow's default waits for ever: a peer
  that never starts left rank 0 waiting > 150 s with ``collective_timeout_seconds=10``,
  deaf to SIGINT (Python's handler only runs between bytecodes) and SIGTERM (TensorFlow's
  preemption notifier installs its own handler, which only records the signal).
  :func:`configure_coordination` configures the coordination service as the strategy
  would, plus a registration barrier with a timeout (``cluster_register_with_barrier``,
  ``cluster_register_timeout_in_ms``): the constructor then raises
  ``DeadlineExceededError`` after :func:`startup_timeout_seconds`, which
  :func:`startup_failure` turns into an error naming the ranks that are not listening.
- **exit**: a worker that leaves while the chief still works (saving, flushing summaries)
  stops heartbeating, and the chief's coordination service logs
  ``StartAbort UNAVAILABLE: ... The tasks have crashed`` about a job that succeeded.
  :func:`register_exit_barrier` makes a worker that exits normally wait (bounded) at a
  coordination-service barrier for the others, so they all leave together.

During both waits :func:`interruptible` sets SIGINT to the default action (the kernel ends
the process at once, status 130 / -2); SIGTERM stays TensorFlow's during the wait (its
handler is installed before the wait and cannot be replaced from Python while the wait
holds the GIL): it takes effect at the latest when the wait times out, and
``zero-runtime launch`` follows its SIGTERM with SIGKILL after 3 s.

The bound is :func:`startup_timeout_seconds`: ``max(30 s, 3 x collective_timeout_seconds)``
(30 s with the tests' 10 s, 180 s with the default 60 s): time for a peer to start Python
and import TensorFlow (5-15 s on 2 busy cores) with room to spare.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

#: Smallest start-up timeout, seconds (see :func:`startup_timeout_seconds`).
MIN_STARTUP_TIMEOUT_SECONDS = 30.0

#: Start-up timeout as a multiple of ``collective_timeout_seconds``.
STARTUP_TIMEOUT_FACTOR = 3.0

#: Id of the barrier every worker waits at when it exits normally.
EXIT_BARRIER_ID = "zero_runtime_exit"

_EXIT = {"registered": False, "skip": False}
_EXIT_LOCK = threading.Lock()


def startup_timeout_seconds(collective_timeout_seconds: float) -> float:
    """Seconds a worker waits for the whole cluster: at start-up, and at the exit barrier.

    Args:
        collective_timeout_seconds: ``ZeroConfig.collective_timeout_seconds`` (float > 0).

    Returns:
        ``max(MIN_STARTUP_TIMEOUT_SECONDS, STARTUP_TIMEOUT_FACTOR * collective_timeout_seconds)``.
    """
    return max(MIN_STARTUP_TIMEOUT_SECONDS, STARTUP_TIMEOUT_FACTOR * collective_timeout_seconds)


def unreachable_peers(addresses: tuple[str, ...], rank: int, timeout: float = 0.5) -> list[int]:
    """Ranks (other than ``rank``) where nothing accepts a TCP connection at ``host:port``.

    A worker that never started has no server listening on its address; one that is up
    but slow to join does.
    """
    missing = []
    for r, address in enumerate(addresses):
        if r == rank:
            continue
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                pass
        except OSError:
            missing.append(r)
    return missing


def configure_coordination(timeout_seconds: float, context: Any = None) -> bool:
    """Configure TensorFlow's coordination service as ``MultiWorkerMirroredStrategy`` does,
    with task registration as a barrier that fails after ``timeout_seconds``.

    Call before the strategy's constructor (which then keeps this configuration). Reads
    the cluster from ``TF_CONFIG`` (``TFConfigClusterResolver``).

    Returns:
        True when configured; False when the coordination service was already configured
        (left as it is).
    """
    import tensorflow as tf
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context as tf_context

    ctx = context or tf_context.context()
    if ctx.coordination_service is not None:
        return False
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = multi_worker_util.normalize_cluster_spec(resolver.cluster_spec())
    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=spec.num_tasks(job))
        for job in ("chief", "worker")
        if job in spec.jobs
    ]
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=jobs,
        cluster_register_timeout_in_ms=int(timeout_seconds * 1000),
    )
    ctx.coordination_service.cluster_register_with_barrier = True
    return True


def startup_failure(
    exc: BaseException, timeout_seconds: float, addresses: tuple[str, ...], rank: int
) -> str | None:
    """The message for a start-up that timed out (``exc`` from the strategy's constructor),
    naming the ranks not listening; None when ``exc`` is not the registration timeout."""
    import tensorflow as tf

    if not isinstance(exc, tf.errors.DeadlineExceededError):
        return None
    missing = unreachable_peers(addresses, rank)
    who = (
        "nothing listens at " + ", ".join(f"rank {r} ({addresses[r]})" for r in missing)
        if missing
        else "every peer's address answers, but not every peer registered"
    )
    return (
        f"the cluster did not start within {timeout_seconds:g} s: worker rank {rank} waited for "
        f"all {len(addresses)} workers of TF_CONFIG to register ({who}). Start every worker "
        "TF_CONFIG names, or raise collective_timeout_seconds (the start-up wait is "
        "max(30, 3 x collective_timeout_seconds) s)"
    )


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT takes the default action (ends the process at once) for the body: a wait in
    TensorFlow's C++ code holds the GIL, so Python's handler would never run. Restored
    after. Only in the main thread (elsewhere, no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def skip_exit_barrier() -> None:
    """Do not wait at the exit barrier (this process is failing: the peers will not come)."""
    _EXIT["skip"] = True


def register_exit_barrier(timeout_seconds: float, rank: int, context: Any = None) -> None:
    """At normal interpreter exit, wait at :data:`EXIT_BARRIER_ID` for every worker.

    Registered once per process (``atexit``); skipped after :func:`skip_exit_barrier`
    (an uncaught error). A barrier that fails (a peer already gone, or the timeout) is
    reported on stderr and the process exits anyway.

    Args:
        timeout_seconds: the barrier's timeout, seconds.
        rank: this worker's rank (for the message).
        context: TensorFlow's eager context (default ``context.context()``).
    """
    with _EXIT_LOCK:
        if _EXIT["registered"]:
            return
        _EXIT["registered"] = True

    def wait_for_peers() -> None:
        if _EXIT["skip"]:
            return
        from tensorflow.python.eager import context as tf_context

        ctx = context or tf_context.context()
        try:
            with interruptible():
                ctx.wait_at_barrier(EXIT_BARRIER_ID, int(timeout_seconds * 1000))
        except Exception as exc:  # noqa: BLE001 - exiting anyway; say why it was not clean
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(
                f"zero_runtime: exit barrier failed on rank {rank} ({type(exc).__name__}: "
                f"{first[:300]}); exiting without it",
                file=sys.stderr,
                flush=True,
            )

    atexit.register(wait_for_peers)
