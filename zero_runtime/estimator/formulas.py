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
rmsprop                   8       4      (master), mean square
rmsprop_momentum          12      8      (master), mean square, momentum
rmsprop_centered          12      8      (master), mean square, mean gradient
rmsprop_centered_momentum 16      12     (master), mean square, mean gradient, momentum
adagrad                   8       4      (master), accumulator
adamax                    12      8      (master), momentum, infinity norm
nadam                     12      8      (master), momentum, variance
lion                      8       4      (master), momentum
adafactor                 8       4      (master), velocity (its factored row and
                                         column statistics, O(rows + columns), not
                                         counted)
<kind>_ema                K + 4   K + 4  any of the above with Keras's ``use_ema=True``:
                                         its average (ZeRO partitions it as a state)
========================= ======= ====== ==============================================

SGD under mixed precision: the fp32 master copy is optimizer state for the same reason as
in the paper's Adam accounting (it exists only for the update and is partitioned with the
optimizer states in stage 1), so K = 4 (master) + 4 (momentum) = 8.

Offload: ``offload_optimizer`` moves the optimizer-state term (K, partitioned per the
stage) and ``offload_param`` moves the parameter term to the host ('cpu') or NVMe
('nvme'). Page rounding (``page_size_bytes``): terms on the host or NVMe tier live in
the paged pool, whose tensors take whole pages, so each unit's share of such a term is
rounded up to a multiple of the page size (``estimate`` treats a term as one unit).
Activations (``zero_runtime.estimator.activations``) and fragmentation are not counted
here.

This module does not import TensorFlow or Keras.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from zero_runtime.config import OFFLOAD_DEVICES, ZeroConfig, ZeroConfigError
from zero_runtime.estimator.results import TIERS, TierEstimate

PRECISIONS: tuple[str, ...] = ("mixed", "fp32")
"""Accepted ``precision`` values."""

ACCOUNTINGS: tuple[str, ...] = ("sc20", "sc21")
"""Accepted ``accounting`` values (module docstring)."""

_PARAM_BYTES: Mapping[str, int] = {"mixed": 2, "fp32": 4}  # bytes per parameter element
_GRAD_BYTES: Mapping[str, int] = {"mixed": 2, "fp32": 4}  # bytes per gradient element

#: Bytes per parameter of Keras's ``use_ema`` average (one fp32 state, every precision).
EMA_STATE_BYTES = 4

OPTIMIZER_STATE_BYTES: Mapping[str, Mapping[str, int]] = {
    "adam": {"mixed": 12, "fp32": 8},
    "adamw": {"mixed": 12, "fp32": 8},
    "sgd_momentum": {"mixed": 8, "fp32": 4},
    "sgd": {"mixed": 4, "fp32": 0},
    "rmsprop": {"mixed": 8, "fp32": 4},
    "rmsprop_momentum": {"mixed": 12, "fp32": 8},
    "rmsprop_centered": {"mixed": 12, "fp32": 8},
    "rmsprop_centered_momentum": {"mixed": 16, "fp32": 12},
    "adagrad": {"mixed": 8, "fp32": 4},
    "adamax": {"mixed": 12, "fp32": 8},
    "nadam": {"mixed": 12, "fp32": 8},
    "lion": {"mixed": 8, "fp32": 4},
    "adafactor": {"mixed": 8, "fp32": 4},
}
# Keras's ``use_ema=True``: one more fp32 state per parameter, the average (``<kind>_ema``).
OPTIMIZER_STATE_BYTES = dict(OPTIMIZER_STATE_BYTES) | {
    f"{kind}_ema": {precision: k + EMA_STATE_BYTES for precision, k in ks.items()}
    for kind, ks in OPTIMIZER_STATE_BYTES.items()
}
"""K, bytes of optimizer state per trainable parameter: optimizer -> precision -> K."""

_TIER_OF: Mapping[str, str] = {"none": "device", "cpu": "host", "nvme": "nvme"}


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
class _Choice:
    """One validated stage/offload/precision/optimizer/accounting choice (as in
    ``estimate``), with its bytes per element: ``p`` (parameter), ``g`` (gradient) and
    ``k`` (optimizer state).

    Raises:
        ValueError: a value of the wrong type or out of range (ZeroConfigError, a
            ValueError, for offload_param without stage 3).
    """

    stage: int
    offload_optimizer: str
    offload_param: str
    precision: str
    optimizer: str
    accounting: str = "sc20"

    def __post_init__(self) -> None:
        stage, offload_param = self.stage, self.offload_param
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
            raise ValueError(f"stage={stage!r} is invalid: expected an int in [0, 3]")
        _check_choice("offload_optimizer", self.offload_optimizer, OFFLOAD_DEVICES)
        _check_choice("offload_param", offload_param, OFFLOAD_DEVICES)
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZER_STATE_BYTES)
        _check_choice("accounting", self.accounting, ACCOUNTINGS)
        if offload_param != "none" and stage != 3:
            raise ZeroConfigError(
                f"offload_param={offload_param!r} is invalid with stage={stage}: parameter "
                "offload requires stage 3 (set stage=3 or offload_param='none')",
                key="offload_param",
                value=offload_param,
                accepted="'none' unless stage == 3",
            )

    @property
    def p(self) -> int:
        """Bytes per parameter element."""
        return _PARAM_BYTES[self.precision]

    @property
    def g(self) -> int:
        """Bytes per gradient element."""
        return _GRAD_BYTES[self.precision]

    @property
    def k(self) -> int:
        """K, bytes of optimizer state per trainable parameter."""
        return OPTIMIZER_STATE_BYTES[self.optimizer][self.precision]


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """Validated inputs of one estimate (elements and bytes as in ``estimate``)."""

    choice: _Choice
    num_params: int
    num_replicas: int
    trainable_params: int | None = None
    persistent_params: int = 0
    working_set_bytes: int = 0
    page_size_bytes: int | None = None
    param_units: list[int] | None = None  # partitioned elements per unit (page rounding)
    trainable_units: list[int] | None = None
    row_cache_bytes: int = 0  # stage 3: row caches of row-paged embeddings, device
    activation_bytes: int = 0  # device: activations kept for backward (activation_bytes)
    offload_ratio: float = 1.0  # host share of offloaded optimizer states (Twin-Flow)


def _estimate(i: _Inputs) -> TierEstimate:
    """The formulas of the module docstring for validated inputs."""
    c, n = i.choice, i.num_replicas
    stage, p, g = c.stage, c.p, c.g
    trainable = i.num_params if i.trainable_params is None else i.trainable_params
    partitioned_params = i.num_params - i.persistent_params if stage >= 3 else i.num_params
    opt_tier = _TIER_OF[c.offload_optimizer]
    paging = {"page_size_bytes": i.page_size_bytes}
    breakdown = {
        "params": _term(
            _TIER_OF[c.offload_param],
            p,
            partitioned_params,
            n if stage >= 3 else 1,
            units=i.param_units,
            **paging,
        ),
    }
    sc21 = c.accounting == "sc21"
    grads_offloaded = sc21 and opt_tier != "device"
    if not (grads_offloaded and stage >= 2):
        breakdown["grads"] = _term("device", g, trainable, n if stage >= 2 else 1)
    if sc21 and (grads_offloaded or c.precision == "mixed"):
        # SC21's fp32 gradient copy (mixed precision), or under offload the fp32 gradient
        # partition the host-side update reads; on the optimizer's tier, partitioned as it.
        breakdown["fp32_grads"] = _term(
            opt_tier, 4, trainable, n if stage >= 1 else 1, units=i.trainable_units, **paging
        )
    if opt_tier != "device" and i.offload_ratio < 1.0:
        # Partial offload (offload_optimizer_ratio, zero_runtime/optim/split_state.py): the
        # shard's first (1 - ratio) elements keep their states on the device.
        on_host = round(i.offload_ratio * trainable)
        divisor = n if stage >= 1 else 1
        breakdown["optimizer_states"] = _term(opt_tier, c.k, on_host, divisor, **paging)
        breakdown["optimizer_states_device"] = _term("device", c.k, trainable - on_host, divisor)
    else:
        breakdown["optimizer_states"] = _term(
            opt_tier, c.k, trainable, n if stage >= 1 else 1, units=i.trainable_units, **paging
        )
    if stage >= 3 and i.persistent_params:
        breakdown["persistent_params"] = _term("device", p, i.persistent_params, 1)
    # Byte terms on the device: bytes_per_param and divisor 1, elements = bytes.
    for name, nbytes in (
        ("row_cache", i.row_cache_bytes),
        ("activations", i.activation_bytes),
        ("working_set", i.working_set_bytes),
    ):
        if nbytes:
            breakdown[name] = _term("device", 1, nbytes, 1)
    totals = dict.fromkeys(TIERS, 0)
    for term in breakdown.values():
        totals[term["tier"]] += term["bytes"]
    return TierEstimate(totals["device"], totals["host"], totals["nvme"], breakdown)


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
    offload_ratio: float = 1.0,
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
        optimizer: a key of ``OPTIMIZER_STATE_BYTES`` ('adam', 'adamw', 'sgd_momentum',
            'sgd', 'rmsprop', 'adagrad', ...: the K table in the module docstring).
            Default 'adam'.
        accounting: 'sc20' (default: the ZeRO paper's model states; this runtime's
            layout) or 'sc21' (ZeRO-Infinity / DeepSpeed: fp32 gradient copy, gradients
            with offloaded optimizer states, stage-3 working memory).
        largest_unit_params: elements of the largest wrapping unit (DeepSpeed's
            ``largest_layer_params``), int >= 0; with 'sc21' at stage 3 it adds
            ``(p + g) * largest_unit_params`` device bytes of working memory. Default 0.
        page_size_bytes: page size of the paged pool, bytes; None (default) rounds
            nothing, else host and NVMe terms are rounded up to whole pages.
        offload_ratio: with an offloaded optimizer, the fraction of its states on the
            offload tier, float in (0, 1] (ZeroConfig ``offload_optimizer_ratio``,
            DeepSpeed's Twin-Flow ``ratio``); the rest is a device term
            ``optimizer_states_device``. Default 1.0.

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
    choice = _Choice(stage, offload_optimizer, offload_param, precision, optimizer, accounting)
    if (
        isinstance(largest_unit_params, bool)
        or not isinstance(largest_unit_params, int)
        or (not 0 <= largest_unit_params <= num_params)
    ):
        raise ValueError(
            f"largest_unit_params={largest_unit_params!r} is invalid: expected an int in "
            f"[0, num_params={num_params}]"
        )
    sc21_stage3 = accounting == "sc21" and stage >= 3
    working = (choice.p + choice.g) * largest_unit_params if sc21_stage3 else 0
    return _estimate(
        _Inputs(
            choice,
            num_params,
            num_replicas,
            working_set_bytes=working,
            page_size_bytes=_check_page(page_size_bytes),
            offload_ratio=_check_ratio(offload_ratio),
        )
    )


def _check_ratio(ratio: Any) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"offload_ratio={ratio!r} is invalid: expected a number in (0, 1]")
    return float(ratio)


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
        offload_ratio=config.offload_optimizer_ratio,
    )
