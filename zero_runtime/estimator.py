"""Memory model: bytes per replica on each tier (device, host, NVMe).

Two accountings, chosen with ``accounting=``:

``"sc20"`` -- S. Rajbhandari, J. Rasley, O. Ruwase, Y. He, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC20 (arXiv:1910.02054), section 3.1 (model
states of mixed-precision Adam: 2 + 2 + 12 = 16 bytes per parameter) and section 5.1 /
Figure 1 / Table 1 (memory per device for each stage). Model states only; gradients stay on
the device whatever the offload. This is also the layout of this runtime, which trains
float32 and keeps the reduced gradient shard on the device under offload, so the
telemetry's predicted-vs-measured figures use it.

``"sc21"`` -- S. Rajbhandari, O. Ruwase, J. Rasley, S. Smith, Y. He, "ZeRO-Infinity:
Breaking the GPU Memory Wall for Extreme Scale Deep Learning", SC21 (arXiv:2104.07857),
section 3.1 (mixed-precision Adam keeps 20 bytes per parameter: 2 fp16 parameter, 2 fp16
gradient, 4 fp32 parameter, 4 momentum, 4 variance and 4 fp32 gradient) and section 3.2
(model-state working memory: parameters and gradients of the largest operator), and
DeepSpeed's ``estimate_zero2_model_states_mem_needs``
(``deepspeed/runtime/zero/stage_1_and_2.py``) and ``estimate_zero3_model_states_mem_needs``
(``deepspeed/runtime/zero/stage3.py``). Differences from SC20:

- mixed precision adds the fp32 gradient copy (4 bytes per parameter, "fp32_grads"),
  partitioned with the optimizer states and on their tier. Float32 training has no copy
  (the gradient already is fp32): 4 + 4 + 8 = 16 bytes per parameter with Adam.
- under optimizer offload the gradient partition lives with the optimizer states (DeepSpeed
  copies each reduced bucket to the host fp32 gradient buffer): at stage >= 2 no gradient
  term stays on the device (its reduce bucket is transient); at stage 1 the device keeps
  the full low-precision gradient (stage 1 does not partition gradients) and the host
  the fp32 partition.
- stage 3 adds the working memory of the largest unit (``largest_unit_params``):
  gathered parameters plus their gradients, ``(p + g) * largest`` bytes (SC21 section 3.2;
  DeepSpeed's ``largest_layer_memory = 4 * largest_layer_params`` is the same for
  p = g = 2).

Notation (as in the papers):

- Ψ (``num_params``): parameter count, elements.
- N_d (``num_replicas``): data-parallel degree.
- K: bytes of optimizer state per parameter (``OPTIMIZER_STATE_BYTES``).

SC20 accounting per replica, with p = bytes per parameter, g = bytes per gradient:

====== ==================================== ====================================
stage  formula (bytes)                      Ψ=7.5e9, N_d=64, mixed Adam (p=g=2, K=12)
====== ==================================== ====================================
0      (p + g + K) Ψ                        120 GB
1      (p + g) Ψ + K Ψ / N_d                31.4 GB
2      p Ψ + (g + K) Ψ / N_d                16.6 GB
3      (p + g + K) Ψ / N_d                  1.9 GB
====== ==================================== ====================================

SC21 accounting, mixed Adam, no offload: stage 0 20Ψ; 1 4Ψ + 16Ψ/N_d; 2 2Ψ + 18Ψ/N_d
(= DeepSpeed's zero2 formula); 3 20Ψ/N_d + 4 L (L = largest unit; DeepSpeed: 18Ψ/N_d +
4 L, which leaves out the fp16 gradient partition).

(GB = 1e9 bytes, as in the paper.) A partitioned term is ``bytes_per_param *
ceil(Ψ / N_d)``: the largest shard, so the result is an integer upper bound per replica.

Precision:

- ``"mixed"``: fp16/bf16 parameters (p = 2) and gradients (g = 2); the optimizer keeps an
  fp32 master copy of the parameters, so K includes 4 bytes of master weights.
- ``"fp32"``: fp32 parameters (p = 4) and gradients (g = 4); no separate master copy.
  Keras' ``mixed_float16`` / ``mixed_bfloat16`` policies keep float32 variables, so their
  model states are ``"fp32"``; the 2-byte compute copy of a gathered unit is working
  memory (``estimate_for_model``).

Optimizer state K (bytes per parameter):

========================= ======= ====== ==============================================
optimizer                 mixed   fp32   what is stored (fp32, 4 bytes each)
========================= ======= ====== ==============================================
adam, adamw               12      8      (master), momentum, variance -- paper's K = 12
sgd_momentum              8       4      (master), momentum
sgd                       4       0      (master)
========================= ======= ====== ==============================================

SGD under mixed precision: the fp32 master copy is optimizer state for the same reason as
in the paper's Adam accounting (it exists only for the update and is partitioned with the
optimizer states in stage 1), so K = 4 (master) + 4 (momentum) = 8.

Offload: ``offload_optimizer`` moves the optimizer-state term (K, partitioned per the
stage) and ``offload_param`` moves the parameter term to the host ('cpu') or NVMe
('nvme'). Page rounding (``page_size_bytes``): terms on the host or NVMe tier live in
the paged pool, whose tensors take whole pages, so each unit's share of such a term is
rounded up to a multiple of the page size (``estimate`` treats a term as one unit).
Activations and fragmentation are not counted.

This module does not import TensorFlow or Keras at import time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from zero_runtime.config import OFFLOAD_DEVICES, ZeroConfig, ZeroConfigError

if TYPE_CHECKING:  # pragma: no cover
    import keras

__all__ = [
    "ACCOUNTINGS",
    "CHOICES",
    "OPTIMIZER_STATE_BYTES",
    "PRECISIONS",
    "Budgets",
    "ModelEstimate",
    "TierEstimate",
    "build_model_abstractly",
    "estimate",
    "estimate_choices",
    "estimate_for_config",
    "estimate_for_model",
    "optimizer_kind",
    "policy_precision",
    "row_cache_bytes",
    "smallest_fit",
]

PRECISIONS: tuple[str, ...] = ("mixed", "fp32")
"""Accepted ``precision`` values."""

ACCOUNTINGS: tuple[str, ...] = ("sc20", "sc21")
"""Accepted ``accounting`` values (module docstring)."""

_PARAM_BYTES: Mapping[str, int] = {"mixed": 2, "fp32": 4}  # bytes per parameter element
_GRAD_BYTES: Mapping[str, int] = {"mixed": 2, "fp32": 4}  # bytes per gradient element

OPTIMIZER_STATE_BYTES: Mapping[str, Mapping[str, int]] = {
    "adam": {"mixed": 12, "fp32": 8},
    "adamw": {"mixed": 12, "fp32": 8},
    "sgd_momentum": {"mixed": 8, "fp32": 4},
    "sgd": {"mixed": 4, "fp32": 0},
}
"""K, bytes of optimizer state per trainable parameter: optimizer -> precision -> K."""

_TIER_OF: Mapping[str, str] = {"none": "device", "cpu": "host", "nvme": "nvme"}
TIERS: tuple[str, ...] = ("device", "host", "nvme")


@dataclasses.dataclass(frozen=True)
class TierEstimate:
    """Bytes of model states per replica on each tier.

    Attributes:
        device_bytes: bytes on the device tier (GPU, or the CPU stand-in), int >= 0.
        host_bytes: bytes in host memory, int >= 0.
        nvme_bytes: bytes on the NVMe tier, int >= 0.
        breakdown: term -> ``{"tier": str, "bytes": int, "bytes_per_param": int,
            "elements": int, "divisor": int}``, where ``bytes = bytes_per_param *
            ceil(elements / divisor)`` for the state terms ("params", "grads",
            "fp32_grads", "optimizer_states", "persistent_params"; off the device with
            page rounding, the sum over units of that rounded up to pages, and the term
            has "page_size_bytes"); "working_set", "row_cache" and "activations" have
            ``bytes_per_param`` and ``divisor`` 1 and ``elements`` equal to their bytes.
            The tier totals are the sums of the terms on each tier.
    """

    device_bytes: int
    host_bytes: int
    nvme_bytes: int
    breakdown: dict[str, dict[str, Any]]

    @property
    def total_bytes(self) -> int:
        """device_bytes + host_bytes + nvme_bytes."""
        return self.device_bytes + self.host_bytes + self.nvme_bytes

    def bytes_on(self, tier: str) -> int:
        """Bytes on ``tier`` ('device', 'host' or 'nvme')."""
        if tier not in TIERS:
            raise ValueError(f"tier={tier!r} is invalid: expected one of {TIERS}")
        return getattr(self, f"{tier}_bytes")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict: the three tier totals (ints), total and breakdown."""
        return {
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "nvme_bytes": self.nvme_bytes,
            "total_bytes": self.total_bytes,
            "breakdown": {k: dict(v) for k, v in self.breakdown.items()},
        }


@dataclasses.dataclass(frozen=True)
class ModelEstimate:
    """Result of ``estimate_for_model``.

    Attributes:
        tiers: the per-replica estimate; its device tier includes the stage-3 working set.
        num_params: Ψ, elements of all trainable and non-trainable weights (shared weights
            counted once).
        trainable_params: elements of trainable weights (the ones with gradients and
            optimizer state).
        largest_block_params: elements of the largest top-level layer.
        largest_block_name: that layer's name ('' if the model has no layer with weights).
        persistent_params: elements kept replicated under stage 3 (weights with fewer
            elements than ``config.persistence_threshold``); 0 for stages < 3.
        working_set_bytes: device working memory, bytes (``estimate_for_model``); 0 if
            none.
        activation_bytes: device bytes of activations kept for backward per replica
            (``estimate_for_model`` with ``batch_shape``, :func:`activation_bytes`); 0 if
            not estimated.
        precision: the precision of the model states ('fp32' or 'mixed').
        compute_bytes: bytes per element of the narrowest compute dtype of a unit (2
            under Keras' ``mixed_float16`` / ``mixed_bfloat16``, else ``p``).
        accounting: 'sc20' or 'sc21'.
        optimizer: the key of ``OPTIMIZER_STATE_BYTES`` counted.
    """

    tiers: TierEstimate
    num_params: int
    trainable_params: int
    largest_block_params: int
    largest_block_name: str
    persistent_params: int
    working_set_bytes: int
    precision: str = "fp32"
    activation_bytes: int = 0
    compute_bytes: int = 4
    accounting: str = "sc20"
    optimizer: str = "adam"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict: the tier estimate and the counts above."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["tiers"] = self.tiers.to_dict()
        return out


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: expected an int >= 1")
    return value


def _check_choice(name: str, value: Any, choices: tuple[str, ...] | Mapping[str, Any]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"{name}={value!r} is invalid: expected one of " + ", ".join(map(repr, choices))
        )
    return value


def _round_up(n: int, page: int | None) -> int:
    return -(-n // page) * page if page else n


def _term(
    tier: str,
    bytes_per_param: int,
    elements: int,
    divisor: int,
    *,
    units: list[int] | None = None,
    page_size_bytes: int | None = None,
) -> dict[str, Any]:
    """One state term. Off the device with ``page_size_bytes``: each unit's share
    (``bytes_per_param * ceil(unit / divisor)``) rounded up to whole pages."""
    paged = page_size_bytes if tier != "device" else None
    if not elements:
        nbytes = 0
    elif paged:
        nbytes = sum(
            _round_up(bytes_per_param * math.ceil(u / divisor), paged)
            for u in (units or [elements])
            if u
        )
    else:
        nbytes = bytes_per_param * math.ceil(elements / divisor)
    term = {
        "tier": tier,
        "bytes": nbytes,
        "bytes_per_param": bytes_per_param,
        "elements": elements,
        "divisor": divisor,
    }
    if paged:
        term["page_size_bytes"] = paged
    return term


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """Validated inputs of one estimate (elements and bytes as in ``estimate``)."""

    num_params: int
    num_replicas: int
    stage: int
    offload_optimizer: str
    offload_param: str
    precision: str
    optimizer: str
    accounting: str = "sc20"
    trainable_params: int | None = None
    persistent_params: int = 0
    working_set_bytes: int = 0
    page_size_bytes: int | None = None
    param_units: list[int] | None = None  # partitioned elements per unit (page rounding)
    trainable_units: list[int] | None = None
    row_cache_bytes: int = 0  # stage 3: row caches of row-paged embeddings, device
    activation_bytes: int = 0  # device: activations kept for backward (activation_bytes)


def _estimate(i: _Inputs) -> TierEstimate:
    """The formulas of the module docstring for validated inputs."""
    n, stage = i.num_replicas, i.stage
    p, g = _PARAM_BYTES[i.precision], _GRAD_BYTES[i.precision]
    k = OPTIMIZER_STATE_BYTES[i.optimizer][i.precision]
    trainable = i.num_params if i.trainable_params is None else i.trainable_params
    partitioned_params = i.num_params - i.persistent_params if stage >= 3 else i.num_params
    opt_tier = _TIER_OF[i.offload_optimizer]
    paging = {"page_size_bytes": i.page_size_bytes}
    breakdown = {
        "params": _term(
            _TIER_OF[i.offload_param],
            p,
            partitioned_params,
            n if stage >= 3 else 1,
            units=i.param_units,
            **paging,
        ),
    }
    sc21 = i.accounting == "sc21"
    grads_offloaded = sc21 and opt_tier != "device"
    if not (grads_offloaded and stage >= 2):
        breakdown["grads"] = _term("device", g, trainable, n if stage >= 2 else 1)
    if sc21 and (grads_offloaded or i.precision == "mixed"):
        # SC21's fp32 gradient copy (mixed precision), or under offload the fp32 gradient
        # partition the host-side update reads; on the optimizer's tier, partitioned as it.
        breakdown["fp32_grads"] = _term(
            opt_tier, 4, trainable, n if stage >= 1 else 1, units=i.trainable_units, **paging
        )
    breakdown["optimizer_states"] = _term(
        opt_tier, k, trainable, n if stage >= 1 else 1, units=i.trainable_units, **paging
    )
    if stage >= 3 and i.persistent_params:
        breakdown["persistent_params"] = _term("device", p, i.persistent_params, 1)
    if i.row_cache_bytes:
        breakdown["row_cache"] = {
            "tier": "device",
            "bytes": i.row_cache_bytes,
            "bytes_per_param": 1,
            "elements": i.row_cache_bytes,
            "divisor": 1,
        }
    if i.activation_bytes:
        breakdown["activations"] = {
            "tier": "device",
            "bytes": i.activation_bytes,
            "bytes_per_param": 1,
            "elements": i.activation_bytes,
            "divisor": 1,
        }
    if i.working_set_bytes:
        breakdown["working_set"] = {
            "tier": "device",
            "bytes": i.working_set_bytes,
            "bytes_per_param": 1,
            "elements": i.working_set_bytes,
            "divisor": 1,
        }
    totals = dict.fromkeys(TIERS, 0)
    for term in breakdown.values():
        totals[term["tier"]] += term["bytes"]
    return TierEstimate(totals["device"], totals["host"], totals["nvme"], breakdown)


def _check_inputs(
    stage: Any,
    offload_optimizer: Any,
    offload_param: Any,
    precision: Any,
    optimizer: Any,
    accounting: Any = "sc20",
) -> None:
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ValueError(f"stage={stage!r} is invalid: expected an int in [0, 3]")
    _check_choice("offload_optimizer", offload_optimizer, OFFLOAD_DEVICES)
    _check_choice("offload_param", offload_param, OFFLOAD_DEVICES)
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZER_STATE_BYTES)
    _check_choice("accounting", accounting, ACCOUNTINGS)
    if offload_param != "none" and stage != 3:
        raise ZeroConfigError(
            f"offload_param={offload_param!r} is invalid with stage={stage}: parameter "
            "offload requires stage 3 (set stage=3 or offload_param='none')",
            key="offload_param",
            value=offload_param,
            accepted="'none' unless stage == 3",
        )


def _check_page(page_size_bytes: Any) -> int | None:
    if page_size_bytes is None:
        return None
    return _check_positive_int("page_size_bytes", page_size_bytes)


def estimate(
    num_params: int,
    num_replicas: int,
    stage: int = 1,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    precision: str = "mixed",
    optimizer: str = "adam",
    *,
    accounting: str = "sc20",
    largest_unit_params: int = 0,
    page_size_bytes: int | None = None,
) -> TierEstimate:
    """Bytes per replica on each tier, by the SC20 or SC21 accounting (module docstring).

    Args:
        num_params: Ψ, parameter count (elements), int >= 1.
        num_replicas: N_d, data-parallel degree, int >= 1.
        stage: ZeRO stage, int in [0, 3]. Default 1.
        offload_optimizer: 'none' | 'cpu' | 'nvme': tier of the optimizer-state term.
            Default 'none' (the paper's setting; note ZeroConfig's default is 'cpu').
        offload_param: 'none' | 'cpu' | 'nvme': tier of the parameter term; 'cpu'/'nvme'
            need stage 3. Default 'none'.
        precision: 'mixed' (2-byte params and grads, fp32 master in K) or 'fp32'.
            Default 'mixed'.
        optimizer: 'adam' | 'adamw' | 'sgd_momentum' | 'sgd' (K table in the module
            docstring). Default 'adam'.
        accounting: 'sc20' (default: the ZeRO paper's model states; this runtime's
            layout) or 'sc21' (ZeRO-Infinity / DeepSpeed: fp32 gradient copy, gradients
            with offloaded optimizer states, stage-3 working memory).
        largest_unit_params: elements of the largest wrapping unit (DeepSpeed's
            ``largest_layer_params``), int >= 0; with 'sc21' at stage 3 it adds
            ``(p + g) * largest_unit_params`` device bytes of working memory. Default 0.
        page_size_bytes: page size of the paged pool, bytes; None (default) rounds
            nothing, else host and NVMe terms are rounded up to whole pages.

    Returns:
        TierEstimate with integer bytes per replica; e.g. Ψ=7.5e9, N_d=64, mixed Adam,
        'sc20': stage 0: 120_000_000_000; 1: 31_406_250_000; 2: 16_640_625_000;
        3: 1_875_000_000 device bytes (ZeRO paper, Figure 1).

    Raises:
        ValueError: an argument of the wrong type or out of range (ZeroConfigError, a
            ValueError, for offload_param without stage 3).
    """
    _check_positive_int("num_params", num_params)
    _check_positive_int("num_replicas", num_replicas)
    _check_inputs(stage, offload_optimizer, offload_param, precision, optimizer, accounting)
    if (
        isinstance(largest_unit_params, bool)
        or not isinstance(largest_unit_params, int)
        or (not 0 <= largest_unit_params <= num_params)
    ):
        raise ValueError(
            f"largest_unit_params={largest_unit_params!r} is invalid: expected an int in "
            f"[0, num_params={num_params}]"
        )
    p, g = _PARAM_BYTES[precision], _GRAD_BYTES[precision]
    working = (p + g) * largest_unit_params if accounting == "sc21" and stage >= 3 else 0
    return _estimate(
        _Inputs(
            num_params,
            num_replicas,
            stage,
            offload_optimizer,
            offload_param,
            precision,
            optimizer,
            accounting=accounting,
            working_set_bytes=working,
            page_size_bytes=_check_page(page_size_bytes),
        )
    )


def estimate_for_config(
    num_params: int,
    num_replicas: int,
    config: ZeroConfig,
    precision: str = "mixed",
    optimizer: str = "adam",
    *,
    accounting: str = "sc20",
    largest_unit_params: int = 0,
    page_rounding: bool = False,
) -> TierEstimate:
    """``estimate`` with stage and offload devices taken from ``config``.

    Args:
        num_params: Ψ, elements, int >= 1.
        num_replicas: N_d, int >= 1.
        config: supplies ``stage``, ``offload_optimizer``, ``offload_param`` and, with
            ``page_rounding``, ``page_size_bytes``. At stage 0 ``offload_optimizer`` is
            ignored (taken as 'none'), as the runtime does (docs/config.md): plain data
            parallelism keeps the optimizer states on every replica's device.
        precision: 'mixed' (default) or 'fp32'.
        optimizer: see ``estimate``. Default 'adam'.
        accounting: 'sc20' (default) or 'sc21', see ``estimate``.
        largest_unit_params: see ``estimate``. Default 0.
        page_rounding: round host/NVMe terms to ``config.page_size_bytes``. Default False.

    Raises:
        ValueError: as ``estimate``.
    """
    return estimate(
        num_params,
        num_replicas,
        config.stage,
        "none" if config.stage == 0 else config.offload_optimizer,
        config.offload_param,
        precision,
        optimizer,
        accounting=accounting,
        largest_unit_params=largest_unit_params,
        page_size_bytes=config.page_size_bytes if page_rounding else None,
    )


def optimizer_kind(optimizer: Any) -> str:
    """Map a Keras optimizer instance to a key of ``OPTIMIZER_STATE_BYTES``.

    Adam -> 'adam'; AdamW -> 'adamw'; SGD -> 'sgd_momentum' if its momentum is non-zero,
    else 'sgd'. Matched by class name so Keras is not imported here.

    Raises:
        ValueError: another optimizer (its state size is not modelled), or Adam/AdamW with
            ``amsgrad=True`` (one more fp32 state per parameter, not modelled).
    """
    name = type(optimizer).__name__
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
    raise ValueError(
        f"cannot infer the optimizer-state size of {name}; pass optimizer= one of "
        + ", ".join(map(repr, OPTIMIZER_STATE_BYTES))
    )


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
      per unit (each unit's shard is at least one page in the paged pool).
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
    _check_inputs(
        stage,
        offload_optimizer,
        offload_param,
        precision,
        optimizer,
        accounting,
    )

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
        units = [dataclasses.replace(u, compute_bytes=_PARAM_BYTES[precision]) for u in units]
    compute = min((u.compute_bytes for u in units if u.params), default=4)
    largest = max(units, key=lambda u: u.params, default=None)
    largest_params, largest_name = (largest.params, largest.name) if largest else (0, "")
    if largest_params == 0:
        largest_name = ""

    p, g = _PARAM_BYTES[precision], _GRAD_BYTES[precision]
    working_set = _working_set(units, stage, accounting, p, g, config.prefetch_bucket_size)
    activations = 0
    if batch_shape is not None:
        activations = activation_bytes(model, batch_shape, loss=loss, checkpoint_units=stage >= 3)
    tiers = _estimate(
        _Inputs(
            num_params,
            num_replicas,
            stage,
            offload_optimizer,
            offload_param,
            precision,
            optimizer,
            accounting=accounting,
            trainable_params=trainable_params,
            persistent_params=persistent_params,
            working_set_bytes=working_set,
            page_size_bytes=config.page_size_bytes if page_rounding else None,
            param_units=[u.gathered if stage3 else u.params for u in units],
            trainable_units=[u.trainable for u in units],
            row_cache_bytes=sum(
                row_cache_bytes(u.table_shape, config.page_size_bytes, num_replicas)
                for u in units
                if u.table_shape
            ),
            activation_bytes=activations,
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


# --------------------------------------------------------------------------------------
# Activations: the tensors the forward pass keeps for the backward pass
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


# --------------------------------------------------------------------------------------
# Every stage/offload choice, and the smallest one that fits
# --------------------------------------------------------------------------------------

_OFFLOAD_RANK: Mapping[str, int] = {"none": 0, "cpu": 1, "nvme": 2}

CHOICES: tuple[tuple[int, str, str], ...] = tuple(
    sorted(
        (
            (stage, opt, param)
            for stage in range(4)
            for opt in OFFLOAD_DEVICES
            for param in OFFLOAD_DEVICES
            if param == "none" or stage == 3
        ),
        key=lambda c: (_OFFLOAD_RANK[c[2]], _OFFLOAD_RANK[c[1]], c[0]),
    )
)
"""Every valid ``(stage, offload_optimizer, offload_param)``, smallest first: least
parameter offload, then least optimizer offload, then lowest stage (offload costs
bandwidth, partitioning costs collectives: a higher stage is preferred to an offload)."""


@dataclasses.dataclass(frozen=True)
class Budgets:
    """Memory available, bytes; None means unlimited.

    Attributes:
        device_bytes: per device (one replica), int >= 1 or None.
        host_bytes: per process (shared by ``local_replicas`` replicas), or None.
        nvme_bytes: per process, or None.
        local_replicas: replicas per process, int >= 1 (default 1).
    """

    device_bytes: int | None = None
    host_bytes: int | None = None
    nvme_bytes: int | None = None
    local_replicas: int = 1

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "nvme_bytes"):
            value = getattr(self, name)
            if value is not None:
                _check_positive_int(name, value)
        _check_positive_int("local_replicas", self.local_replicas)

    def shortfall(self, tiers: TierEstimate) -> dict[str, int]:
        """Tier -> bytes missing (> 0) for ``tiers`` (a per-replica estimate); empty if it
        fits. Host and NVMe needs are ``local_replicas`` times the per-replica bytes."""
        needs = {
            "device": (tiers.device_bytes, self.device_bytes),
            "host": (tiers.host_bytes * self.local_replicas, self.host_bytes),
            "nvme": (tiers.nvme_bytes * self.local_replicas, self.nvme_bytes),
        }
        return {
            tier: need - budget
            for tier, (need, budget) in needs.items()
            if budget is not None and need > budget
        }


def estimate_choices(estimate_one: Any, budgets: Budgets | None = None) -> list[dict[str, Any]]:
    """Run ``estimate_one(stage, offload_optimizer, offload_param) -> TierEstimate`` for
    every entry of ``CHOICES`` (smallest first).

    Returns:
        One dict per choice: ``stage``, ``offload_optimizer``, ``offload_param``,
        ``device_bytes``, ``host_bytes``, ``nvme_bytes`` (per replica), ``shortfall``
        (tier -> missing bytes, see ``Budgets.shortfall``; empty without budgets) and
        ``fits`` (bool).
    """
    budgets = budgets or Budgets()
    rows = []
    for stage, opt, param in CHOICES:
        tiers = estimate_one(stage, opt, param)
        short = budgets.shortfall(tiers)
        rows.append(
            {
                "stage": stage,
                "offload_optimizer": opt,
                "offload_param": param,
                "device_bytes": tiers.device_bytes,
                "host_bytes": tiers.host_bytes,
                "nvme_bytes": tiers.nvme_bytes,
                "shortfall": short,
                "fits": not short,
            }
        )
    return rows


def smallest_fit(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first row of ``estimate_choices`` that fits, or None."""
    return next((row for row in rows if row["fits"]), None)


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
