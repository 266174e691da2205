"""Every stage/offload choice (``CHOICES``, 18 of them), budgets, and the table of
estimates per choice with the smallest one that fits (``zero-runtime estimate``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zero_runtime.config import OFFLOAD_DEVICES
from zero_runtime.estimator.formulas import _check_positive_int
from zero_runtime.estimator.results import TierEstimate

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
