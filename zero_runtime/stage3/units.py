"""Which layers are stage-3 *units*, found from the model's own layers.

Vocabulary (docs/design/stage3.md): the **original** variable is what the user's layer
created; its **unit** is the layer whose ``call`` gathers it (one all-gather per use of
the unit, one reduce-scatter of the use's gradients). A unit is every layer that owns
trainable weights *directly* (``layer._trainable_variables``, not through a sublayer):
``Dense``, ``Conv2D``, ``BatchNormalization``, an ``EinsumDense`` inside a
``MultiHeadAttention``, a subclassed model's own ``add_weight``. Containers (models,
``MultiHeadAttention``, user blocks made of sublayers) are not units: their sublayers'
hooks see every use, wherever the model's graph calls them (DAGs, nested and subclassed
models, ``tf.cond`` branches). A variable owned directly by two layers (a head holding
the embedding's table) belongs to both units: each use gathers it and reduce-scatters
its own gradient contribution; the contributions are summed (ZeRO, Rajbhandari et al.,
SC20, section 5.3: reduce-scatter is linear, so the sum equals Mirrored's all-reduced
gradient's shard).

Frozen layers (``trainable=False``) and non-trainable state (BatchNormalization's moving
statistics) are not sharded: they stay replicated, as under ``MirroredStrategy``.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np


@dataclasses.dataclass(frozen=True)
class UnitSpec:
    """One unit before sharding.

    Attributes:
        index: position in the model's layer walk (``_flatten_layers`` order).
        layer: the Keras layer whose ``call`` is hooked.
        originals: its directly-owned trainable variables, in ``_trainable_variables``
            order (Keras variables; replaced by ShardedVariables when sharded).
    """

    index: int
    layer: keras.layers.Layer
    originals: tuple


def plan_units(model: keras.Model) -> tuple[UnitSpec, ...]:
    """The units of ``model`` (built): every layer, the model included, that directly owns
    a trainable variable, each once, in the model's layer walk order.

    Raises:
        ValueError: a trainable weight that is not float32 (stage 3 shards float32),
            naming the weight; a model without trainable weights.
        NotImplementedError: a unit whose own ``call`` draws random numbers (a dropout
            layer or a seed generator inside it): the recomputed forward in backward would
            draw different masks. Naming the layer. A ``Dropout`` layer of its own is
            fine: it is not a unit and runs once.
    """
    specs = []
    for layer in model._flatten_layers(include_self=True):  # noqa: SLF001
        own = [v for v in layer._trainable_variables if v.trainable]  # noqa: SLF001
        if not own:
            continue
        _check_unit(layer, own)
        specs.append(UnitSpec(len(specs), layer, tuple(own)))
    if not specs:
        raise ValueError(f"model {model.name!r} has no trainable weights to shard at stage 3")
    return tuple(specs)


def _check_unit(layer: keras.layers.Layer, own: list) -> None:
    for v in own:
        if np.dtype(v.dtype) != np.float32:
            raise ValueError(
                f"stage 3 supports float32 weights; {v.path!r} of layer {layer.name!r} is "
                f"{v.dtype} (train it at stage 1 or 2, or build the layer in float32)"
            )
    for sub in layer._flatten_layers(include_self=True):  # noqa: SLF001
        if draws_random(sub):
            raise NotImplementedError(
                f"stage 3: layer {layer.name!r} owns weights and draws random numbers in its "
                f"call ({sub.name!r}): the forward recomputed in backward would draw "
                "different masks. Move the dropout into a layer of its own (it then runs "
                "once), or train at stage 1 or 2"
            )


#: Attributes holding the dropout rates of Keras's recurrent cells (``DropoutRNNCell``):
#: the cells own a seed generator whatever the rates and draw from it only when one is > 0.
_RNN_DROPOUT_RATES = ("dropout", "recurrent_dropout")


def draws_random(layer: keras.layers.Layer) -> bool:
    """True when ``layer``'s own call may draw random numbers: a ``Dropout`` of rate > 0,
    or any other layer owning a seed generator, except a recurrent cell (``LSTMCell``,
    ``GRUCell``, ``SimpleRNNCell``) whose ``dropout`` and ``recurrent_dropout`` are 0."""
    if isinstance(layer, keras.layers.Dropout):
        return layer.rate > 0
    if not getattr(layer, "_seed_generators", None):
        return False
    rates = [getattr(layer, a) for a in _RNN_DROPOUT_RATES if hasattr(layer, a)]
    return len(rates) < len(_RNN_DROPOUT_RATES) or any(r > 0 for r in rates)
