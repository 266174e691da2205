"""A Keras optimizer instance built inside ``strategy.scope()`` becomes a partitioned one.

Every Keras guide (and Keras-Hub's task models) builds its optimizer as an instance,
``keras.optimizers.Adam(1e-3)``; a custom training loop does too. Inside a
``ZeroInfinityStrategy``'s scope such an instance is *adopted*: the moment Keras creates
its first variable (the iteration counter, in ``BaseOptimizer.__init__``, under
``backend.name_scope(optimizer.name, caller=optimizer)``), the strategy's variable creator
(:func:`creator`) finds the optimizer as the caller of Keras's innermost name scope and
changes its class to the registered partitioned subclass
(:data:`~zero_runtime.optim.partitioned.PARTITIONED_FOR_KERAS`: ``keras.optimizers.Adam``
-> ``zero_runtime.optim.Adam``). The partitioned class is a subclass of the stock one with
the same constructor and no instance layout of its own, so the instance keeps every
hyperparameter the user gave it, and its ``build`` then partitions its states (ZeRO stages
1-3) on the tier ``offload_optimizer`` names. No Keras class is patched: only the
instance's class changes, and only inside the strategy's scope.

A class the runtime cannot partition (a stock Keras optimizer that has no partitioned form,
such as ``Ftrl``, or a user subclass that overrides ``update_step``) is adopted into a
subclass that refuses to build at stages 1-3 (:class:`Unpartitioned`): the error names the
class and what is supported. Below ``mirrored_fallback_bytes`` (or at stage 0) it runs as
stock Keras, as every optimizer does there, and the step records say so
(``fallback_mirrored``). Nothing trains replicated while the config says it is
partitioned.

``keras.optimizers.LossScaleOptimizer`` is a wrapper: it is left as is, and its inner
optimizer (built before it) is adopted on its own.
"""

from __future__ import annotations

import weakref

import keras
from keras.src.backend.common import global_state

from zero_runtime.optim.partitioned import _PartitionedUpdate
from zero_runtime.optim.registry import PARTITIONED_FOR_KERAS, refusal, supported_names

__all__ = [
    "Unpartitioned",
    "adopt",
    "creator",
    "partitioned_class_for",
    "refusal",
    "supported_names",
]

#: Keras optimizer classes that wrap another optimizer (left as they are).
WRAPPERS: tuple[type, ...] = (keras.optimizers.LossScaleOptimizer,)

# Dynamic subclasses of unsupported classes, one per class (so isinstance and
# serialization see one class per user class).
_UNPARTITIONED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Partitioned subclasses of users' subclasses of a supported class, one per class.
_SUBCLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _caller_optimizer():
    """The optimizer whose ``name_scope`` is innermost now, or None."""
    stack = global_state.get_global_attribute("name_scope_stack", default=None)
    if not stack:
        return None
    caller = stack[-1].caller
    return caller if isinstance(caller, keras.optimizers.Optimizer) else None


def partitioned_class_for(cls: type) -> type | None:
    """The registered partitioned class for the stock Keras optimizer class ``cls``.

    Exact classes only (``keras.optimizers.Adam`` -> ``zero_runtime.optim.Adam``); a
    subclass of a registered class is partitioned as its base when it overrides none of
    the methods that compute the update (``update_step``, ``_backend_update_step``,
    ``build``); otherwise None.
    """
    if cls in PARTITIONED_FOR_KERAS:
        return PARTITIONED_FOR_KERAS[cls]
    for base in cls.__mro__[1:]:
        if base in PARTITIONED_FOR_KERAS:
            same = all(
                getattr(cls, name) is getattr(base, name)
                for name in ("update_step", "_backend_update_step", "build")
            )
            if not same:
                return None
            made = _SUBCLASSES.get(cls)
            if made is None:  # one partitioned class per user class, made once
                # The partitioned mixin first, then the user's class (which has the stock
                # one among its bases): the user's own methods (get_config, ...) stay.
                zero = PARTITIONED_FOR_KERAS[base]
                made = type(cls.__name__, (zero, cls), {"__module__": cls.__module__})
                _SUBCLASSES[cls] = made
            return made
    return None


def adopt(optimizer: keras.optimizers.Optimizer) -> type:
    """Make ``optimizer`` (an instance) partitioned in place; return its new class.

    Already partitioned (``zero_runtime.optim.Adam``, or a name resolved inside the
    scope) or a wrapper (``LossScaleOptimizer``): unchanged. A class with a partitioned
    form: changed to it. Any other: changed to its :class:`Unpartitioned` subclass, which
    refuses to build where the config asks for partitioning.
    """
    cls = type(optimizer)
    if isinstance(optimizer, (_PartitionedUpdate, *WRAPPERS)):
        return cls
    target = partitioned_class_for(cls)
    if target is None:
        target = _UNPARTITIONED.get(cls)
        if target is None:
            target = type(cls.__name__, (Unpartitioned, cls), {"__module__": cls.__module__})
            _UNPARTITIONED[cls] = target
    optimizer.__class__ = target
    return target


def creator(next_creator, **kwargs):
    """``tf.variable_creator_scope`` function of the strategy's scope: adopts the Keras
    optimizer whose ``__init__`` creates this variable (see the module docstring), then
    creates the variable as the next creator would."""
    opt = _caller_optimizer()
    if opt is not None and not getattr(opt, "_zero_adopted", False):
        object.__setattr__(opt, "_zero_adopted", True)
        adopt(opt)
    return next_creator(**kwargs)


class Unpartitioned(_PartitionedUpdate):
    """Mixin of an optimizer class the runtime has no partitioned update for.

    It runs as the stock Keras optimizer where the strategy runs plain data parallelism
    (stage 0, or a model below ``mirrored_fallback_bytes``: recorded as
    ``fallback_mirrored`` in every step record), and refuses to build where the config
    asks for partitioned optimizer states (:meth:`build`).
    """

    _zero_supported = False
