"""Per-replica estimate of a built Keras model (``estimate_for_model``), and building
one without allocating its weights (``build_model_abstractly``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from zero_runtime.config import ZeroConfig
from zero_runtime.estimator.activations import activation_bytes
from zero_runtime.estimator.formulas import _check_positive_int, _Choice, _estimate, _Inputs
from zero_runtime.estimator.results import ModelEstimate
from zero_runtime.estimator.units import (
    _num_elements,
    _units,
    _working_set,
    optimizer_kind,
    row_cache_bytes,
)

if TYPE_CHECKING:  # pragma: no cover
    import keras


def estimate_for_model(
    model: keras.Model,
    config: ZeroConfig,
    num_replicas: int,
    precision: str | None = "fp32",
    optimizer: str | None = None,
    *,
    accounting: str = "sc20",
    page_rounding: bool = False,
    stage: int | None = None,
    offload_optimizer: str | None = None,
    offload_param: str | None = None,
    batch_shape: tuple[int, ...] | None = None,
    loss: Any = None,
) -> ModelEstimate:
    """Per-replica estimate for a built Keras model, with the working memory.

    Counting (all in elements; a weight shared by several layers counts once):

    - Ψ = elements of ``model.trainable_weights`` + ``model.non_trainable_weights``.
      Gradients and optimizer states cover only the trainable weights.
    - Units are the top-level layers (``model.layers``), in order (the stage-3 engine's
      blocks); a unit's size is the elements of its weights. ``largest_block_params`` is
      the largest unit.
    - Stage 3 only: weights with fewer elements than ``config.persistence_threshold``
      stay replicated on the device ("persistent_params", p bytes each, not divided by
      N_d); the rest is partitioned.
    - Working memory ("working_set", device), with ``b_i`` the partitioned elements of
      unit i, ``t_i`` its partitioned trainable elements and ``P`` =
      ``config.prefetch_bucket_size``:

      - 'sc20', stage 3: gathered parameters of a unit and the prefetched next one,
        ``p * max_i(b_i + min(b_{i+1}, P))``.
      - 'sc21', stage 3: SC21 section 3.2's parameters and gradients of the largest unit,
        plus the prefetched next unit and, under a Keras mixed policy, the 2-byte cast of
        the gathered weights: ``max_i((p + c) b_i + g t_i + p min(b_{i+1}, P))``, with
        ``c`` = 2 under a mixed policy, else 0.
      - 'sc21', stages 0-2 under a Keras mixed policy: the cast copy of the largest unit,
        ``2 * largest_block_params``; otherwise none.

      The working memory is per replica: on the CPU stand-in every local replica gathers
      its own copy, so a process holds ``local_replicas`` times it.
    - ``page_rounding``: host and NVMe terms are rounded up to ``config.page_size_bytes``
      per unit (each unit's shard is at least one page in the paged pool); at stage 3 the
      parameters on the host or NVMe are packed into one flat space per replica
      (``zero_runtime.memory.FlatShardSpace``), rounded up once (a row-paged table apart).
    - Stage 3, tiling: an embedding the engine row-pages (a plain ``Embedding`` of at
      least ``config.embedding_row_paging_threshold`` elements) is never gathered whole:
      it is left out of the working memory, and its device row cache
      (``row_cache_bytes``) is the "row_cache" term. The looked-up rows themselves
      (batch-dependent) are not counted.

    Args:
        model: a built ``keras.Model`` (it must have weights; they need not be
            initialised: ``build_model_abstractly`` builds one without allocating them).
        config: supplies stage, offload devices, persistence threshold, prefetch size and
            page size.
        num_replicas: N_d, int >= 1.
        precision: 'fp32' (default), 'mixed', or None: from the layers' dtype policies
            (``policy_precision``: float32 variables, so 'fp32', and each layer's compute
            dtype for its cast copy; a policy with other variables raises). With 'fp32'
            given, the layers' compute dtypes are still read (unmodelled ones count 4).
        optimizer: key of ``OPTIMIZER_STATE_BYTES``; None (default) infers it from
            ``model.optimizer`` with ``optimizer_kind``, or 'adam' if not compiled.
        accounting: 'sc20' (default) or 'sc21' (module docstring).
        page_rounding: see above. Default False.
        stage: overrides ``config.stage`` (None, the default, keeps it), e.g. to try
            every choice with one config.
        offload_optimizer: overrides ``config.offload_optimizer`` (None keeps it).
        offload_param: overrides ``config.offload_param`` (None keeps it).
        batch_shape: one replica's input batch shape, e.g. ``(4, 64)``; given, the
            device tier adds the "activations" term, :func:`activation_bytes` (with
            ``checkpoint_units`` at stage 3), and the estimate is of the in-step peak
            (model states at the step boundary plus the activations kept for backward).
            None (default): model states only.
        loss: ``y_pred -> scalar`` for :func:`activation_bytes` (None: the outputs' sum).

    Returns:
        ModelEstimate.

    Raises:
        ValueError: the model has no weights, invalid arguments, or an optimizer whose
            state size cannot be inferred.
    """
    _check_positive_int("num_replicas", num_replicas)
    stage = config.stage if stage is None else stage
    offload_optimizer = offload_optimizer or config.offload_optimizer
    offload_param = offload_param or config.offload_param
    if optimizer is None:
        compiled = getattr(model, "optimizer", None)
        optimizer = optimizer_kind(compiled) if compiled is not None else "adam"
    inferred = precision is None
    precision = "fp32" if inferred else precision
    choice = _Choice(stage, offload_optimizer, offload_param, precision, optimizer, accounting)

    trainable = {id(v): v for v in model.trainable_weights}
    everything = dict(trainable)
    for v in model.non_trainable_weights:
        everything.setdefault(id(v), v)
    num_params = sum(_num_elements(v) for v in everything.values())
    if num_params == 0:
        raise ValueError("model has no weights: build it (call it on an input) first")
    trainable_params = sum(_num_elements(v) for v in trainable.values())

    stage3 = stage >= 3
    threshold = config.persistence_threshold

    def persistent(n: int) -> bool:
        return stage3 and n < threshold

    persistent_params = sum(
        _num_elements(v) for v in everything.values() if persistent(_num_elements(v))
    )
    units = _units(
        model,
        persistent,
        strict_policy=inferred,
        row_paging_threshold=config.embedding_row_paging_threshold if stage3 else None,
    )
    if precision != "fp32":  # explicit 'mixed': 2-byte storage, no separate cast copy
        units = [dataclasses.replace(u, compute_bytes=choice.p) for u in units]
    compute = min((u.compute_bytes for u in units if u.params), default=4)
    largest = max(units, key=lambda u: u.params, default=None)
    largest_params, largest_name = (largest.params, largest.name) if largest else (0, "")
    if largest_params == 0:
        largest_name = ""

    working_set = _working_set(
        units, stage, accounting, choice.p, choice.g, config.prefetch_bucket_size
    )
    activations = 0
    if batch_shape is not None:
        activations = activation_bytes(model, batch_shape, loss=loss, checkpoint_units=stage >= 3)
    tiers = _estimate(
        _Inputs(
            choice,
            num_params,
            num_replicas,
            trainable_params=trainable_params,
            persistent_params=persistent_params,
            working_set_bytes=working_set,
            page_size_bytes=config.page_size_bytes if page_rounding else None,
            param_units=_param_units(units, stage3, offload_param),
            trainable_units=[u.trainable for u in units],
            row_cache_bytes=sum(
                row_cache_bytes(u.table_shape, config.page_size_bytes, num_replicas)
                for u in units
                if u.table_shape
            ),
            activation_bytes=activations,
            offload_ratio=config.offload_optimizer_ratio,
        )
    )
    return ModelEstimate(
        tiers=tiers,
        num_params=num_params,
        trainable_params=trainable_params,
        largest_block_params=largest_params,
        largest_block_name=largest_name,
        persistent_params=persistent_params,
        working_set_bytes=working_set,
        activation_bytes=activations,
        precision=precision,
        compute_bytes=compute,
        accounting=accounting,
        optimizer=optimizer,
    )


def build_model_abstractly(factory: Any) -> keras.Model:
    """Call ``factory()`` (returns a built ``keras.Model``) without initialising weights.

    The call runs in ``keras.StatelessScope(initialize_variables=False)``: Keras then
    creates each variable with its shape and dtype but defers its initializer, so no
    weight buffer is allocated (measured with Keras 3.15 / TF 2.21: a 1000 x 200000
    Dense kernel, 800 MB, leaves the process's peak RSS unchanged). Layers are still
    built (shape inference runs on symbolic ``keras.Input`` tensors); only a factory that
    computes on real values (calls the model on data, loads weights) allocates.

    The model is for counting only: its variables stay uninitialised, and reading one
    raises.

    Raises:
        ValueError: ``factory`` does not return a ``keras.Model`` with weights, or it
            reads a variable's value or creates one Keras cannot defer (``compile`` does:
            the optimizer's iteration counter).
    """
    import keras  # noqa: PLC0415 -- keeps this module free of Keras at import time

    try:
        with keras.StatelessScope(initialize_variables=False):
            model = factory()
    except ValueError as e:
        if "stateless scope" in str(e):
            first = str(e).split(". ")[0]
            raise ValueError(
                f"{getattr(factory, '__name__', factory)!r} creates or reads a variable "
                f"Keras cannot defer (Keras: {first}): build the model from keras.Input "
                "shapes only, without model.compile() (which creates the optimizer's "
                "variables) or calls on data; choose the optimizer with --optimizer"
            ) from None
        raise
    if not isinstance(model, keras.Model):
        raise ValueError(
            f"{getattr(factory, '__name__', factory)!r} returned {type(model).__name__}, "
            "expected a keras.Model"
        )
    if not model.weights:
        raise ValueError(
            f"{getattr(factory, '__name__', factory)!r} returned a model without weights: "
            "build it (give it a keras.Input) inside the function"
        )
    return model


def _param_units(units: list, stage3: bool, offload_param: str) -> list[int]:
    """Elements of the parameter term per paged unit (page rounding): each unit's own, or
    at stage 3 on the host or NVMe one flat space of every unit but the row-paged tables
    (each its own row pages)."""
    if not stage3:
        return [u.params for u in units]
    if offload_param not in ("cpu", "nvme"):
        return [u.gathered for u in units]
    tables = [u.gathered for u in units if u.table_shape]
    return [sum(u.gathered for u in units if not u.table_shape), *tables]
