"""Consolidated export: a sharded checkpoint as one plain Keras model for serving.

The full parameters are gathered from the shards through the index (no training job, no
strategy, one process) into a fresh copy of the model built from its Keras config, with
no optimizer, so the output loads with plain Keras / TensorFlow (no ``zero_runtime``):

- ``*.keras``: the Keras archive (``keras.models.load_model``);
- any other path: a TensorFlow SavedModel directory (``model.export``; load with
  ``tf.saved_model.load`` and call ``serve``).
"""

from __future__ import annotations

import os
from typing import Any

import keras

from zero_runtime.checkpoint.errors import CheckpointError, CheckpointMismatchError
from zero_runtime.checkpoint.reader import CheckpointReader, resolve


def consolidated_model(checkpoint: str, model: Any = None, tag: str | None = None) -> keras.Model:
    """A plain Keras model holding the checkpoint's full parameters.

    Args:
        checkpoint: a checkpoint root (``latest`` or ``tag``) or a checkpoint directory.
        model: a model of the same architecture to clone (a ``ShardedModel`` is
            unwrapped); default: rebuilt from the config stored in the index.
        tag: the tag under a root.

    Returns:
        A built, uncompiled ``keras.Model`` with the checkpoint's weights.

    Raises:
        CheckpointNotFoundError / CheckpointCorruptError: see ``reader``.
        CheckpointError: no model given and the index holds no model config.
        CheckpointMismatchError: the architecture's weights do not match the checkpoint.
    """
    reader = CheckpointReader(resolve(checkpoint, tag))
    index = reader.index
    if model is not None:
        inner = getattr(model, "inner", model)
        clone = keras.models.clone_model(inner)
        if not clone.built:
            clone.build(inner.input_shape if hasattr(inner, "input_shape") else None)
    elif index.model_config is not None:
        clone = keras.saving.deserialize_keras_object(index.model_config)
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


def export(checkpoint: str, out: str, model: Any = None, tag: str | None = None) -> str:
    """Write the checkpoint's consolidated model to ``out`` (``.keras`` or SavedModel dir).

    Args:
        checkpoint: a checkpoint root or directory (see :func:`consolidated_model`).
        out: ``*.keras`` for a Keras archive, otherwise a SavedModel directory.
        model: optional model of the same architecture (see :func:`consolidated_model`).
        tag: the tag under a root.

    Returns:
        ``out``.

    Raises:
        see :func:`consolidated_model`; OSError when ``out`` cannot be written.
    """
    clone = consolidated_model(checkpoint, model, tag)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    if out.endswith(".keras"):
        clone.save(out)
    else:
        clone.export(out, verbose=False)
    return out
