"""One deadline thread per process for every collective the runtime issues.

TensorFlow's own collective timeout (``timeout_seconds`` of the V2 collective ops and of
``CommunicationOptions``) starts a sleeping OS thread per op and per parameter
resolution (``Env::SchedClosureAfter``, a detached ``std::thread`` on POSIX) that lives
for the whole timeout even when the op completes at once: at stage 2 on two CPU replicas
that was 4 threads per step, at stage 3 12, so a 60 s timeout kept ~1,000 threads alive
at ~5 steps/s and a fit under a 400-process limit aborted
(``std::system_error: Resource temporarily unavailable``). So the runtime's collectives
are issued with ``timeout_seconds=0`` and this module keeps the guarantee instead:

- :class:`CollectiveWatchdog`: one daemon thread (started on first use, then reused)
  holding the deadlines of the collectives in flight. A deadline that passes aborts the
  process's collectives (``context.abort_collective_ops``, what TensorFlow's own timeout
  and ``MultiWorkerMirroredStrategy``'s health check do): every pending and later
  collective fails with ``DeadlineExceededError`` carrying the watchdog's message.
- :func:`guard`: wraps one collective inside a traced step: a host callback arms the
  collective's deadline when it can start (after its input exists and, with an ordering
  token, after the device's previous collective) and another disarms it when its result
  exists.
- :meth:`CollectiveWatchdog.deadline`: the same around an eager collective.
- :func:`guard_strategy_collectives`: the same for a ``MultiWorkerMirroredStrategy``'s
  own collectives (its launchers are wrapped).

A traced collective whose step fails before its disarm leaves its deadline armed; such a
deadline is dropped as stale, never enforced (see :class:`CollectiveWatchdog`), so a
failed step does not abort the collectives of the steps after it.

Cost per guarded collective: two host callbacks on TensorFlow's inter-op pool (no thread
is created); the watchdog thread sleeps until the earliest deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context, execute
from tensorflow.python.framework import errors
from tensorflow.python.ops import resource_variable_ops


class WatchdogState(enum.Enum):
    """Lifecycle: IDLE (no thread yet) -> WATCHING (thread running) -> FIRED (a deadline
    passed and the process's collectives were aborted; still watching)."""

    IDLE = "idle"
    WATCHING = "watching"
    FIRED = "fired"


def _abort_collectives(message: str) -> None:
    context.context().abort_collective_ops(errors.DEADLINE_EXCEEDED, message)


@dataclasses.dataclass(frozen=True)
class _Deadline:
    due: float  # time.monotonic() seconds
    seconds: float
    what: str
    scope: object  # the ordering token's id: its collectives run one at a time, or None
    traced: bool  # armed from a traced step (its disarm never runs if the step fails)
    start: float = 0.0  # time.time() seconds when armed (the collective could start)
    lane: object = None  # the replica's device (interval listeners' lane), or None
    postpone: bool = False  # a step's deadline: restarted while no tf.function executes
    builds: int = 0  # traced_builds when a step's deadline was armed
    seq: int = 0  # arm order (CollectiveWatchdog.deadlines_started once armed)


class CollectiveWatchdog:
    """Deadlines of the collectives in flight, enforced by one reusable thread.

    A traced collective's disarm never runs when its step fails first (TensorFlow cancels
    the step's pending ops), so a traced deadline is dropped, not enforced, when it is
    stale: when a later collective on the same ordering token is armed (the token runs
    one at a time, so the earlier one has ended); when it falls due while no thread of
    the process is running a ``tf.function`` (no step, so no collective of a step, is
    pending); or when it falls due after a traced collective armed later than it has
    completed (the process's collectives make progress past it: a stalled collective
    blocks its peers, so nothing armed after it completes). Without the last rule a
    failed step's deadline would abort the collectives of whatever step ran when it fell
    due, and ``abort_collective_ops`` lasts until the process exits (in one pytest
    process, every later test's collectives fail).

    Args:
        abort: called with the message when a deadline passes (default: abort this
            process's collectives with ``DEADLINE_EXCEEDED``).
        executing: returns True while a ``tf.function`` call runs in the process (default:
            a thread is inside TensorFlow's ``execute.quick_execute``).

    Attributes:
        state: the :class:`WatchdogState`.
        fired: the message of the last abort, or None.
        deadlines_started: deadlines armed since creation (int; one per guarded
            collective run).
        stale_dropped: traced deadlines dropped as stale (int).
        traced_builds: guarded collectives built by tracing a step (int; :func:`guard`
            counts them, so a change means a step function was traced or retraced).
    """

    def __init__(
        self,
        abort: Callable[[str], None] = _abort_collectives,
        executing: Callable[[], bool] | None = None,
    ) -> None:
        self._abort = abort
        self._executing = executing or _executing_functions
        self._cond = threading.Condition()
        self._deadlines: dict[object, _Deadline] = {}
        self._thread: threading.Thread | None = None
        self.state = WatchdogState.IDLE
        self.fired: str | None = None
        self.deadlines_started = 0
        self.stale_dropped = 0
        self.traced_builds = 0
        self._done_seq = 0  # the largest seq of a traced deadline disarmed so far
        self._outside_steps = 0  # step_deadline blocks open (guard builds unguarded then)
        self._listeners: list[Callable[[], Callable[[object, float, float], None] | None]] = []

    def add_interval_listener(self, listener: Callable[[object, float, float], None]) -> None:
        """Call ``listener(lane, start, end)`` when a traced collective is disarmed:
        ``lane`` is the replica's device (its ordering token's), ``start`` / ``end``
        ``time.time()`` seconds from its arm (input ready) to its disarm (result exists).
        Free: the two timestamps come from the host callbacks the deadline runs anyway.
        The listener runs on TensorFlow's inter-op pool and must be quick. A bound method
        is held weakly (its object may be collected without being removed)."""
        ref = weakref.WeakMethod(listener) if inspect.ismethod(listener) else (lambda: listener)
        with self._cond:
            self._listeners.append(ref)

    def remove_interval_listener(self, listener: Callable[[object, float, float], None]) -> None:
        """Stop calling ``listener``; an unknown listener is ignored."""
        with self._cond:
            self._listeners = [r for r in self._listeners if r() not in (None, listener)]

    def arm(
        self,
        key: object,
        seconds: float,
        what: str,
        scope: object = None,
        traced: bool = False,
        lane: object = None,
        postpone: bool = False,
    ) -> None:
        """Start (or restart) the deadline of collective ``key``.

        Args:
            key: any hashable naming one collective call site (armed again: replaced).
            seconds: the time it may take, seconds (> 0).
            what: the collective, for the message (e.g. ``"all_to_all (group 7, ...)"``).
            scope: the id of the collective's ordering token, or None: arming ends every
                other deadline of the same scope (see the class docstring).
            traced: True when armed from a traced step (a host callback).
            lane: the replica's device, handed to interval listeners (None: ``scope``).
            postpone: restart the deadline, instead of enforcing it, when it falls due
                while no ``tf.function`` executes, or after a collective was traced since
                it was armed (the call traces its step); :meth:`step_deadline` sets it.

        Raises:
            ValueError: ``seconds`` is not > 0.
        """
        if not seconds > 0:
            raise ValueError(f"a collective deadline must be > 0 seconds, got {seconds}")
        with self._cond:
            if scope is not None:
                for other in [k for k, d in self._deadlines.items() if d.scope == scope]:
                    del self._deadlines[other]
            self._deadlines[key] = _Deadline(
                time.monotonic() + seconds,
                seconds,
                what,
                scope,
                traced,
                time.time(),
                scope if lane is None else lane,
                postpone,
                self.traced_builds,
                self.deadlines_started + 1,
            )
            self.deadlines_started += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="zero_runtime-collective-watchdog", daemon=True
                )
                self._thread.start()
                self.state = WatchdogState.WATCHING
            self._cond.notify()

    def disarm(self, key: object) -> None:
        """End the deadline of collective ``key`` (it completed); unknown keys are ignored."""
        with self._cond:
            done = self._deadlines.pop(key, None)
            if done is not None and done.traced:
                self._done_seq = max(self._done_seq, done.seq)
            refs = list(self._listeners) if done is not None and done.traced else ()
        if refs:
            end = time.time()
            for ref in refs:
                listener = ref()
                if listener is not None:
                    listener(done.lane, done.start, end)

    def clear(self) -> None:
        """Drop every deadline."""
        with self._cond:
            self._deadlines.clear()

    @property
    def armed(self) -> int:
        """Number of collectives with a running deadline."""
        with self._cond:
            return len(self._deadlines)

    @contextlib.contextmanager
    def deadline(self, seconds: float, what: str) -> Iterator[None]:
        """Arm a deadline for the eager collective(s) run inside the block.

        Args:
            seconds: the time the block may take, seconds (> 0).
            what: the collective, for the message.
        """
        key = ("eager", next(_KEYS))
        self.arm(key, seconds, what)
        try:
            yield
        finally:
            self.disarm(key)

    @contextlib.contextmanager
    def step_deadline(self, seconds: float, what: str) -> Iterator[None]:
        """One deadline over a whole step run from Python (a stage-3 device-tier step,
        :mod:`zero_runtime.stage3.step_clock`), instead of two host callbacks per
        collective inside its graph.

        While the block runs, :func:`guard` builds the collectives traced in it without
        their host callbacks (:attr:`covers_traces`). A call that traces its step (a
        collective is built after the deadline is armed: the first call, a retrace) is not
        held to it: tracing and the first run's graph optimisation may take longer than a
        collective may, and eager ops run while tracing, so "a tf.function executes" does
        not tell tracing apart. Any other call is: if it has not returned ``seconds``
        after it started, while a ``tf.function`` executes, the process's collectives are
        aborted as for a collective's deadline (restarted while none executes). No
        interval is reported to the interval listeners (the collectives of such a step
        are not timed one by one).

        Args:
            seconds: the time the step may execute, seconds; 0 or less: no deadline
                (the collectives are still built unguarded).
            what: the step, for the message.
        """
        key = ("step", next(_KEYS))
        with self._cond:
            self._outside_steps += 1
        try:
            if seconds > 0:
                self.arm(key, seconds, what, postpone=True)
            yield
        finally:
            self.disarm(key)
            with self._cond:
                self._outside_steps -= 1

    @property
    def covers_traces(self) -> bool:
        """True while a :meth:`step_deadline` block is open: collectives traced now are
        built without their deadline callbacks (the step's deadline covers them)."""
        return self._outside_steps > 0

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._deadlines:
                    self._cond.wait()
                    continue
                key, first = min(self._deadlines.items(), key=lambda kv: kv[1].due)
                wait = first.due - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                if first.postpone and (self.traced_builds != first.builds or not self._executing()):
                    # The call traces its step (or is between its functions): not a stall.
                    self._deadlines[key] = dataclasses.replace(
                        first, due=time.monotonic() + first.seconds
                    )
                    continue
                if first.traced and (self._done_seq > first.seq or not self._executing()):
                    del self._deadlines[key]  # its step failed before the disarm
                    self.stale_dropped += 1
                    continue
                self._deadlines.clear()
                message = (
                    f"zero_runtime: collective {first.what} did not complete within "
                    f"{first.seconds:g} s (collective_timeout_seconds): a peer stalled or "
                    "never joined; the process's collectives are aborted"
                )
                self.fired = message
                self.state = WatchdogState.FIRED
                self._cond.release()
                try:
                    self._abort(message)
                finally:
                    self._cond.acquire()


def _executing_functions() -> bool:
    """True while some thread of the process is inside a ``tf.function`` call (TensorFlow's
    ``execute.quick_execute``, through which every function call runs)."""
    code = execute.quick_execute.__code__
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code is code:
                return True
            frame = frame.f_back
    return False


_KEYS = itertools.count(1)

#: The process's watchdog (one thread for every strategy and group in the process).
WATCHDOG = CollectiveWatchdog()


def guard(
    collective: Callable[[tf.Tensor], tf.Tensor],
    flat: tf.Tensor,
    seconds: float,
    what: str,
    token,
) -> tf.Tensor:
    """Build ``collective(flat)`` in a traced step under a :data:`WATCHDOG` deadline.

    Two host callbacks (``tf.py_function``) take ``token``'s handle as an input: stateful
    ops on a resource, so ``tf.function`` always runs them and orders them with the other
    ops on that resource only (never with the step's other host callbacks, which could
    chain one replica's callback behind another replica's collective). The arm runs after
    ``flat`` exists and before the collective; the disarm after its result exists.

    Args:
        collective: builds the collective op on its input (issued with no TensorFlow
            timeout).
        flat: the collective's input tensor.
        seconds: the deadline, seconds; 0 or less: no deadline, ``collective(flat)`` as is.
        what: the collective, for the abort message.
        token: a resource variable on the replica's device: the collective's ordering token
            (the deadline then also starts after the device's previous collective), or
            :func:`device_token`.

    Returns:
        ``collective(flat)``'s result.
    """
    WATCHDOG.traced_builds += 1
    if not seconds > 0 or WATCHDOG.covers_traces:  # no deadline, or the step's own
        return collective(flat)
    span = _open_spans().get(id(token))
    if span is not None:
        return span.add(collective, flat, seconds, what)
    key, scope = ("traced", next(_KEYS)), id(token)
    lane = getattr(token, "device", None) or scope  # one lane per replica device

    def arm(_handle) -> list:
        WATCHDOG.arm(key, seconds, what, scope=scope, traced=True, lane=lane)
        return []

    def disarm(_handle) -> list:
        WATCHDOG.disarm(key)
        return []

    with tf.control_dependencies([flat]):
        armed = tf.py_function(arm, [token.handle], [], name="arm_deadline")
    with tf.control_dependencies([armed]):  # an Operation (no outputs)
        out = collective(tf.identity(flat))
    with tf.control_dependencies([out]):
        tf.py_function(disarm, [token.handle], [], name="disarm_deadline")
    return out


#: Per thread (MirroredStrategy traces each replica on its own thread): id(token) -> the
#: open :class:`_Span` of that ordering token.
_SPANS = threading.local()


def _open_spans() -> dict:
    return _SPANS.__dict__.setdefault("open", {})


class _Span:
    """One deadline over consecutive guarded collectives on one ordering token."""

    def __init__(self, token) -> None:
        self.token = token
        self.key = ("traced", next(_KEYS))
        self.names: list[str] = []
        self.last: tf.Tensor | None = None

    def add(self, collective: Callable, flat: tf.Tensor, seconds: float, what: str) -> tf.Tensor:
        self.names.append(what)
        if self.last is None:  # the first collective: arm before it (as guard does)
            key, scope, names = self.key, id(self.token), self.names

            def arm(_handle) -> list:
                WATCHDOG.arm(key, seconds, " then ".join(names), scope=scope, traced=True)
                return []

            with tf.control_dependencies([flat]):
                armed = tf.py_function(arm, [self.token.handle], [], name="arm_deadline")
            with tf.control_dependencies([armed]):
                flat = tf.identity(flat)
        self.last = collective(flat)
        return self.last

    def close(self) -> None:
        if self.last is None:
            return
        key = self.key

        def disarm(_handle) -> list:
            WATCHDOG.disarm(key)
            return []

        with tf.control_dependencies([self.last]):
            tf.py_function(disarm, [self.token.handle], [], name="disarm_deadline")


@contextlib.contextmanager
def one_deadline(token) -> Iterator[None]:
    """While a step is traced: the guarded collectives on ``token`` built inside the block
    share one deadline, armed before the first and disarmed after the last (two host
    callbacks in all instead of two per collective).

    The deadline (the first collective's ``seconds``) then also covers the ops between
    those collectives, which run on the same replica (e.g. stage 2's shard update between
    its reduce-scatter and its all-gather); its message names every collective. The
    collectives on one token run one at a time, in trace order (the token orders them),
    so a span is what the separate deadlines would cover, plus the ops between them.

    Args:
        token: the collectives' ordering-token variable (``CollectiveGroup.token_variable``).
    """
    spans = _open_spans()
    if id(token) in spans or tf.executing_eagerly():
        yield  # nested (the outer span covers it), or nothing is traced
        return
    span = spans[id(token)] = _Span(token)
    try:
        yield
    finally:
        del spans[id(token)]
        span.close()


def guard_strategy_collectives(
    strategy: tf.distribute.Strategy,
    seconds: Callable[[], float],
    startup_seconds: Callable[[], float] | None = None,
):
    """Put the collectives ``strategy`` issues itself under :data:`WATCHDOG` deadlines.

    For a ``MultiWorkerMirroredStrategy`` built without ``CommunicationOptions.timeout_seconds``
    (and a single-worker ``MirroredStrategy`` whose cross-device ops are collective, as on
    CPU: ``ZeroInfinityStrategy`` guards its own so that their host callbacks time them):
    every dense all-reduce and all-gather of its cross-device ops (its replicas' and its
    per-host ones; also Keras's loss/metric reductions and the distributed iterator's
    "every worker has data" check at the start of each step) goes through one
    ``CollectiveReplicaLauncher`` per device, whose ``all_reduce`` and ``_all_gather``
    are wrapped here: traced, under :func:`guard` (the launcher's ordering token orders the
    callbacks); eager, under :meth:`CollectiveWatchdog.deadline`. A multi-worker
    strategy's broadcast of each new variable's initial value is held to
    ``startup_seconds`` (:func:`_wrap_initial_values`).

    Args:
        strategy: a ``tf.distribute`` strategy with collective cross-device ops.
        seconds: returns the deadline, seconds, when a collective is built (e.g. the
            active config's ``collective_timeout_seconds``).
        startup_seconds: returns the deadline, seconds, of a new variable's initial-value
            broadcast on a multi-worker strategy (the start-up bound,
            ``cluster_guard.startup_timeout_seconds``); None (default): not guarded.

    Raises:
        RuntimeError: the strategy has no collective launchers (a TensorFlow version whose
            ``tf.distribute`` internals differ from 2.21's).
    """
    launchers = [
        launcher
        for ops in (
            getattr(strategy.extended, "_cross_device_ops", None),
            getattr(strategy.extended, "_host_cross_device_ops", None),  # multi-worker only
        )
        for launcher in getattr(ops, "_launchers", ())
    ]
    if not launchers:
        raise RuntimeError(
            f"cannot put the collectives of {type(strategy).__name__} under a deadline: no "
            "CollectiveReplicaLauncher found (tf.distribute internals differ from TF 2.21)"
        )
    for launcher in launchers:
        _wrap_launcher(launcher, seconds)
    if startup_seconds is not None and getattr(strategy.extended, "_num_workers", 1) > 1:
        _wrap_initial_values(strategy.extended, startup_seconds)


def _wrap_initial_values(extended: Any, seconds: Callable[[], float]) -> None:
    """Put the broadcast of each new variable's initial value from rank 0 (a multi-worker
    strategy's ``_get_variable_creator_initial_value``: eager ``broadcast_send`` /
    ``broadcast_recv``, built without a timeout) under a :meth:`CollectiveWatchdog.deadline`.

    Seen in CI on 2 loaded cores: both workers of a fresh 2-worker job blocked in that
    broadcast of their first variable (same group and instance key) for 20 minutes; with
    the deadline the job ends with the watchdog's error after ``seconds()``, the start-up
    bound (the workers reach their variables as they finish building: a start-up wait,
    not a step's).
    """
    if getattr(extended, "_zero_runtime_guarded_init", False):  # already wrapped: once only
        return
    extended._zero_runtime_guarded_init = True
    original = extended._get_variable_creator_initial_value

    def guarded(replica_id, device, primary_var, **kwargs):
        make = original(replica_id=replica_id, device=device, primary_var=primary_var, **kwargs)
        if replica_id != 0:  # copies the primary variable: no collective
            return make
        what = f"broadcast of variable {kwargs.get('name')!r}'s initial value from rank 0"

        def initial_value():
            limit = seconds()
            if not tf.executing_eagerly() or limit <= 0:
                return make()
            with WATCHDOG.deadline(limit, what):
                return make()

        return initial_value

    extended._get_variable_creator_initial_value = guarded


def _wrap_launcher(launcher: Any, seconds: Callable[[], float]) -> None:
    if getattr(launcher, "_zero_runtime_guarded", False):  # already wrapped: once only
        return
    launcher._zero_runtime_guarded = True
    token = getattr(launcher, "_ordering_token", None)
    if token is None:  # (``or`` would ask the variable's truth value)
        token = device_token(launcher._device)
    all_reduce, all_gather = launcher.all_reduce, launcher._all_gather

    def what(kind: str) -> str:
        return f"strategy {kind} (group {launcher._group_key}, device {launcher._device})"

    def guarded_all_reduce(input_tensor, control_input=None, options=None):
        def op(x):
            return all_reduce(x, control_input, options)

        return _guarded(op, input_tensor, seconds(), what("all_reduce"), token)

    def guarded_all_gather(input_tensor, options=None):
        return _guarded(
            lambda x: all_gather(x, options), input_tensor, seconds(), what("all_gather"), token
        )

    launcher.all_reduce = guarded_all_reduce
    launcher._all_gather = guarded_all_gather


def _guarded(op: Callable, flat, seconds: float, what: str, token) -> tf.Tensor:
    if tf.executing_eagerly() and seconds > 0:
        with WATCHDOG.deadline(seconds, what):
            return op(flat)
    return guard(op, tf.convert_to_tensor(flat), seconds, what, token)


_DEVICE_TOKENS: dict[str, Any] = {}
_DEVICE_TOKENS_LOCK = threading.Lock()


def device_token(device: str):
    """A scalar resource variable on ``device`` that orders a collective's deadline
    callbacks (for collectives without an ordering token: the strategy's own). One per
    device per process, created on first use."""
    with _DEVICE_TOKENS_LOCK:
        var = _DEVICE_TOKENS.get(device)
        if var is None:
            with tf.init_scope(), tf.device(device):
                # ResourceVariable, not tf.Variable: a plain variable, not a strategy's.
                var = resource_variable_ops.ResourceVariable(0.0, trainable=False)
            _DEVICE_TOKENS[device] = var
        return var
