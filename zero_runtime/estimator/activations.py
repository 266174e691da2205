"""Activation term: the tensors one replica's forward pass keeps for its backward pass,
read from the traced TensorFlow graph (nothing runs, nothing is allocated).

TensorFlow is imported inside the functions, not at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import keras

_NOT_SAVED = ("ReadVariableOp", "Const", "VarHandleOp", "Placeholder", "Shape", "ZerosLike")


def _saved_for_backward(fn: Any, specs: list[Any]) -> tuple[int, Any]:
    """(bytes of the floating forward tensors the backward pass reads, the output spec)
    of ``fn(*specs)`` traced as a TensorFlow graph (nothing runs, nothing is allocated).

    ``fn`` returns ``(output, gradients)`` computed under a ``tf.GradientTape``; the
    gradient ops are the ones under the tape's ``gradient_tape/`` name scope. Tensors with
    a dynamic shape are not counted.
    """
    import tensorflow as tf

    graph = tf.function(fn).get_concrete_function(*specs).graph

    def backward(op: Any) -> bool:
        return op.name.startswith("gradient_tape/")

    saved: dict[str, int] = {}
    out = None
    for op in graph.get_operations():
        if not backward(op):
            continue
        for t in op.inputs:
            if backward(t.op) or t.op.type in _NOT_SAVED or not t.dtype.is_floating:
                continue
            if t.shape.rank is not None and t.shape.is_fully_defined():
                saved[t.name] = t.shape.num_elements() * t.dtype.size
    outputs = graph.structured_outputs
    out = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
    return sum(saved.values()), tf.TensorSpec(out.shape, out.dtype)


def activation_bytes(
    model: keras.Model,
    batch_shape: tuple[int, ...],
    *,
    input_dtype: str | None = None,
    loss: Any = None,
    checkpoint_units: bool = False,
) -> int:
    """Activation bytes one replica holds at the peak of its step: the tensors its
    forward pass keeps for the backward pass (reverse-mode differentiation), read from
    the traced training graph.

    - ``checkpoint_units=False`` (stages 0-2, Keras's own step): every tensor the whole
      model and the loss keep, ``sum over saved tensors of elements x dtype size``.
    - ``checkpoint_units=True`` (stage 3: the engine recomputes each unit in its backward,
      ``zero_runtime.stage3.engine``, as activation checkpointing, Chen et al. 2016,
      "Training Deep Nets with Sublinear Memory Cost", section 3): while layer ``k``
      recomputes in the backward, the floating inputs of layers ``0..k`` (kept for their
      recompute) plus what layer ``k`` keeps; the maximum over ``k`` and over the loss's
      backward (every input kept plus what the loss keeps). The layers must chain
      (``model.layers`` in order, each taking the previous one's output: a
      ``keras.Sequential`` or a chain-shaped functional model).

    Gradients of activations (transient, one layer's at a time), framework buffers and
    the model states are not included.

    Args:
        model: a built ``keras.Model``.
        batch_shape: the shape of one replica's input batch, e.g. ``(4, 64)`` (the batch
            per replica first).
        input_dtype: the input's dtype; None (default): ``model.inputs[0].dtype``, else
            'float32'.
        loss: ``y_pred -> scalar`` (run under the tape), e.g.
            ``lambda y: loss_obj(targets, y)``; None (default): the sum of the outputs
            (keeps nothing).
        checkpoint_units: see above. Default False.

    Returns:
        Bytes, int >= 0.

    Raises:
        ValueError: ``batch_shape`` has a non-positive dimension.
    """
    import tensorflow as tf

    shape = tuple(int(d) for d in batch_shape)
    if not shape or min(shape) <= 0:
        raise ValueError(f"batch_shape={batch_shape!r} is invalid: expected positive dims")
    if input_dtype is None:
        inputs = getattr(model, "inputs", None)
        input_dtype = str(inputs[0].dtype) if inputs else "float32"
    x_spec = tf.TensorSpec(shape, tf.as_dtype(input_dtype))
    loss_fn = loss if loss is not None else tf.reduce_sum

    def with_tape(forward: Any, weights: list[Any], x: Any) -> Any:
        with tf.GradientTape() as tape:
            sources = list(weights)
            if x.dtype.is_floating:
                tape.watch(x)
                sources.append(x)
            y = forward(x)
            scalar = loss_fn(y) if forward is not loss_fn else y
        return y, tape.gradient(scalar, sources) if sources else []

    if not checkpoint_units:
        saved, _ = _saved_for_backward(
            lambda x: with_tape(lambda t: model(t, training=True), model.trainable_weights, x),
            [x_spec],
        )
        return int(saved)
    # The backward runs the loss first, then the layers last to first: while layer k
    # recomputes, the inputs of layers 0..k are still kept; layers after k are done.
    kept = peak = 0
    spec = x_spec
    for layer in model.layers:
        if spec.dtype.is_floating:
            kept += spec.shape.num_elements() * spec.dtype.size
        saved, spec = _saved_for_backward(
            lambda x, layer=layer: with_tape(
                lambda t: layer(t, training=True), layer.trainable_weights, x
            ),
            [spec],
        )
        peak = max(peak, kept + saved)
    head, _ = _saved_for_backward(lambda x: with_tape(lambda t: t, [], x), [spec])
    return int(max(peak, kept + head))
