"""Consolidated export: a sharded checkpoint as one plain Keras model for serving.

The full parameters are gathered from the shards through the index (no training job, no
strategy, one process) into a fresh copy of the model built from its Keras config, with
no optimizer, so the output loads with plain Keras / TensorFlow (no ``zero_runtime``):

- ``*.keras``: the Keras archive (``keras.models.load_model``);
- any other path: a TensorFlow SavedModel directory (``model.export``; load with
  ``tf.saved_model.load`` and call ``serve``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Any

import keras

from zero_runtime.checkpoint.errors import CheckpointError, CheckpointMismatchError
from zero_runtime.checkpoint.reader import CheckpointReader, resolve


def consolidated_model(
    checkpoint: str,
    model: Any = None,
    tag: str | None = None,
    import_modules: Sequence[str] = (),
) -> keras.Model:
    """A plain Keras model holding the checkpoint's full parameters.

    Args:
        checkpoint: a checkpoint root (``latest`` or ``tag``) or a checkpoint directory.
        model: a model of the same architecture to clone (a ``ShardedModel`` is
            unwrapped); default: rebuilt from the config stored in the index.
        tag: the tag under a root.
        import_modules: modules to import first (by name, found on ``sys.path``), e.g.
            ``["demo.model"]``: they register the model's custom layer classes, which
            Keras needs to rebuild it from the config (default none).

    Returns:
        A built, uncompiled ``keras.Model`` with the checkpoint's weights.

    Raises:
        CheckpointNotFoundError / CheckpointCorruptError: see ``reader``.
        CheckpointError: no model given and the index holds no model config, or the
            config uses custom classes this process has not registered (the message
            names them and their modules).
        CheckpointMismatchError: the architecture's weights do not match the checkpoint.
        ImportError: a module of ``import_modules`` cannot be imported.
    """
    for name in import_modules:
        importlib.import_module(name)
    reader = CheckpointReader(resolve(checkpoint, tag))
    index = reader.index
    if model is not None:
        inner = getattr(model, "inner", model)
        clone = keras.models.clone_model(inner)
        if not clone.built:
            clone.build(inner.input_shape if hasattr(inner, "input_shape") else None)
    elif index.model_config is not None:
        clone = _from_config(index.model_config, index.tag, import_modules)
    else:
        raise CheckpointError(
            f"checkpoint {index.tag!r} holds no model config (the model was not "
            "serialisable); pass a model of the same architecture"
        )
    params = index.group("param")
    extra = index.group("model_var")
    trainable, frozen = clone.trainable_variables, clone.non_trainable_variables
    if len(params) != len(trainable) or len(extra) != len(frozen):
        raise CheckpointMismatchError(
            f"checkpoint {index.tag!r} has {len(params)} trainable and {len(extra)} other "
            f"variables; the model has {len(trainable)} and {len(frozen)}"
        )
    for rec, v in zip(params + extra, list(trainable) + list(frozen)):
        if tuple(v.shape) != rec.shape:
            raise CheckpointMismatchError(
                f"variable {v.path!r}: model shape {tuple(v.shape)} != checkpoint shape "
                f"{rec.shape} (saved as {rec.path!r})"
            )
        v.assign(reader.read(rec.name))
    return clone


def custom_classes(config: Any) -> list[tuple[str, str]]:
    """``(module, class_name)`` of every object outside Keras in a Keras serialisation
    (``{"module", "class_name", ...}`` records whose module is not ``keras*``), in
    first-seen order, without repeats."""
    found: list[tuple[str, str]] = []
    stack = [config]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            module, name = item.get("module"), item.get("class_name")
            if isinstance(module, str) and isinstance(name, str):
                if not module.startswith("keras") and (module, name) not in found:
                    found.append((module, name))
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            stack.extend(reversed(item))
    return found


def _from_config(config: dict, tag: str, import_modules: Sequence[str]) -> keras.Model:
    """Rebuild the model from its stored config; a missing custom class becomes a
    :class:`CheckpointError` naming the classes and the modules to import."""
    try:
        return keras.saving.deserialize_keras_object(config)
    except (TypeError, ValueError) as exc:
        custom = custom_classes(config)
        if not custom or "Could not locate" not in str(exc):
            raise
        modules = sorted({m for m, _ in custom})
        names = ", ".join(f"{m}.{c}" for m, c in custom)
        raise CheckpointError(
            f"checkpoint {tag!r}: the model uses custom classes ({names}) that are not "
            f"registered in this process (imported: {list(import_modules)}); import their "
            f"module(s) {modules} first (zero-runtime export --import MODULE, or "
            "export(..., import_modules=[...])), or pass a model of the same architecture"
        ) from None


def export(
    checkpoint: str,
    out: str,
    model: Any = None,
    tag: str | None = None,
    import_modules: Sequence[str] = (),
) -> str:
    """Write the checkpoint's consolidated model to ``out`` (``.keras`` or SavedModel dir).

    Args:
        checkpoint: a checkpoint root or directory (see :func:`consolidated_model`).
        out: ``*.keras`` for a Keras archive, otherwise a SavedModel directory.
        model: optional model of the same architecture (see :func:`consolidated_model`).
        tag: the tag under a root.
        import_modules: modules registering custom classes (see :func:`consolidated_model`).

    Returns:
        ``out``.

    Raises:
        CheckpointError: as :func:`consolidated_model` (its subclasses included).
        ImportError: as :func:`consolidated_model`.
        OSError: ``out`` cannot be written.
    """
    clone = consolidated_model(checkpoint, model, tag, import_modules)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    if out.endswith(".keras"):
        clone.save(out)
    else:
        clone.export(out, verbose=False)
    return out
