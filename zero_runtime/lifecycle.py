"""What a strategy owns, and releasing it: lifecycle states, close order, host callbacks.

A :class:`~zero_runtime.strategy.ZeroInfinityStrategy` creates threads, files and memory
that outlive any one call: stage-3 engines and their paged pools (host mmap, NVMe slab
file and its descriptors, I/O and prefetch threads), optimizer-state stores (an NVMe pool
and its write-behind thread), the update threads of stage 3's update in backward, and
the runtime's telemetry (an emitter thread, a summary writer). Each registers with the
strategy's :class:`Resources` when it is created; ``strategy.close()`` closes them all,
phase by phase (:class:`ClosePhase`), each phase in reverse order of creation:

1. ``UPDATES``: update threads wait for their queued block updates and stop (they write
   parameter shards and optimizer states, so they stop before either is closed).
2. ``MODELS``: stage-3 engines close their pools (prefetcher stopped, outstanding I/O
   finished, I/O threads joined, pages freed, NVMe slab file removed).
3. ``OPTIMIZER_STATES``: optimizer-state stores (write-behind thread, NVMe pool).
4. ``TELEMETRY``: the runtime flushes and closes its summaries last, so that every
   record of the steps above is written.

Host callbacks. ``tf.numpy_function`` keeps the Python function it is given alive as long
as the *outermost* graph, which for a ``tf.function`` traced in eager mode is the
process's global default graph (``tensorflow/python/ops/script_ops.py``): every host
callback of every traced step, and whatever it references (optimizer, engine, pools,
strategy), would live until the process ends. :func:`host_function` gives TensorFlow a
small :class:`_HostCall` instead, which finds the callback in its owner's table; the
table is cleared by ``close()``, after which a traced step that still runs raises
:class:`StrategyClosedError`.

Gradient registrations. ``tf.custom_gradient`` in graph mode (stage 3's per-use
backward, TensorFlow's own ``ReplicaContext.all_gather``) registers its gradient function
under a fresh name in TensorFlow's process-wide gradient registry, never removed
(``tensorflow/python/ops/custom_gradient.py``, ``_graph_mode_decorator``); the function
holds the traced graph, the replica context and so the strategy. The strategy's ``run``
records the names registered while it traces a step (:meth:`Resources.tracing`); once
the step is traced its gradients exist, and ``close()`` removes those names.

States (one per :class:`Resources`): ``OPEN`` (resources may be added and used) ->
``CLOSING`` (inside ``close()``) -> ``CLOSED`` (everything released; adding or using
raises :class:`StrategyClosedError`; ``close()`` again is a no-op).
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import functools
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import tensorflow as tf

log = logging.getLogger(__name__)


class LifecycleState(enum.Enum):
    """Lifecycle of a :class:`Resources` (and of the strategy that owns it).

    - ``OPEN``: resources are added as they are created and may be used.
    - ``CLOSING``: ``close()`` is releasing them; nothing new may be added.
    - ``CLOSED``: terminal; everything was released (no thread, descriptor, file or
      host callback of the owner remains).
    """

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class ClosePhase(enum.IntEnum):
    """The order in which ``Resources.close`` releases what it owns (lowest first)."""

    UPDATES = 0
    MODELS = 1
    OPTIMIZER_STATES = 2
    TELEMETRY = 3


class StrategyClosedError(RuntimeError):
    """A strategy (or a model or store it owns) was used after ``close()``."""


class Closeable(Protocol):
    """What :meth:`Resources.adopt` needs: an idempotent ``close()``."""

    def close(self) -> None:
        """Release the object's threads, descriptors, files and memory; idempotent."""


class Resources:
    """The record of what one owner (a strategy) created, released by :meth:`close`.

    Args:
        owner: a short description of the owner for error messages, e.g.
            ``"ZeroInfinityStrategy(stage=3)"``.

    Attributes:
        state: the :class:`LifecycleState`.

    Adopted objects are held weakly: an object dropped by its user before ``close()`` is
    released by its own finalizers (the pool's removes its NVMe file). Host callbacks
    are held strongly until ``close()`` (a traced step may call them at any time).
    Thread-safe. Every open owner is closed at interpreter exit.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.state = LifecycleState.OPEN
        self._lock = threading.Lock()
        self._order = itertools.count()
        # (phase, creation order, name, weak reference to the object)
        self._adopted: list[tuple[ClosePhase, int, str, weakref.ref]] = []
        self._calls: dict[int, Callable[..., Any]] = {}  # _HostCall key -> callback
        self._gradients: set[str] = set()  # gradient registry names of traced steps
        self._keys = itertools.count()
        _OPEN.add(self)

    # -- adding ---------------------------------------------------------------------------
    def adopt(self, obj: Closeable, phase: ClosePhase, name: str | None = None) -> None:
        """Record ``obj`` (anything with an idempotent ``close()``) for release in
        ``phase``.

        Raises:
            StrategyClosedError: the owner is closing or closed.
        """
        with self._lock:
            self._check_open_locked(f"create {name or type(obj).__name__}")
            self._adopted.append(
                (phase, next(self._order), name or type(obj).__name__, weakref.ref(obj))
            )

    def check_open(self, action: str) -> None:
        """Raise :class:`StrategyClosedError` naming ``action`` unless the owner is OPEN."""
        with self._lock:
            self._check_open_locked(action)

    def _check_open_locked(self, action: str) -> None:
        if self.state is not LifecycleState.OPEN:
            raise StrategyClosedError(
                f"cannot {action}: {self.owner} is {self.state.value} (strategy.close() was "
                "called); create a new strategy, and build and compile the model in its scope"
            )

    # -- host callbacks -------------------------------------------------------------------
    def host_call(self, fn: Callable[..., Any], name: str) -> _HostCall:
        """A callable for ``tf.numpy_function`` that runs ``fn`` while the owner is open.

        Raises:
            StrategyClosedError: the owner is closing or closed.
        """
        with self._lock:
            self._check_open_locked(f"trace the host call {name!r}")
            key = next(self._keys)
            self._calls[key] = fn
        return _HostCall(weakref.ref(self), key, name)

    def _lookup(self, key: int, name: str) -> Callable[..., Any]:
        fn = self._calls.get(key)
        if fn is None or self.state is not LifecycleState.OPEN:
            raise StrategyClosedError(
                f"host call {name!r} of a traced step ran after {self.owner} was closed: "
                "train with a model built and compiled under a new strategy"
            )
        return fn

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Record the gradient functions registered inside (a step being traced), for
        :meth:`close` to unregister (see the module doc)."""
        registry = _gradient_names()
        before = set(registry)
        try:
            yield
        finally:
            added = set(registry) - before
            with self._lock:
                self._gradients |= added

    # -- releasing ------------------------------------------------------------------------
    def close(self) -> list[str]:
        """Release everything adopted, phase by phase (:class:`ClosePhase`), each phase
        in reverse order of creation; then drop the host callbacks. Idempotent.

        Every object is closed even when another one's ``close()`` raised; the first
        error is raised at the end (after everything was tried).

        Returns:
            The names of the objects closed, in order (empty on a second call).
        """
        with self._lock:
            if self.state is not LifecycleState.OPEN:
                return []
            self.state = LifecycleState.CLOSING
            adopted, self._adopted = self._adopted, []
        closed, first_error = [], None
        for _, _, name, ref in sorted(adopted, key=lambda a: (a[0], -a[1])):
            obj = ref()
            if obj is None:
                continue
            try:
                obj.close()
                closed.append(name)
            except Exception as exc:  # noqa: BLE001 - release the rest, raise after
                log.warning("closing %s of %s failed: %s", name, self.owner, exc)
                first_error = first_error or exc
        with self._lock:
            self._calls.clear()
            gradients, self._gradients = self._gradients, set()
            self.state = LifecycleState.CLOSED
        registry = _gradient_names()
        for name in gradients:
            registry.pop(name, None)
        _OPEN.discard(self)
        if first_error is not None:
            raise first_error
        return closed


class _HostCall:
    """What TensorFlow keeps of a host callback: a weak way back to it (see module doc)."""

    __slots__ = ("_owner", "_key", "name")

    def __init__(self, owner: weakref.ref, key: int, name: str) -> None:
        self._owner = owner
        self._key = key
        self.name = name

    def __call__(self, *args: Any) -> Any:
        owner = self._owner()
        if owner is None:
            raise StrategyClosedError(
                f"host call {self.name!r} of a traced step ran after its strategy was "
                "garbage-collected"
            )
        return owner._lookup(self._key, self.name)(*args)  # noqa: SLF001


def _gradient_names() -> dict[str, Any]:
    """TensorFlow's gradient registry (name -> record): ``ops._gradient_registry``,
    a ``tensorflow/python/framework/registry.Registry``, which has no removal API."""
    from tensorflow.python.framework import ops

    return ops._gradient_registry._registry  # noqa: SLF001


def resources_of(strategy: Any = None) -> Resources | None:
    """The :class:`Resources` of ``strategy`` (default: the current
    ``tf.distribute`` strategy), or None for a strategy without one (TensorFlow's
    default strategy, a plain ``MirroredStrategy``)."""
    if strategy is None:
        strategy = tf.distribute.get_strategy()
    return getattr(strategy, "resources", None)


def host_function(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    tout: Any,
    *,
    stateful: bool,
    name: str | None = None,
    owner: Resources | None = None,
) -> Any:
    """``tf.numpy_function(fn, inputs, tout, stateful=..., name=...)`` whose ``fn`` is
    owned by ``owner`` (default: the current strategy's :class:`Resources`), so that
    the traced graph does not keep ``fn`` (and what it references) alive after the
    owner's ``close()``. Without an owner, plain ``tf.numpy_function``.

    A stateful call traced in a ``tf.function`` also takes the current replica's
    ordering resource (:func:`_order_handle`) as a last input, which ``fn`` does not see:
    it is ordered with its own replica's stateful host calls only, never with other
    replicas' ops.

    Returns:
        What ``tf.numpy_function`` returns (a tensor or a list of tensors).

    Raises:
        StrategyClosedError: the owner is closed (when tracing); at run time, the host
            call raises it (surfacing as a TensorFlow error) once the owner is closed.
    """
    owner = owner if owner is not None else resources_of()
    inputs = list(inputs)
    if stateful and tf.inside_function():
        inputs.append(_order_handle())
        fn = functools.partial(_without_order_handle, fn)
    if owner is not None:
        fn = owner.host_call(fn, name or "host_call")
    return tf.numpy_function(fn, inputs, tout, stateful=stateful, name=name)


#: Per replica (static id in sync, None outside a replica context): the resource variable
#: whose handle every traced stateful host call of that replica takes as an input.
_ORDER: dict[int | None, Any] = {}
_ORDER_LOCK = threading.Lock()


def _order_handle():
    """The current replica's host-call ordering resource (a resource tensor).

    ``tf.function``'s automatic control dependencies chain *every* stateful op without a
    resource input in creation order, over the whole traced function
    (``tensorflow/python/framework/auto_control_deps.py``, ``last_write_to_resource[None]``).
    MirroredStrategy traces its replicas one after another in one graph, so without a
    resource input a replica's host update at the end of its step (created late) comes
    before the next replica's first such op: Keras's shape ``Assert`` in its loss when the
    batch dimension is unknown (a partial last batch). That replica's backward then waits
    for the first replica's whole step, whose backward collectives wait for it: a
    deadlock until the collective timeout. With a resource input a host call is ordered
    only with the ops on that resource: its own replica's other stateful host calls, in
    creation order.
    """
    from tensorflow.python.ops import resource_variable_ops

    ctx = tf.distribute.get_replica_context()
    rid = None
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        static = tf.get_static_value(ctx.replica_id_in_sync_group)
        rid = None if static is None else int(static)
    with _ORDER_LOCK:
        var = _ORDER.get(rid)
        if var is None:
            with tf.init_scope():  # created eagerly, outside any strategy's creator
                var = resource_variable_ops.ResourceVariable(
                    0.0, trainable=False, name=f"zero_host_order_{rid}"
                )
            _ORDER[rid] = var
    return var.handle


def _without_order_handle(fn: Callable[..., Any], *args):
    """``fn`` on the host call's inputs without the trailing ordering handle."""
    return fn(*args[:-1])


_OPEN: weakref.WeakSet[Resources] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    """Close every owner still open when the interpreter exits (flushes telemetry,
    stops threads, removes NVMe files)."""
    for resources in list(_OPEN):
        try:
            resources.close()
        except Exception as exc:  # noqa: BLE001 - at exit: report, go on
            log.warning("closing %s at exit failed: %s", resources.owner, exc)
