"""The estimator's results: bytes per replica on each tier, and a Keras model's counts.

Terms, tiers and units are those of :mod:`zero_runtime.estimator.formulas`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

TIERS: tuple[str, ...] = ("device", "host", "nvme")
"""The memory tiers, fastest first."""


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
