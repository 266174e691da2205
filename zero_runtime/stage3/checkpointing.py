"""Activation checkpointing of a stage-3 model's blocks on the units path.

Once parameters, gradients and optimizer states leave the device (offload, the update
during backward, memory-centric tiling), what a deep model's training step still holds
on the device grows with its activations: every unit keeps its inputs for the recompute
in its backward (:mod:`zero_runtime.stage3.gather`), and the ops between units (a
residual ``Add``, attention's softmax) keep what TensorFlow's own gradients need.
Measured on bench_max_model's GPT family (batch 4 x 32 tokens, 2 replicas): about 7 tensors
of the block's width per block per replica, 1.3 MB x k^2 in all, which passes 256 MiB at
k = 14 (d_model 896) whatever the parameters do.

Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"; ZeRO-R, Rajbhandari et al., SC20, section 6.1; DeepSpeed's
``deepspeed.checkpointing.checkpoint``, PyTorch's ``checkpoint_wrapper``) keeps only a
block's inputs from the forward pass and runs the block's call again in its backward.
With ``activation_checkpointing=True`` every **block** is checkpointed: an outermost
layer that is not a model and holds layers owning weights (a transformer block holding
its attention, normalization and MLP layers; a ``MultiHeadAttention``), found by
:func:`plan_blocks`. Per block use, on each replica::

    forward   (no tape)  y = block.call(x): its units gathered, called, released
              (UnitRunner mode "no_grad": counted as uses, no backward, nothing kept)
    backward  y2 = block.call(x) again under a tape (mode "recompute": every unit use
              with its own backward, as without checkpointing, not counted again, state
              updates such as BatchNormalization's discarded: they were assigned once in
              the forward), then the tape's gradient of y2 with ``dy``: dx and every
              anchor's reduced gradient shard (and the update-during-backward tokens)

So each unit inside a block is gathered three times per step (forward, recompute,
backward's recompute) instead of two. The result is the computation without
checkpointing: the same ops on the same values (the recompute reads the same shards,
which change only after the step's backward), except that the gradient of a block's
input, summed over the paths inside the block (a residual and a normalization), is
summed by the recompute's tape in an order that may round differently (measured: a
16-block GPT's second loss 1.1e-7 relative apart; a 2-block GPT bitwise equal after two
epochs, tests/test_stage3_checkpointing.py).

Refused (``NotImplementedError`` naming the layer): a block that draws random numbers
(a ``Dropout`` of rate > 0, a seed generator: the recompute would draw other masks), and
a unit used inside a ``tf.cond``/``tf.while_loop`` within a block.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf

from zero_runtime.stage3 import units as units_plan
from zero_runtime.stage3.gather import keras_logits_positions, with_keras_logits


def plan_blocks(model: keras.Model, unit_layers: list) -> list:
    """The layers of ``model`` that activation checkpointing recomputes.

    Args:
        model: the built Keras model.
        unit_layers: the layers of its units (:class:`~zero_runtime.stage3.gather.Unit`
            ``layer``), hooked or not.

    Returns:
        The outermost layers, in the model's layer walk order, that are not a
        ``keras.Model`` and hold at least one unit's layer among their sublayers (the
        layer itself excluded); a layer inside another such layer is not listed.

    Raises:
        NotImplementedError: a block that draws random numbers (``Dropout`` of rate > 0,
            a seed generator), naming it and the layer that draws.
    """
    ids = {id(layer) for layer in unit_layers}
    blocks: list = []
    inside: set = set()
    for layer in model._flatten_layers(include_self=False):  # noqa: SLF001
        if id(layer) in inside or isinstance(layer, keras.Model):
            continue
        subs = list(layer._flatten_layers(include_self=False))  # noqa: SLF001
        if not any(id(sub) in ids for sub in subs):
            continue
        for sub in [layer, *subs]:
            if units_plan.draws_random(sub):
                raise NotImplementedError(
                    f"stage 3: activation_checkpointing recomputes block {layer.name!r} in "
                    f"backward, and {sub.name!r} in it draws random numbers: the recompute "
                    "would draw other masks. Set its rate to 0 or activation_checkpointing="
                    "False"
                )
        blocks.append(layer)
        inside.update(id(sub) for sub in subs)
    return blocks


class CheckpointedBlock:
    """One checkpointed block's hook: its ``call`` runs as described in the module
    docstring inside a training step, as is outside one.

    Args:
        layer: the block (from :func:`plan_blocks`).
        runner: the model's :class:`~zero_runtime.stage3.gather.UnitRunner`.

    The hook is an instance attribute ``call`` of the layer (no Keras class patched),
    removed with the units' hooks by ``runner.remove()``.
    """

    def __init__(self, layer: keras.layers.Layer, runner) -> None:
        self.layer = layer
        self.runner = runner
        self.call = layer.__dict__.get("call") or type(layer).call.__get__(layer)
        object.__setattr__(layer, "call", functools.partial(CheckpointedBlock.hooked, self))
        runner.regions.append(layer)

    def hooked(self, *args, **kwargs):
        """The block's ``call``: checkpointed in a training step's forward, else as is
        (outside a step, in a forward-only pass, or already inside a checkpointed
        block's forward or recompute)."""
        runner = self.runner
        if not runner.in_step():
            return self.call(*args, **kwargs)
        state = runner.step_state()
        if state.anchors is None or state.mode != "normal":
            return self.call(*args, **kwargs)
        structure = (args, kwargs)
        flat = tf.nest.flatten(structure)
        pos = [i for i, a in enumerate(flat) if tf.is_tensor(a)]
        inputs = [flat[i] for i in pos]
        anchors = list(state.anchors.values())  # scalars: a block reads any original
        done_in = [] if state.done is None else [state.done]
        n_in, n_anchor = len(inputs), len(anchors)
        box: dict = {}

        def run(tensors):
            values = list(flat)
            for i, t in zip(pos, tensors):
                values[i] = t
            a, kw = tf.nest.pack_sequence_as(structure, values)
            return self.call(*a, **kw)

        @tf.custom_gradient
        def block(*xs):
            tensors = list(xs[:n_in])
            with runner.mode(state, "no_grad"):
                out = run(tensors)
            # A softmax/sigmoid output's logits are outputs of the block too (Keras's
            # crossentropy reads them; gather.keras_logits_positions).
            box["logits"] = keras_logits_positions(tf.nest.flatten(out))
            outs = with_keras_logits(tf.nest.flatten(out), box["logits"])
            box["structure"], box["n_out"] = out, len(tf.nest.flatten(out))

            def grad(*dys):
                dys = [tf.zeros_like(o) if d is None else d for o, d in zip(outs, dys)]
                float_in = [k for k, t in enumerate(tensors) if t.dtype.is_floating]
                sources = [tensors[k] for k in float_in] + anchors + done_in
                with tf.GradientTape() as tape:
                    tape.watch(sources)
                    with runner.mode(state, "recompute"):
                        out2 = run(tensors)
                gs = tape.gradient(
                    with_keras_logits(tf.nest.flatten(out2), box["logits"]),
                    sources,
                    output_gradients=dys,
                    unconnected_gradients=tf.UnconnectedGradients.NONE,
                )
                dxs: list = [None] * n_in
                for k, g in zip(float_in, gs[: len(float_in)]):
                    dxs[k] = g
                rest = gs[len(float_in) :]
                return (*dxs, *rest[:n_anchor], *rest[n_anchor:])

            return outs, grad

        result = block(*inputs, *anchors, *done_in)
        n_out = box["n_out"]
        flat_out = list(result[:n_out])
        for k, logits in zip(box["logits"], result[n_out:]):
            flat_out[k]._keras_logits = logits  # noqa: SLF001  (Keras's own attribute)
        return tf.nest.pack_sequence_as(box["structure"], flat_out)
