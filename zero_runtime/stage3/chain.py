"""Which models the block engine runs: a chain of top-level layers without shared
weights, BatchNormalization, dropout or mixed precision, and the in-place replacement of
a layer's weights by sharded variables (:func:`_replace_variable`, also used by the
units path)."""

from __future__ import annotations

import keras
import numpy as np

from zero_runtime.sharded_variable import redirect


def _chain_or_none(model: keras.Model) -> list | None:
    """The model's blocks when it is a chain the per-block path runs (a Sequential or a
    functional chain, no shared weights, BatchNormalization or dropout); None otherwise
    (the model then runs by units)."""
    try:
        layers = _chain_layers(model)
        _check_unshared(layers)
        for layer in layers:
            _check_supported(layer)
    except NotImplementedError:
        return None
    except ValueError as exc:
        if "float32" in str(exc):
            raise
        return None
    return layers


def _chain_layers(model: keras.Model) -> list:
    """The top-level layers of ``model`` as a chain of blocks (each consumes the output
    of the one before).

    Raises:
        ValueError: a model that is not a ``keras.Sequential`` or a functional chain,
            naming the first layer that breaks the chain and why.
    """
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    if isinstance(model, keras.Sequential):
        return layers
    why = "stage 3 runs a keras.Sequential or a functional model whose top-level layers "
    why += "form a single chain (docs/zero_stages.md)"
    inputs = getattr(model, "inputs", None)
    if not inputs or not hasattr(model, "_operations"):
        raise ValueError(
            f"model {model.name!r} ({type(model).__name__}) is not a functional model: {why}"
        )
    if len(inputs) != 1:
        raise ValueError(f"model {model.name!r} has {len(inputs)} inputs: {why}")
    h = inputs[0]
    for layer in layers:
        nodes = layer._inbound_nodes  # noqa: SLF001
        args = nodes[0].input_tensors if len(nodes) == 1 else []
        if len(args) != 1 or args[0] is not h:
            reason = (
                f"is called {len(nodes)} times"
                if len(nodes) != 1
                else f"takes {len(args)} inputs"
                if len(args) != 1
                else "does not take the previous layer's output (a residual or branching graph)"
            )
            raise ValueError(f"model {model.name!r}: layer {layer.name!r} {reason}: {why}")
        h = layer.output
    return layers


def _check_unshared(layers: list) -> None:
    """Refuse a trainable weight used by two blocks (tied weights, or a layer holding
    another block's layer): stage 3 gathers, reduces and updates each weight with the
    one block that owns it.

    Raises:
        ValueError: naming the weight and both blocks.
    """
    owner: dict[int, keras.layers.Layer] = {}
    for layer in layers:
        for v in layer.trainable_variables:
            first = owner.setdefault(id(v), layer)
            if first is not layer:
                raise ValueError(
                    f"weight {v.path!r} is used by blocks {first.name!r} and {layer.name!r} "
                    "(tied or shared weights): stage 3 gathers and updates each weight with "
                    "one block; put the layers that share it in one block (one layer) or "
                    "untie it"
                )


def _check_supported(layer: keras.layers.Layer) -> None:
    for sub in layer._flatten_layers(include_self=True):  # noqa: SLF001
        if isinstance(sub, keras.layers.BatchNormalization):
            raise NotImplementedError(
                f"stage 3: layer {sub.name!r} (BatchNormalization) updates its moving "
                "statistics in call, which the recomputed backward would repeat; not "
                "implemented at stage 3 yet (train it at stage 1 or 2)"
            )
        if isinstance(sub, keras.layers.Dropout) and sub.rate > 0:
            raise NotImplementedError(
                f"stage 3: {sub.name!r} has dropout {sub.rate}: the recomputed forward "
                "would draw different masks"
            )
        if getattr(sub, "dropout", 0) and isinstance(sub, keras.layers.MultiHeadAttention):
            raise NotImplementedError(f"stage 3: {sub.name!r} has attention dropout")
        policy = sub.dtype_policy
        if policy.compute_dtype != policy.variable_dtype:
            # The block path calls layers outside Keras's __call__ (no autocast); units
            # run mixed precision as Keras does (zero_runtime/stage3/gather.py).
            raise NotImplementedError(f"stage 3: {sub.name!r} computes in {policy.name}")
    for v in layer.trainable_variables:
        if np.dtype(v.dtype) != np.float32:
            raise ValueError(f"stage 3 supports float32 weights; {v.path!r} is {v.dtype}")


def _replace_variable(layer: keras.layers.Layer, old, new) -> None:
    """Point every reference to ``old`` in ``layer`` and its sublayers at ``new``.

    Keras layers hold their weights as attributes (``Dense._kernel``), in their trackers'
    lists (``_trainable_variables``) and, under TensorFlow, in TensorFlow's checkpoint
    dependency records (a ``TrackedDict`` of names and a list of ``TrackableReference``
    pairs). All are rewritten in place, by identity, so that nothing keeps the replicated
    original alive once the sharded variable replaces it; a reference held elsewhere (a
    loop's ``train_vars`` read before sharding) becomes an alias of ``new``
    (:func:`~zero_runtime.sharded_variable.redirect`).
    """
    redirect(old, new)
    for sub in layer._flatten_layers(include_self=True):  # noqa: SLF001
        for name, value in list(vars(sub).items()):
            if value is old:
                object.__setattr__(sub, name, new)
            elif isinstance(value, list):
                for j, item in enumerate(value):
                    if item is old:
                        value[j] = new
                    elif getattr(item, "ref", None) is old and hasattr(item, "name"):
                        value[j] = type(item)(item.name, new)  # TrackableReference(name, ref)
            elif isinstance(value, dict):  # includes Keras's TrackedDict
                for key, item in list(value.items()):
                    if item is old:
                        value[key] = new
