"""Preemption: SIGTERM to any worker makes every worker save at one step they agree on,
then exit with :data:`PREEMPTED_EXIT_STATUS` (42), which ``zero-runtime launch`` restarts.

SIGTERM is how cloud hosts and Kubernetes say "this process is going away". The protocol
is TensorFlow's ``PreemptionCheckpointHandler``
(tensorflow/python/distribute/failure_handling/failure_handling.py: its step key, its
acknowledgements and its exit code 42), on the coordination service's key-value store
that every ``MultiWorkerMirroredStrategy`` job has:

1. The signalled worker's handler (Python, main thread) only records the signal, puts
   SIGTERM and SIGINT back to their default action (a second signal ends the process at
   once) and arms the grace period (``setitimer``; SIGALRM at its default action ends
   the process when it runs out, even if the main thread is stuck in TensorFlow's C++
   code holding the GIL).
2. At its next step boundary (after ``steps_done`` steps) it posts the target step
   ``steps_done + 1`` under :data:`TARGET_KEY`. Synchronous training keeps the workers
   within one step of each other: a peer cannot finish step ``steps_done + 1`` before
   this worker starts it, so no peer has passed the target. The first post wins (the
   store refuses a second one); a worker whose post loses takes the winner's target.
3. Every worker's watcher thread blocks on :data:`TARGET_KEY` (the call releases the
   GIL: measured, the main thread ran at full speed beside it), records the target and
   acknowledges it under ``ACK_KEY/<rank>``. The poster waits for every acknowledgement
   before it starts the next step, so each peer knows the target before it can reach it.
4. At the target boundary every worker saves (the caller's checkpoint) and exits 42.

One process (no cluster): the target is the next boundary. The grace period is
``ZERO_RUNTIME_PREEMPTION_GRACE_SECONDS`` (set by ``zero-runtime launch
--preemption-grace``), default :data:`DEFAULT_GRACE_SECONDS`.

A SIGTERM that arrives before the watcher is installed (while TensorFlow starts) is taken
by TensorFlow's own preemption notifier, which only records it.
"""

from __future__ import annotations

import atexit
import math
import os
import signal
import sys
import threading
import time
from typing import Any, NoReturn

#: Exit status of a worker that saved after a preemption signal (TensorFlow's
#: ``PreemptionCheckpointHandler`` default, which cluster schedulers treat as restartable).
PREEMPTED_EXIT_STATUS = 42

#: Seconds between the signal and the forced exit, when nothing else is configured.
DEFAULT_GRACE_SECONDS = 30.0

#: Environment variable holding the grace period, seconds (``launch --preemption-grace``).
GRACE_ENV = "ZERO_RUNTIME_PREEMPTION_GRACE_SECONDS"

#: Coordination-service key of the agreed step (its value: the step count as text).
TARGET_KEY = "zero_runtime/preemption/target"
#: Prefix of the per-rank acknowledgement keys (``<ACK_KEY>/<rank>``).
ACK_KEY = "zero_runtime/preemption/ack"
#: Value posted under :data:`TARGET_KEY` at a normal exit, to release the watcher threads.
STOP_VALUE = "stop"

_LOCK = threading.Lock()
_WATCHERS: dict[tuple[int, int], PreemptionWatcher] = {}


def grace_seconds_from_env(environ: dict[str, str] | None = None) -> float:
    """The grace period, seconds: :data:`GRACE_ENV` or :data:`DEFAULT_GRACE_SECONDS`.

    Raises:
        ValueError: the variable is set but not a finite number > 0 (names it and the value).
    """
    raw = (os.environ if environ is None else environ).get(GRACE_ENV, "").strip()
    if not raw:
        return DEFAULT_GRACE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{GRACE_ENV}={raw!r} is invalid: expected a number of seconds > 0")
    return value


class PreemptionWatcher:
    """This process's view of a preemption: whether one was signalled, and the agreed step.

    Use :func:`watcher` (one per process); call :meth:`boundary` after every training step
    on every worker, with the same step count.

    Args:
        rank: this worker's rank (0 in one process).
        num_workers: worker processes in the job (1: no coordination).
        grace_seconds: seconds from the signal to the forced exit (float > 0).
        context: TensorFlow's eager context (default ``context.context()``; multi-worker).

    Attributes:
        signalled_at: ``time.monotonic()`` of this process's SIGTERM, or None.
        target: the agreed step count at which every worker saves, or None.
    """

    def __init__(
        self, rank: int, num_workers: int, grace_seconds: float, context: Any = None
    ) -> None:
        self.rank = rank
        self.num_workers = num_workers
        self.grace_seconds = float(grace_seconds)
        self.signalled_at: float | None = None
        self.target: int | None = None
        self._posted = False
        self._target_seen = threading.Event()
        self._context = context
        self._thread: threading.Thread | None = None
        self._installed = False
        self._previous: Any = None

    @property
    def requested(self) -> bool:
        """True once this process was signalled or a peer's target arrived."""
        return self.signalled_at is not None or self.target is not None

    def install(self) -> None:
        """Take SIGTERM (main thread only; elsewhere a ``RuntimeError``) and, with several
        workers, start the watcher thread (once). Idempotent while installed."""
        if self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "the preemption watcher must be installed from the main thread (Python "
                "delivers signals there): create the checkpoint manager or start fit there"
            )
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.num_workers > 1 and self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name=f"zero-preemption-{self.rank}", daemon=True
            )
            self._thread.start()
            atexit.register(self._release_watchers)
        self._installed = True

    def uninstall(self) -> None:
        """Give SIGTERM back (the handler before :meth:`install`; its default action when
        that one was not Python's, e.g. TensorFlow's notifier) unless a preemption is
        under way. The watcher thread stays (a later :meth:`install` reuses it)."""
        if not self._installed or self.signalled_at is not None:
            return
        if threading.current_thread() is threading.main_thread():
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGTERM, previous)
            self._installed = False

    def _ctx(self) -> Any:
        if self._context is None:
            from tensorflow.python.eager import context

            self._context = context.context()
        return self._context

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """Record the signal; a second SIGTERM/SIGINT ends the process at once; arm the
        grace period (SIGALRM at its default action)."""
        del frame
        self.signalled_at = time.monotonic()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, self.grace_seconds)
        text = (
            f"zero_runtime: rank {self.rank} received {signal.Signals(signum).name}: every "
            "worker saves a checkpoint at the next step boundary they agree on, then exits "
            f"{PREEMPTED_EXIT_STATUS} (grace period {self.grace_seconds:g} s; a second signal "
            "exits at once)\n"
        )
        os.write(sys.stderr.fileno(), text.encode())  # print() is not reentrant

    def _watch(self) -> None:
        """Watcher thread: wait for the target, record it, acknowledge it."""
        try:
            value = self._ctx().get_config_key_value(TARGET_KEY)
        except Exception:  # noqa: BLE001 - the cluster is gone: nothing to watch
            return
        if value == STOP_VALUE:  # a peer is exiting normally: training is over
            self._target_seen.set()
            return
        self.target = int(value)
        self._target_seen.set()
        try:
            self._ctx().set_config_key_value(f"{ACK_KEY}/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the poster's wait then names the missing rank
            return

    def _release_watchers(self) -> None:
        """At a normal exit: post :data:`STOP_VALUE` (if no target was posted) so every
        worker's watcher thread returns instead of blocking inside TensorFlow."""
        if self._thread is None or self._target_seen.is_set():
            return
        try:
            self._ctx().set_config_key_value(TARGET_KEY, STOP_VALUE)
        except Exception:  # noqa: BLE001 - already posted, or the cluster is gone
            pass

    def _remaining(self) -> float:
        """Seconds left of the grace period (the whole period before any signal)."""
        if self.signalled_at is None:
            return self.grace_seconds
        return max(0.1, self.signalled_at + self.grace_seconds - time.monotonic())

    def boundary(self, steps_done: int) -> bool:
        """Call after each training step (``steps_done`` steps are complete, the same
        count on every worker). Returns True when every worker must save now and exit
        (:meth:`exit`).

        Raises:
            TimeoutError: the agreed step or a peer's acknowledgement did not arrive
                within the grace period (a peer is gone; the message names the ranks).
            RuntimeError: this worker is already past the agreed step (the workers'
                step counts differ: each must pass the same count).
        """
        if self.signalled_at is not None and not self._posted and self.target is None:
            self._posted = True
            self._agree(steps_done)
        if self.target is None:
            return False
        if steps_done > self.target:
            raise RuntimeError(
                f"preemption: worker rank {self.rank} is at step {steps_done}, past the "
                f"agreed step {self.target}: the workers' step counts differ (pass the "
                "same count on every worker)"
            )
        return steps_done == self.target

    def _agree(self, steps_done: int) -> None:
        if self.num_workers == 1:
            self.target = steps_done
            return
        from tensorflow.python.framework import errors

        ctx = self._ctx()
        try:
            ctx.set_config_key_value(TARGET_KEY, str(steps_done + 1))
            mine = True
        except errors.AlreadyExistsError:
            mine = False  # a peer posted first: its target holds
        if not self._target_seen.wait(self._remaining()):
            raise TimeoutError(
                f"preemption: rank {self.rank} did not receive the agreed step within the "
                f"grace period ({self.grace_seconds:g} s)"
            )
        if self.target is None:  # released: the peers finished training, nothing to save
            return
        if not mine:
            return
        missing = []
        for r in range(self.num_workers):
            try:
                ctx.get_config_key_value(f"{ACK_KEY}/{r}", int(self._remaining() * 1000))
            except errors.OpError:
                missing.append(r)
        if missing:
            raise TimeoutError(
                f"preemption: worker ranks {missing} did not acknowledge the agreed step "
                f"{self.target} within the grace period ({self.grace_seconds:g} s)"
            )

    def exit(self, what: str) -> NoReturn:
        """Print ``what`` (e.g. where the checkpoint went) and exit with
        :data:`PREEMPTED_EXIT_STATUS` (``SystemExit``: ``finally`` blocks and ``atexit``
        handlers run). The grace period's alarm is cancelled first: the checkpoint is
        saved, and the exit (closing the runtime, the exit barrier) is bounded on its own."""
        signal.setitimer(signal.ITIMER_REAL, 0)
        print(
            f"zero_runtime: rank {self.rank} preempted: {what}; exiting {PREEMPTED_EXIT_STATUS}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(PREEMPTED_EXIT_STATUS)


def watcher(rank: int, num_workers: int, grace_seconds: float | None = None) -> PreemptionWatcher:
    """This process's :class:`PreemptionWatcher`, installed (created at the first call;
    installed again after :meth:`PreemptionWatcher.uninstall`; main thread).

    Args:
        rank: this worker's rank (0 in one process).
        num_workers: worker processes in the job.
        grace_seconds: the grace period, seconds; default :func:`grace_seconds_from_env`.

    Raises:
        ValueError: a bad :data:`GRACE_ENV`.
        RuntimeError: called first from a thread other than the main thread.
    """
    with _LOCK:
        found = _WATCHERS.get((rank, num_workers))
        if found is None:
            grace = grace_seconds_from_env() if grace_seconds is None else float(grace_seconds)
            found = PreemptionWatcher(rank, num_workers, grace)
            _WATCHERS[(rank, num_workers)] = found
        found.install()
        return found
