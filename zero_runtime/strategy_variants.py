"""Concrete strategy variants, registered by the modules that define them.

``ZeroInfinityStrategy(...)`` is one public name over several concrete classes (the
single-process one over ``MirroredStrategy`` and the multi-worker subclass over
``MultiWorkerMirroredStrategy``). A subclass module imports the strategy module to
subclass it, so the strategy cannot import the subclass back without an import circle.
Instead the subclass module registers itself here, below both, with a predicate that says
when it applies; ``ZeroInfinityStrategy.__new__`` asks :func:`select`. The package's
``zero_runtime.ZeroInfinityStrategy`` imports every variant module first
(``zero_runtime/__init__.py``), so the public name always sees them all.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Variant:
    """One registered concrete strategy class.

    Attributes:
        name: a short label for messages (e.g. ``"multi-worker"``).
        applies: called with no arguments at construction; True when this class is the one
            to build (e.g. ``TF_CONFIG`` names a cluster).
        cls: the class, a subclass of the base it is selected for.
    """

    name: str
    applies: Callable[[], bool]
    cls: type


_VARIANTS: list[Variant] = []
_LOCK = threading.Lock()


def register(name: str, applies: Callable[[], bool], cls: type) -> None:
    """Register ``cls`` as the class to build when ``applies()`` is true.

    Registering the same name again replaces the earlier entry (a module reloaded).

    Raises:
        TypeError: ``cls`` is not a class or ``applies`` is not callable.
    """
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a class, got {cls!r}")
    if not callable(applies):
        raise TypeError(f"applies must be callable, got {applies!r}")
    with _LOCK:
        _VARIANTS[:] = [v for v in _VARIANTS if v.name != name]
        _VARIANTS.append(Variant(name, applies, cls))


def registered(base: type) -> tuple[Variant, ...]:
    """The variants registered for ``base`` (subclasses of it), in registration order."""
    with _LOCK:
        return tuple(v for v in _VARIANTS if issubclass(v.cls, base) and v.cls is not base)


def select(base: type) -> type:
    """The class to build for ``base``: the first registered subclass whose predicate holds,
    else ``base`` itself."""
    for variant in registered(base):
        if variant.applies():
            return variant.cls
    return base
