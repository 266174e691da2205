"""StepStats: one record of what the runtime did with memory during a step."""

from __future__ import annotations

import dataclasses
import math

from zero_runtime.telemetry.probes import Readings


@dataclasses.dataclass(frozen=True)
class TierStats:
    """One tier at the end of a step, bytes (NaN when unknown).

    Attributes:
        used_bytes: bytes in use on the tier.
        capacity_bytes: the tier's budget; NaN when unbounded.
        peak_bytes: highest use since the previous record.
        param_bytes: of used, held by parameters.
        grad_bytes: of used, held by gradients.
        optimizer_bytes: of used, held by optimizer states and master weights.
        other_bytes: of used, everything else (activations, scratch, framework).
    """

    used_bytes: float
    capacity_bytes: float = math.nan
    peak_bytes: float = math.nan
    param_bytes: float = math.nan
    grad_bytes: float = math.nan
    optimizer_bytes: float = math.nan
    other_bytes: float = math.nan

    def as_dict(self) -> dict[str, float]:
        """Column name (``tb_plugin.metadata.TIER_COLUMNS``) -> value.

        A shallow copy of the fields (all floats): ``dataclasses.asdict`` deep-copies
        each value, which the per-step writer paid for every record.
        """
        return dict(vars(self))


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one step did with memory and time.

    Attributes:
        step: the optimizer step (0-based: Keras's ``iterations`` before the update).
        wall_time: seconds since the epoch when the step ended.
        tiers: ``"device" | "host" | "nvme"`` -> :class:`TierStats`.
        readings: framework / driver / OS readings at the step's end.
        timing: ``tb_plugin.metadata.TIMING_COLUMNS`` -> seconds (ratio for
            ``overlap_ratio``); missing columns are not measured.
        pages: ``tb_plugin.metadata.PAGE_COLUMNS`` -> counts / bytes / seconds.
        config_version: version of the active configuration (0 = as started).
        collectives: ``<kind>_bytes`` / ``<kind>_calls`` per collective kind
            (``zero_runtime.telemetry.comm``); empty when no partitioned optimizer runs.
        stage: the ZeRO stage in effect.
        fallback_mirrored: True when the strategy ran as plain mirrored data parallelism.
        profiled: True when the comm/compute figures came from a profiler trace.
    """

    step: int
    wall_time: float
    tiers: dict[str, TierStats]
    readings: Readings
    timing: dict[str, float]
    pages: dict[str, float]
    config_version: int = 0
    collectives: dict[str, float] = dataclasses.field(default_factory=dict)
    stage: int = -1
    fallback_mirrored: bool = False
    profiled: bool = False

    def step_info(self) -> dict[str, float]:
        """``tb_plugin.metadata.STEP_INFO_COLUMNS`` -> value (flags as 0/1)."""
        return {
            "config_version": float(self.config_version),
            "stage": float(self.stage),
            "fallback_mirrored": float(self.fallback_mirrored),
            "profiled": float(self.profiled),
        }
