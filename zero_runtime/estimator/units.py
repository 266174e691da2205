"""What ``estimate_for_model`` reads from a Keras model: the optimizer's and dtype
policy's kinds, and the units (top-level layers) with their elements, compute dtypes and
row-paged embedding tables, and the stage-3 working memory they imply.

Keras objects are matched by class name and attributes: Keras is not imported here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from zero_runtime.estimator.formulas import OPTIMIZER_STATE_BYTES


def optimizer_kind(optimizer: Any) -> str:
    """Map a Keras optimizer instance to a key of ``OPTIMIZER_STATE_BYTES``.

    Adam -> 'adam'; AdamW -> 'adamw'; SGD -> 'sgd_momentum' if its momentum is non-zero,
    else 'sgd'; RMSprop -> 'rmsprop', with '_centered' when ``centered`` and '_momentum'
    when its momentum is > 0 (one more state each); Adagrad, Adamax, Nadam, Lion, Adafactor
    -> their lower-case names. Matched by class name (the first known one in the class's MRO, so a
    subclass counts as its base) so Keras is not imported here. With ``use_ema=True`` the
    key gets ``_ema`` (one more fp32 state, the average: 'adam_ema').

    Raises:
        ValueError: another optimizer (its state size is not modelled), or Adam/AdamW with
            ``amsgrad=True`` (one more fp32 state per parameter, not modelled).
    """
    kind = _base_kind(optimizer)
    return kind + "_ema" if getattr(optimizer, "use_ema", False) else kind


def _base_kind(optimizer: Any) -> str:
    """:func:`optimizer_kind` without the ``_ema`` suffix."""
    known = (
        "Adam",
        "AdamW",
        "SGD",
        "RMSprop",
        "Adagrad",
        "Adamax",
        "Nadam",
        "Lion",
        "Adafactor",
    )
    # The first known class in the MRO: a user's subclass (that keeps the update) counts
    # as its base.
    name = next(
        (c.__name__ for c in type(optimizer).__mro__ if c.__name__ in known),
        type(optimizer).__name__,
    )
    if name in ("Adam", "AdamW"):
        if getattr(optimizer, "amsgrad", False):
            raise ValueError(
                f"{name}(amsgrad=True) keeps a third state per parameter, which the "
                "estimator does not model; pass optimizer= explicitly"
            )
        return name.lower()
    if name == "SGD":
        momentum = float(getattr(optimizer, "momentum", 0.0) or 0.0)
        return "sgd_momentum" if momentum != 0.0 else "sgd"
    if name == "RMSprop":
        momentum = float(getattr(optimizer, "momentum", 0.0) or 0.0)
        centered = "_centered" if getattr(optimizer, "centered", False) else ""
        return "rmsprop" + centered + ("_momentum" if momentum > 0.0 else "")
    if name in ("Adagrad", "Adamax", "Nadam", "Lion", "Adafactor"):
        return name.lower()
    raise ValueError(
        f"cannot infer the optimizer-state size of {name}; pass optimizer= one of "
        + ", ".join(repr(k) for k in OPTIMIZER_STATE_BYTES if not k.endswith("_ema"))
        + " (with '_ema' for use_ema=True)"
    )


def state_kind(optimizer: Any) -> str:
    """:func:`optimizer_kind`, or ``"adam"`` for an optimizer whose state size is not
    modelled (Ftrl, a user's own class, Adam with ``amsgrad``): the runtime's accounting
    and fallback size then count two fp32 states per parameter, which bounds Ftrl's two
    slots (``"adam_ema"`` with ``use_ema=True``)."""
    try:
        return optimizer_kind(optimizer)
    except ValueError:
        return "adam_ema" if getattr(optimizer, "use_ema", False) else "adam"


def _num_elements(variable: Any) -> int:
    return math.prod(int(d) for d in variable.shape)


_DTYPE_BYTES: Mapping[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def policy_precision(policy: Any) -> tuple[str, int]:
    """``(precision, compute_bytes)`` of a Keras ``DTypePolicy``.

    Keras keeps float32 variables under ``float32`` and under the mixed policies
    (``mixed_float16``, ``mixed_bfloat16``): their model states are 'fp32'; the mixed
    policies compute in a 2-byte dtype, so each layer call casts its weights (a transient
    2-byte copy, counted as working memory by ``estimate_for_model``).

    Raises:
        ValueError: a policy whose variables are not float32 (e.g. ``bfloat16``: 2-byte
            variables without an fp32 master copy are not modelled).
    """
    variable_dtype = str(getattr(policy, "variable_dtype", "float32"))
    compute_dtype = str(getattr(policy, "compute_dtype", variable_dtype))
    if variable_dtype != "float32":
        raise ValueError(
            f"dtype policy {getattr(policy, 'name', policy)!r} keeps {variable_dtype} "
            "variables, which the estimator does not model; expected float32 variables "
            "('float32', 'mixed_float16' or 'mixed_bfloat16'), or pass precision="
        )
    return "fp32", _DTYPE_BYTES.get(compute_dtype, 4)


@dataclasses.dataclass(frozen=True)
class _Unit:
    name: str
    params: int  # elements of the weights first seen in this unit
    gathered: int  # of which partitioned under stage 3 (not persistent)
    trainable: int  # of which trainable
    gathered_trainable: int
    compute_bytes: int  # bytes per element of the layer's compute dtype
    table_shape: tuple[int, int] | None = None  # a row-paged embedding's (V, C); not gathered


# The stage-3 engine's row cache of a row-paged embedding (zero_runtime/stage3/embedding.py:
# ROW_CACHE_DIVISOR, ROW_CACHE_MIN_PAGES, row_paging_budget; tests/test_estimator.py
# checks these against it: this module may not import the stage-3 layer).
_ROW_CACHE_DIVISOR = 8
_ROW_CACHE_MIN_PAGES = 2


def row_cache_bytes(shape: tuple[int, int], page_size: int, num_replicas: int) -> int:
    """Device bytes of one replica's row cache of a row-paged embedding ``(V, C)`` float32:
    ``min(P, max(2, ceil(P / 8)))`` pages, ``P`` = the row pages of its shard (``ceil(V /
    N)`` rows, ``page_size // (4 C)`` rows a page), as the stage-3 engine reserves."""
    vocab, width = int(shape[0]), int(shape[1])
    rows = -(-vocab // num_replicas)
    per_page = max(1, page_size // (4 * width))
    per_shard = -(-rows // per_page)
    cache = min(per_shard, max(_ROW_CACHE_MIN_PAGES, -(-per_shard // _ROW_CACHE_DIVISOR)))
    return cache * page_size


def _row_paged_table(layer: Any, threshold: int) -> tuple[int, int] | None:
    """``(V, C)`` if the stage-3 engine row-pages ``layer`` (a plain trainable float32
    ``keras.layers.Embedding`` with >= ``threshold`` elements, no LoRA, not quantized, no
    constraint: ``zero_runtime.stage3.embedding.row_paging_applies``), else None."""
    cls = type(layer)
    if cls.__name__ != "Embedding" or not cls.__module__.startswith("keras"):
        return None
    if not layer.trainable or getattr(layer, "lora_enabled", False):
        return None
    if getattr(layer, "quantization_mode", None) or layer.embeddings_constraint is not None:
        return None
    table = layer.embeddings
    if str(table.dtype) != "float32" or _num_elements(table) < threshold:
        return None
    return int(table.shape[0]), int(table.shape[1])


def _units(
    model: Any, persistent: Any, strict_policy: bool, row_paging_threshold: int | None = None
) -> list[_Unit]:
    """The top-level layers with their own (first-seen) weights, in order. A layer whose
    dtype policy is not modelled raises (``strict_policy``) or computes in 4 bytes. With
    ``row_paging_threshold`` (stage 3), row-paged embeddings carry their table shape."""
    trainable_ids = {id(v) for v in model.trainable_weights}
    seen: set[int] = set()
    units = []
    for layer in model.layers:
        weights = [v for v in layer.weights if id(v) not in seen]
        seen.update(id(v) for v in weights)
        size = [(v, _num_elements(v)) for v in weights]
        policy = getattr(layer, "dtype_policy", None)
        try:
            compute = policy_precision(policy)[1] if policy is not None and size else 4
        except ValueError:
            if strict_policy:
                raise
            compute = 4
        units.append(
            _Unit(
                layer.name,
                sum(n for _, n in size),
                sum(n for v, n in size if not persistent(n)),
                sum(n for v, n in size if id(v) in trainable_ids),
                sum(n for v, n in size if id(v) in trainable_ids and not persistent(n)),
                compute,
                None
                if row_paging_threshold is None
                else _row_paged_table(layer, row_paging_threshold),
            )
        )
    return units


def _working_set(
    units: list[_Unit], stage: int, accounting: str, p: int, g: int, prefetch: int
) -> int:
    """Device working memory, bytes (see ``estimate_for_model``)."""

    def cast(u: _Unit) -> int:  # a narrower compute dtype: a cast copy per layer call
        return u.compute_bytes if u.compute_bytes < p else 0

    if stage < 3:
        if accounting != "sc21":
            return 0
        return max((cast(u) * u.params for u in units), default=0)
    # A row-paged embedding is never gathered whole (its row cache is its own term).
    gathered = [0 if u.table_shape else u.gathered for u in units]
    following = gathered[1:] + [0]
    if accounting == "sc20":
        return p * max((b + min(nxt, prefetch) for b, nxt in zip(gathered, following)), default=0)
    return max(
        (
            (p + cast(u)) * b
            + g * (0 if u.table_shape else u.gathered_trainable)
            + p * min(nxt, prefetch)
            for u, b, nxt in zip(units, gathered, following)
        ),
        default=0,
    )
