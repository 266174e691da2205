"""The registry of partitioned optimizers: which Keras class has which ZeRO form.

``zero_runtime.optim.partitioned`` (Adam, AdamW, SGD),
``zero_runtime.optim.elementwise`` (RMSprop, Adagrad, Adamax, Nadam, Lion) and
``zero_runtime.optim.adafactor`` register their classes here; the strategy's scope maps
the names (:data:`PARTITIONED_BY_NAME`) and adopts instances (:data:`PARTITIONED_FOR_KERAS`,
``zero_runtime.optim.adopt``). This module imports none of them: the refusal text of a
class with no partitioned form (:func:`refusal`) is here too, for the partitioned
optimizer's ``build`` to raise.
"""

from __future__ import annotations

import keras

#: Keras optimizer identifiers that the strategy maps to partitioned optimizers.
PARTITIONED_BY_NAME: dict[str, type] = {}

#: Stock Keras optimizer class -> its partitioned subclass. An instance of a key built
#: inside ``strategy.scope()`` becomes an instance of the value (zero_runtime/optim/adopt.py).
PARTITIONED_FOR_KERAS: dict[type, type] = {}


def _is_zero_class(cls: type) -> bool:
    """True for a class of the runtime's ZeRO update (it defines the host-step hook)."""
    return hasattr(cls, "_zero_host_step")


def register_partitioned(keras_class: type, partitioned_class: type, *names: str) -> None:
    """Register ``partitioned_class`` as the ZeRO form of the stock ``keras_class``.

    Args:
        keras_class: a ``keras.optimizers.Optimizer`` subclass (e.g. ``keras.optimizers.Adam``).
        partitioned_class: its subclass mixing in the ZeRO update (``_PartitionedUpdate``).
        names: Keras identifiers (``"adam"``, ``"Adam"``) that resolve to it inside
            ``strategy.scope()``.

    Raises:
        TypeError: ``partitioned_class`` is not a subclass of both ``keras_class`` and
            the ZeRO update mixin.
    """
    if not (issubclass(partitioned_class, keras_class) and _is_zero_class(partitioned_class)):
        raise TypeError(
            f"{partitioned_class.__name__} must subclass {keras_class.__name__} and the "
            "ZeRO update mixin (_PartitionedUpdate)"
        )
    PARTITIONED_FOR_KERAS[keras_class] = partitioned_class
    for name in names:
        PARTITIONED_BY_NAME[name] = partitioned_class


def supported_names() -> list[str]:
    """The Keras optimizer classes with a partitioned form, e.g. ``["Adam", "SGD"]``."""
    return sorted(c.__name__ for c in PARTITIONED_FOR_KERAS)


def user_class(cls: type) -> type:
    """The user's optimizer class behind an adopted class ``cls`` (the first class of its
    MRO that is a Keras optimizer and not part of the runtime's ZeRO update)."""
    return next(
        c
        for c in cls.__mro__
        if issubclass(c, keras.optimizers.Optimizer) and not _is_zero_class(c)
    )


def refusal(cls: type, stage: int) -> str:
    """The message refusing to partition an optimizer of (adopted) class ``cls`` at ZeRO
    ``stage``: the class, why it has no partitioned update, and the supported classes."""
    user = user_class(cls)
    name = f"{user.__module__}.{user.__qualname__}"
    if user.__module__.startswith("keras."):
        name = f"keras.optimizers.{user.__qualname__}"
    base = next((b for b in user.__mro__[1:] if b in PARTITIONED_FOR_KERAS), None)
    if base is not None:
        why = (
            f"it subclasses keras.optimizers.{base.__name__} but overrides the update "
            "(update_step, _backend_update_step or build), which the partitioned "
            "update cannot run on a shard"
        )
    else:
        why = "the runtime has no partitioned update for this class"
    return (
        f"ZeRO stage {stage} partitions the optimizer states, but {name} cannot be "
        f"partitioned: {why}. Build one of keras.optimizers.{{{', '.join(supported_names())}}} "
        "inside strategy.scope(), or train at stage 0 (plain data parallelism)"
    )
