"""Partitioned construction for ZeRO stage 3 (DeepSpeed's ``zero.Init``).

Vocabulary (see :mod:`zero_runtime.sharded_variable` for shard and gathered buffer):

- *deferred variable*: a Keras variable created inside :class:`PartitionedConstruction`;
  it has its shape, dtype and initializer but no value (``_value is None``): nothing is
  allocated on any device. Keras 3 does this itself for variables created inside a
  ``keras.StatelessScope`` (``Variable.__init__`` keeps the initializer and registers the
  variable as uninitialized); this context is such a scope.
- *host value*: what a layer's ``build`` assigned to a deferred variable (for example a
  re-seeded kernel). The assigned tensor is copied to host memory (numpy) at once, its
  device buffer is dropped, and it becomes the variable's initializer
  (:class:`HostValue`), so every later read sees the assigned value.
- *initial value*: the value the variable would have had in a replicated build:
  :func:`initial_value` runs the initializer (or returns the host value) for one variable
  at a time, on the host device.

Usage (user model code unchanged, only wrapped)::

    strategy = zero_runtime.ZeroInfinityStrategy({"stage": 3, "offload_param": "nvme"})
    with strategy.zero_init():
        model = build_model()                 # variables deferred, nothing replicated
    with strategy.scope():                    # (shard_model may also run in the context)
        sharded = strategy.shard_model(model) # each variable: initializer -> shards -> pool
        sharded.compile(optimizer="adam", loss=...)   # not inside zero_init (see __exit__)

``Stage3Engine`` turns each trainable weight into a ``ShardedVariable`` straight from its
initial value: one variable is whole at a time (on the host device), its shards are paged
into the pool on the ``offload_param`` tier and the full tensor is dropped. The
construction peak on the device tier is therefore about the largest single variable, not
the model (measured in tests/test_stage3_init.py).

Why an explicit context and not ``strategy.scope()``: inside a stateless scope Keras
records assignments instead of applying them and refuses variables created from a value
(not an initializer); ``scope()`` also hosts ``compile``, optimizer creation and weight
loading, which must stay stateful. Here assignments to variables that existed before the
context are applied as usual (the scope is suspended for them); only new variables defer.

At the context's exit, deferred variables that stage 3 does not shard (non-trainable or
not float32: seed-generator states, counters) are initialized as usual, inside the
strategy's scope (mirrored, as without the context). Trainable float32 variables stay
deferred for ``shard_model``; a model built here must be sharded before it is trained.
At stages 0-2 the context is just ``strategy.scope()``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import get_stateless_scope

from zero_runtime.lifecycle import host_function
from zero_runtime.sharded_variable import is_deferred  # defined below optim and stage3

#: Device on which deferred initializers run (host memory on a GPU machine; on a CPU-only
#: host it is the device stand-in itself, whose allocator then sees one variable at a time).
HOST_DEVICE = "/CPU:0"

_UNINITIALIZED = "uninitialized_variables"  # Keras's global list (keras.src...variables)
_SCOPE = "stateless_scope"  # Keras's global attribute for the active StatelessScope


class HostValue:
    """An initializer that returns a fixed host array (a value assigned during build).

    Args:
        array: the value, a numpy array of the variable's shape and dtype (kept, not
            copied).

    Calling it returns a ``tf.Tensor``: eagerly a constant of the array; inside a
    ``tf.function`` a ``tf.numpy_function`` reading the array, so tracing (Keras's
    symbolic build) embeds no graph constant of the variable's size.
    """

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __call__(self, shape, dtype=None) -> tf.Tensor:
        """The value as a tensor of ``shape`` (must match) and ``dtype`` (default its own)."""
        dtype = tf.as_dtype(dtype or self.array.dtype)
        if tuple(shape) != self.array.shape:
            raise ValueError(f"HostValue of shape {self.array.shape} read as {tuple(shape)}")
        if tf.inside_function():
            out = host_function(lambda: self.array, [], dtype, stateful=False)
            out.set_shape(self.array.shape)
            return out
        return tf.constant(self.array, dtype)


def initial_value(variable) -> np.ndarray:
    """The value of ``variable`` as a replicated build would have set it (host numpy).

    A deferred variable: its host value, or its initializer run on :data:`HOST_DEVICE`
    (the full tensor exists once, for this call; the result is a copy in host memory, so
    no device buffer outlives the call). Any other variable: ``variable.numpy()``.

    Returns:
        A numpy array of ``variable.shape`` and ``variable.dtype``.
    """
    if not is_deferred(variable):
        return np.array(variable.numpy(), copy=True)
    init = variable._initializer  # noqa: SLF001  (Keras keeps it until initialization)
    if isinstance(init, HostValue):
        return init.array
    with tf.init_scope(), tf.device(HOST_DEVICE):
        value = init(tuple(variable.shape), dtype=variable.dtype)
        return np.array(value, copy=True)


def consume(variable) -> np.ndarray:
    """:func:`initial_value`, then forget the initializer (and any host value) of a
    deferred variable, so the original object holds no memory once it is replaced."""
    value = initial_value(variable)
    if is_deferred(variable):
        variable._initializer = None  # noqa: SLF001
        _forget([variable])
    return value


def _forget(variables) -> None:
    """Drop ``variables`` from Keras's list of variables to initialize later."""
    ids = {id(v) for v in variables}
    pending = global_state.get_global_attribute(_UNINITIALIZED)
    if pending:
        pending[:] = [v for v in pending if id(v) not in ids]


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Leave the active :class:`PartitionedConstruction` (if any) for the block: variables
    created in it are ordinary, assignments apply. Used by ``shard_model``."""
    scope = get_stateless_scope()
    if not isinstance(scope, _DeferringScope):
        yield
        return
    global_state.set_global_attribute(_SCOPE, scope.original_scope)
    try:
        yield
    finally:
        global_state.set_global_attribute(_SCOPE, scope)


class _DeferringScope(keras.StatelessScope):
    """A ``keras.StatelessScope`` that defers new variables and keeps old ones stateful."""

    def __init__(self) -> None:
        super().__init__(initialize_variables=False)
        self.created: dict[int, keras.Variable] = {}  # id -> deferred variable (this scope)

    def __enter__(self):  # noqa: D105
        before = {id(v) for v in global_state.get_global_attribute(_UNINITIALIZED) or []}
        self._before = before
        return super().__enter__()

    def collect(self) -> list:
        """The variables deferred since ``__enter__`` (Keras's list, minus what was there)."""
        pending = global_state.get_global_attribute(_UNINITIALIZED) or []
        return [v for v in pending if id(v) not in self._before]

    def add_update(self, update) -> None:
        variable, value = update
        if is_deferred(variable) and tf.executing_eagerly():
            # A deferred variable assigned during build: its value moves to the host now.
            host = np.array(value, copy=True).astype(np.dtype(variable.dtype), copy=False)
            variable._initializer = HostValue(host.reshape(tuple(variable.shape)))  # noqa: SLF001
            return
        if is_deferred(variable):  # assigned inside a traced function: Keras's behaviour
            super().add_update(update)
            return
        with suspended():  # a variable that exists: assign for real
            variable.assign(value)

    def __exit__(self, *exc) -> None:
        global_state.set_global_attribute(_SCOPE, self.original_scope)


class PartitionedConstruction:
    """Context manager: build a stage-3 model without materialising it (``zero.Init``).

    Args:
        strategy: the :class:`~zero_runtime.strategy.ZeroInfinityStrategy`. At stage 3
            the context defers variable creation (module docstring); at other stages it is
            ``strategy.scope()`` only.

    Attributes:
        deferred_paths: paths of the trainable float32 variables left deferred for
            ``shard_model`` (set at exit).
        deferred_bytes: their total size in bytes (float32: 4 per element), i.e. what a
            replicated build would have put on each replica's device.
        initialized_paths: paths of the other deferred variables, initialized at exit.

    Raises:
        RuntimeError: entered inside another :class:`PartitionedConstruction`; a variable
            created from a value inside it (see :meth:`__exit__`).
    """

    def __init__(self, strategy) -> None:
        self.strategy = strategy
        self.enabled = strategy.config.stage == 3
        self.deferred_paths: list[str] = []
        self.deferred_bytes = 0
        self.initialized_paths: list[str] = []
        self._stack: contextlib.ExitStack | None = None
        self._scope: _DeferringScope | None = None

    def __enter__(self) -> PartitionedConstruction:
        """Enter the strategy's scope and, at stage 3, the deferring scope."""
        if isinstance(get_stateless_scope(), _DeferringScope):
            raise RuntimeError("zero_init contexts do not nest")
        stack = contextlib.ExitStack()
        stack.enter_context(self.strategy.scope())
        if self.enabled:
            self._scope = _DeferringScope()
            self._scope.__enter__()  # left first in __exit__, inside the strategy scope
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        """Leave the deferring scope, sort its variables (module docstring), leave the
        strategy's scope.

        Raises:
            RuntimeError: from Keras's ``ValueError`` for a variable created from a value
                (not an initializer) inside the context, e.g. by creating an optimizer or
                compiling there: only the model is built inside; compile after it.
        """
        stack, self._stack = self._stack, None
        scope, self._scope = self._scope, None
        try:
            if scope is None:
                return
            scope.__exit__(*exc)  # the variable scope first; the strategy scope stays
            created = scope.collect()
            _forget(created)  # initialized here or by shard_model, never by Keras later
            for v in created:
                shardable = v.trainable and np.dtype(v.dtype) == np.float32
                if shardable:
                    self.deferred_paths.append(v.path)
                    self.deferred_bytes += 4 * math.prod(v.shape)
                elif exc[0] is None:
                    v._deferred_initialize()  # noqa: SLF001  (as a replicated build would)
                    self.initialized_paths.append(v.path)
        finally:
            stack.close()
        if isinstance(exc[1], ValueError) and "stateless scope" in str(exc[1]):
            raise RuntimeError(
                "a variable was created from a value inside strategy.zero_init(), which "
                "defers variables and accepts only initializers: build the model inside "
                "it; create optimizers and compile after the context"
            ) from exc[1]
