"""Memory model: bytes of model states per replica on each tier (device, host, NVMe).

Source: S. Rajbhandari, J. Rasley, O. Ruwase, Y. He, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC20 (arXiv:1910.02054), section 3.1 (model states of
mixed-precision Adam) and section 5.1 / Figure 1 (memory per device for each stage).

Notation (as in the paper):

- Ψ (``num_params``): parameter count, elements.
- N_d (``num_replicas``): data-parallel degree.
- K: bytes of optimizer state per parameter (``OPTIMIZER_STATE_BYTES``).

Per replica, with p = bytes per parameter, g = bytes per gradient:

====== ==================================== ====================================
stage  formula (bytes)                      Ψ=7.5e9, N_d=64, mixed Adam (p=g=2, K=12)
====== ==================================== ====================================
0      (p + g + K) Ψ                        120 GB
1      (p + g) Ψ + K Ψ / N_d                31.4 GB
2      p Ψ + (g + K) Ψ / N_d                16.6 GB
3      (p + g + K) Ψ / N_d                  1.9 GB
====== ==================================== ====================================

(GB = 1e9 bytes, as in the paper.) A partitioned term is ``bytes_per_param *
ceil(Ψ / N_d)``: the largest shard, so the result is an integer upper bound per replica.

Precision:

- ``"mixed"``: fp16/bf16 parameters (p = 2) and gradients (g = 2); the optimizer keeps an
  fp32 master copy of the parameters, so K includes 4 bytes of master weights.
- ``"fp32"``: fp32 parameters (p = 4) and gradients (g = 4); no separate master copy.

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
('nvme'). Gradients are always counted on the device: the reduced gradient shard is
produced there, so this is an upper bound for the device tier. Activations, temporary
buffers and fragmentation are not model states and are not counted, except the stage-3
working set added by ``estimate_for_model``.

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
    "OPTIMIZER_STATE_BYTES",
    "PRECISIONS",
    "ModelEstimate",
    "TierEstimate",
    "estimate",
    "estimate_for_config",
    "estimate_for_model",
    "optimizer_kind",
]

PRECISIONS: tuple[str, ...] = ("mixed", "fp32")
"""Accepted ``precision`` values."""

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
            "optimizer_states", "persistent_params"); "working_set" has
            ``bytes_per_param`` and ``divisor`` 1 and ``elements`` the gathered elements.
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
        working_set_bytes: stage-3 bytes of gathered parameters (largest consecutive pair
            of blocks, the second capped at ``config.prefetch_bucket_size``); 0 otherwise.
    """

    tiers: TierEstimate
    num_params: int
    trainable_params: int
    largest_block_params: int
    largest_block_name: str
    persistent_params: int
    working_set_bytes: int


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


def _term(tier: str, bytes_per_param: int, elements: int, divisor: int) -> dict[str, Any]:
    return {
        "tier": tier,
        "bytes": bytes_per_param * math.ceil(elements / divisor) if elements else 0,
        "bytes_per_param": bytes_per_param,
        "elements": elements,
        "divisor": divisor,
    }


def _estimate(
    num_params: int,
    num_replicas: int,
    stage: int,
    offload_optimizer: str,
    offload_param: str,
    precision: str,
    optimizer: str,
    *,
    trainable_params: int,
    persistent_params: int = 0,
    working_set_bytes: int = 0,
) -> TierEstimate:
    """The formula of the module docstring, with the refinements ``estimate_for_model``
    knows about (trainable subset, stage-3 persistent parameters, working set)."""
    n = num_replicas
    p, g = _PARAM_BYTES[precision], _GRAD_BYTES[precision]
    k = OPTIMIZER_STATE_BYTES[optimizer][precision]
    partitioned_params = num_params - persistent_params if stage >= 3 else num_params
    breakdown = {
        "params": _term(_TIER_OF[offload_param], p, partitioned_params, n if stage >= 3 else 1),
        "grads": _term("device", g, trainable_params, n if stage >= 2 else 1),
        "optimizer_states": _term(
            _TIER_OF[offload_optimizer], k, trainable_params, n if stage >= 1 else 1
        ),
    }
    if stage >= 3 and persistent_params:
        breakdown["persistent_params"] = _term("device", p, persistent_params, 1)
    if working_set_bytes:
        breakdown["working_set"] = {
            "tier": "device",
            "bytes": working_set_bytes,
            "bytes_per_param": 1,
            "elements": working_set_bytes // p,
            "divisor": 1,
        }
    totals = dict.fromkeys(TIERS, 0)
    for term in breakdown.values():
        totals[term["tier"]] += term["bytes"]
    return TierEstimate(totals["device"], totals["host"], totals["nvme"], breakdown)


def _check_inputs(
    stage: Any, offload_optimizer: Any, offload_param: Any, precision: Any, optimizer: Any
) -> None:
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ValueError(f"stage={stage!r} is invalid: expected an int in [0, 3]")
    _check_choice("offload_optimizer", offload_optimizer, OFFLOAD_DEVICES)
    _check_choice("offload_param", offload_param, OFFLOAD_DEVICES)
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZER_STATE_BYTES)
    if offload_param != "none" and stage != 3:
        raise ZeroConfigError(
            f"offload_param={offload_param!r} is invalid with stage={stage}: parameter "
            "offload requires stage 3 (set stage=3 or offload_param='none')",
            key="offload_param",
            value=offload_param,
            accepted="'none' unless stage == 3",
        )


def estimate(
    num_params: int,
    num_replicas: int,
    stage: int = 1,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    precision: str = "mixed",
    optimizer: str = "adam",
) -> TierEstimate:
    """Bytes of model states per replica on each tier, by the ZeRO paper's formula.

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

    Returns:
        TierEstimate with integer bytes per replica; e.g. Ψ=7.5e9, N_d=64, mixed Adam:
        stage 0: 120_000_000_000; 1: 31_406_250_000; 2: 16_640_625_000;
        3: 1_875_000_000 device bytes (ZeRO paper, Figure 1).

    Raises:
        ValueError: an argument of the wrong type or out of range (ZeroConfigError, a
            ValueError, for offload_param without stage 3).
    """
    _check_positive_int("num_params", num_params)
    _check_positive_int("num_replicas", num_replicas)
    _check_inputs(stage, offload_optimizer, offload_param, precision, optimizer)
    return _estimate(
        num_params,
        num_replicas,
        stage,
        offload_optimizer,
        offload_param,
        precision,
        optimizer,
        trainable_params=num_params,
    )


def estimate_for_config(
    num_params: int,
    num_replicas: int,
    config: ZeroConfig,
    precision: str = "mixed",
    optimizer: str = "adam",
) -> TierEstimate:
    """``estimate`` with stage and offload devices taken from ``config``.

    Args:
        num_params: Ψ, elements, int >= 1.
        num_replicas: N_d, int >= 1.
        config: supplies ``stage``, ``offload_optimizer``, ``offload_param``.
        precision: 'mixed' (default) or 'fp32'.
        optimizer: see ``estimate``. Default 'adam'.

    Raises:
        ValueError: as ``estimate``.
    """
    return estimate(
        num_params,
        num_replicas,
        config.stage,
        config.offload_optimizer,
        config.offload_param,
        precision,
        optimizer,
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


def estimate_for_model(
    model: keras.Model,
    config: ZeroConfig,
    num_replicas: int,
    precision: str = "fp32",
    optimizer: str | None = None,
) -> ModelEstimate:
    """Per-replica estimate for a built Keras model, with the stage-3 working set.

    Counting (all in elements; a weight shared by several layers counts once):

    - Ψ = elements of ``model.trainable_weights`` + ``model.non_trainable_weights``.
      Gradients and optimizer states cover only the trainable weights.
    - Blocks are the top-level layers (``model.layers``), in order; a block's size is
      the elements of its weights. ``largest_block_params`` is the largest block.
    - Stage 3 only: weights with fewer elements than ``config.persistence_threshold``
      stay replicated on the device ("persistent_params", p bytes each, not divided by
      N_d); the rest is partitioned. The working set is the gathered parameters at the
      worst point of a forward pass: ``max_i(b_i + min(b_{i+1},
      config.prefetch_bucket_size)) * p`` bytes, with ``b_i`` the partitioned elements of
      block i (the gathered block plus the prefetched next block), added to the device
      tier as "working_set".

    Args:
        model: a built ``keras.Model`` (it must have weights).
        config: supplies stage, offload devices, persistence threshold and prefetch size.
        num_replicas: N_d, int >= 1.
        precision: 'fp32' (default; Keras' default float32 policy) or 'mixed'.
        optimizer: key of ``OPTIMIZER_STATE_BYTES``; None (default) infers it from
            ``model.optimizer`` with ``optimizer_kind``, or 'adam' if not compiled.

    Returns:
        ModelEstimate.

    Raises:
        ValueError: the model has no weights, invalid arguments, or an optimizer whose
            state size cannot be inferred.
    """
    _check_positive_int("num_replicas", num_replicas)
    if optimizer is None:
        compiled = getattr(model, "optimizer", None)
        optimizer = optimizer_kind(compiled) if compiled is not None else "adam"
    _check_inputs(
        config.stage, config.offload_optimizer, config.offload_param, precision, optimizer
    )

    trainable = {id(v): v for v in model.trainable_weights}
    everything = dict(trainable)
    for v in model.non_trainable_weights:
        everything.setdefault(id(v), v)
    num_params = sum(_num_elements(v) for v in everything.values())
    if num_params == 0:
        raise ValueError("model has no weights: build it (call it on an input) first")
    trainable_params = sum(_num_elements(v) for v in trainable.values())

    stage3 = config.stage >= 3
    threshold = config.persistence_threshold

    def persistent(v: Any) -> bool:
        return stage3 and _num_elements(v) < threshold

    persistent_params = sum(_num_elements(v) for v in everything.values() if persistent(v))

    largest_params, largest_name = 0, ""
    gathered: list[int] = []  # partitioned elements per block, in layer order
    seen: set[int] = set()
    for layer in model.layers:
        weights = [v for v in layer.weights if id(v) not in seen]
        seen.update(id(v) for v in weights)
        size = sum(_num_elements(v) for v in weights)
        if size > largest_params:
            largest_params, largest_name = size, layer.name
        gathered.append(sum(_num_elements(v) for v in weights if not persistent(v)))

    p = _PARAM_BYTES[precision]
    working_set = 0
    if stage3 and gathered:
        prefetch = config.prefetch_bucket_size
        pairs = [
            b + min(nxt, prefetch) for b, nxt in zip(gathered, gathered[1:] + [0], strict=True)
        ]
        working_set = max(pairs) * p

    tiers = _estimate(
        num_params,
        num_replicas,
        config.stage,
        config.offload_optimizer,
        config.offload_param,
        precision,
        optimizer,
        trainable_params=trainable_params,
        persistent_params=persistent_params,
        working_set_bytes=working_set,
    )
    return ModelEstimate(
        tiers=tiers,
        num_params=num_params,
        trainable_params=trainable_params,
        largest_block_params=largest_params,
        largest_block_name=largest_name,
        persistent_params=persistent_params,
        working_set_bytes=working_set,
    )
