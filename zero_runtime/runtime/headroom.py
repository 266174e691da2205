"""Holding headroom: ``device_budget_bytes='auto'``.

The runtime adjusts its own device budget so that the *measured* in-step peak of the
device's allocator stays ``headroom_fraction`` below the device's real capacity:

- capacity: the allocator's limit (:func:`device_capacity_bytes`): on a GPU the device's
  total memory from NVML (``nvmlDeviceGetMemoryInfo().total``, GPU 0); on the CPU
  stand-in the BFC allocator's cap ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` when set (the stand-in
  has no other limit; without it ``'auto'`` is refused, naming the variable);
- measured peak: ``Readings.framework_device_peak_bytes``, the allocator's peak in-use
  bytes during the step (the collector resets it after every record);
- target: ``capacity * (1 - headroom_fraction)``.

The controller starts the budget at the target and then, from the second step on (the
first traces), decides at step boundaries:

- **near an OOM** (a step's peak above ``capacity * (1 - headroom_fraction / 2)``): at
  once, the budget shrinks by 1.5 times the overshoot over the target divided by the
  gain (below), plus the recent peaks' spread, and prefetch (``prefetch_bucket_size``)
  is halved, so fewer pages are brought ahead of use;
- **over the target** (a step's peak above it): at once, the budget shrinks by the
  overshoot divided by the gain plus the spread (max - min) of the last ``interval``
  steps' peaks, rounded up to pages. The gain (``HeadroomController.gain``) is the
  measured fraction of a budget change that shows in the peak (``DEFAULT_GAIN`` = 0.5,
  i.e. twice the overshoot, until two budgets are measured); the spread is there because
  the peak moves from step to step with the same budget;
- **a tail too close** (from ``TAIL_SAMPLES`` peaks at the current budget on): the reach
  of the last ``interval`` peaks, their largest plus their spread (max - min), is over
  the target. The peak's tail is long (measured on the CPU stand-in: peaks of
  11.1-11.8 MiB, then one of 13.8 MiB), so a budget that only reacts to steps over the
  target leaves too many of them over: the budget shrinks by the reach's overshoot
  divided by the gain, rounded up to pages, before a step goes over;
- **well under** (the largest peak of the last ``interval`` steps below
  ``capacity * (1 - 2 * headroom_fraction)``): the budget grows by half the slack, rounded
  down to pages, never past the target.

The budget never goes below ``MIN_PAGES`` pages, nor below the pool's working set when
one is known (:meth:`HeadroomController.raise_floor`: a stage-3 engine's gathered
buffers). When it is there and the peak is still over the target, the memory outside the
pool (activations, framework buffers) alone exceeds it: the controller says so once and
stops shrinking. ``max_reuse_distance`` and ``persistence_threshold`` take effect only
when stage 3's plan is rebuilt (``TUNABLE_KEYS``), so the controller does not change
them. Every decision is applied as a live-tuning change (``ControlChannel.apply_auto``),
recorded as a config event with ``source: "auto"`` and its reason, and shown in the tab
like a manual change. A manual change of ``device_budget_bytes`` in the tab turns the
controller off.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
from typing import Any

from zero_runtime.config import TUNABLE_KEYS, ZeroConfig, ZeroConfigError
from zero_runtime.devices import DeviceInfo

log = logging.getLogger(__name__)

#: Smallest budget the controller sets, in pages.
MIN_PAGES = 2
#: Steps the peak must stay well under the target before the budget grows (shrinking is
#: decided at once, on the step that went over).
INTERVAL_STEPS = 5
#: Peaks at the current budget the tail guard needs before it judges their reach.
TAIL_SAMPLES = 3
#: Fraction of a budget change assumed to show in the peak until it is measured, and the
#: smallest measured fraction the controller believes (see ``HeadroomController.gain``).
DEFAULT_GAIN = 0.5
MIN_GAIN = 0.2
CPU_LIMIT_ENV = "TF_CPU_BFC_MEM_LIMIT_IN_MB"


def device_capacity_bytes(device: DeviceInfo) -> int | None:
    """The device's real capacity, bytes, or None when it cannot be known.

    GPU: NVML's total memory of GPU 0 (``pynvml``, package nvidia-ml-py). CPU stand-in:
    ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` (MiB; TensorFlow's BFC CPU allocator refuses
    allocations past it) when set to a positive integer.
    """
    if not device.is_standin:
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                return int(
                    pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
                )
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - no NVML: capacity unknown
            return None
    raw = os.environ.get(CPU_LIMIT_ENV, "").strip()
    if raw.isdigit() and int(raw) > 0:
        return int(raw) << 20
    return None


def resolve_auto(
    config: ZeroConfig, device: DeviceInfo
) -> tuple[ZeroConfig, HeadroomController | None]:
    """Resolve ``device_budget_bytes='auto'`` to the starting budget and its controller.

    Returns:
        ``(config, None)`` unchanged when the budget is not 'auto'; else the config with
        ``device_budget_bytes`` = the target (``capacity * (1 - headroom_fraction)``,
        rounded down to pages) and the controller.

    Raises:
        ZeroConfigError: 'auto' where the capacity is unknown (no NVML on a GPU host; on a
            CPU-only host ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` unset), or a capacity below
            ``MIN_PAGES`` pages after the headroom.
    """
    if config.device_budget_bytes != "auto":
        return config, None
    capacity = device_capacity_bytes(device)
    if capacity is None:
        where = (
            f"set {CPU_LIMIT_ENV} (MiB) before starting: the CPU stand-in's only limit"
            if device.is_standin
            else "NVML (nvidia-ml-py) could not read the GPU's memory"
        )
        raise ZeroConfigError(
            f"device_budget_bytes='auto' needs the device's capacity, which is unknown: {where}",
            key="device_budget_bytes",
            value="auto",
            accepted="an int >= page_size_bytes, None, or 'auto' where the capacity is known",
        )
    controller = HeadroomController(capacity, config.headroom_fraction, config.page_size_bytes)
    return dataclasses.replace(config, device_budget_bytes=controller.budget), controller


class HeadroomState(enum.Enum):
    """``WARMING_UP`` (the first, traced step: no decision), ``HOLDING`` (deciding),
    ``FLOOR`` (the budget is at its minimum and the peak still over the target: memory
    outside the pool exceeds it; no more shrinking), ``OFF`` (a manual change took over)."""

    WARMING_UP = "warming_up"
    HOLDING = "holding"
    FLOOR = "floor"
    OFF = "off"


@dataclasses.dataclass(frozen=True)
class HeadroomDecision:
    """One decision: ``updates`` (tunable key -> new value; may be empty when the decision
    only reports) and ``reason`` (one sentence with the figures, bytes)."""

    updates: dict[str, Any]
    reason: str


class HeadroomController:
    """Keeps the measured in-step device peak ``headroom_fraction`` below ``capacity``.

    Args:
        capacity_bytes: the device's real capacity, bytes (:func:`device_capacity_bytes`).
        headroom_fraction: fraction of the capacity to keep free, float in (0, 0.9].
        page_size_bytes: the pool's page size; budgets move in whole pages.
        interval_steps: steps over which the peak must stay well under the target before
            the budget grows (default ``INTERVAL_STEPS``).

    Attributes:
        budget: the device budget now, bytes.
        state: the :class:`HeadroomState`.
        target_bytes: ``capacity * (1 - headroom_fraction)``.
    """

    def __init__(
        self,
        capacity_bytes: int,
        headroom_fraction: float,
        page_size_bytes: int,
        interval_steps: int = INTERVAL_STEPS,
    ) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.headroom_fraction = float(headroom_fraction)
        self.page = int(page_size_bytes)
        self.interval = int(interval_steps)
        self.target_bytes = int(self.capacity_bytes * (1.0 - self.headroom_fraction))
        self.near_oom_bytes = int(self.capacity_bytes * (1.0 - self.headroom_fraction / 2))
        self.low_bytes = int(self.capacity_bytes * (1.0 - 2 * self.headroom_fraction))
        self.min_budget = MIN_PAGES * self.page
        if self.target_bytes // self.page * self.page < self.min_budget:
            raise ZeroConfigError(
                f"device_budget_bytes='auto': the capacity {self.capacity_bytes} bytes less "
                f"a headroom of {self.headroom_fraction} leaves under {MIN_PAGES} pages of "
                f"{self.page} bytes",
                key="device_budget_bytes",
                value="auto",
                accepted="a capacity of at least MIN_PAGES pages after the headroom",
            )
        self.budget = self.target_bytes // self.page * self.page
        self.state = HeadroomState.WARMING_UP
        self._window: list[float] = []
        self._level: list[float] = []  # peaks at the current budget
        self._levels: list[tuple[int, float]] = []  # (budget, mean peak) of past budgets

    def raise_floor(self, floor_bytes: int) -> None:
        """Never set a budget below ``floor_bytes`` (rounded up to pages): the pool's
        working set, e.g. a stage-3 engine's gathered buffers of its two largest blocks
        (``Stage3Engine.min_device_budget``). Below it the next
        gather cannot place its pages (a ``PoolOutOfMemoryError``, not a lower peak)."""
        pages = -(-int(floor_bytes) // self.page)
        self.min_budget = max(self.min_budget, pages * self.page)

    def describe(self) -> dict[str, Any]:
        """The controller's settings and state, for ``run_info`` (bytes)."""
        return {
            "mode": "auto",
            "capacity_bytes": self.capacity_bytes,
            "headroom_fraction": self.headroom_fraction,
            "target_peak_bytes": self.target_bytes,
            "budget_bytes": self.budget,
            "state": self.state.value,
        }

    def turn_off(self) -> None:
        """A manual change of the budget took over: no more decisions."""
        self.state = HeadroomState.OFF

    def observe(self, step: int, peak_bytes: float, config: ZeroConfig) -> HeadroomDecision | None:
        """Take one step's measured peak; return a decision to apply before the next step.

        Args:
            step: the step that ended.
            peak_bytes: its allocator peak in-use bytes (NaN when unmeasured: ignored).
            config: the config in effect (its ``prefetch_bucket_size`` is halved near OOM).
        """
        if self.state is HeadroomState.OFF or math.isnan(peak_bytes):
            return None
        if self.state is HeadroomState.WARMING_UP:
            self.state = HeadroomState.HOLDING  # the first step traces: its peak is not typical
            return None
        self._window.append(float(peak_bytes))
        self._level.append(float(peak_bytes))
        if peak_bytes > self.near_oom_bytes:
            return self._shrink(peak_bytes, 3, config, near_oom=True)
        if peak_bytes > self.target_bytes:
            return self._shrink(peak_bytes, 2, config, near_oom=False)
        recent = self._window[-self.interval :]
        if len(recent) >= TAIL_SAMPLES and self.state is HeadroomState.HOLDING:
            reach = max(recent) + (max(recent) - min(recent))
            if reach > self.target_bytes:
                return self._shrink(reach, 2, config, near_oom=False, tail=True)
        if len(self._window) < self.interval:
            return None
        peak = max(self._window)
        self._window.clear()
        if peak < self.low_bytes and self.state is HeadroomState.HOLDING:
            grow = (self.target_bytes - peak) / 2 // self.page * self.page
            new = int(min(self.budget + grow, self.target_bytes // self.page * self.page))
            if new > self.budget:
                old = self.budget
                self._set_budget(new)
                return HeadroomDecision(
                    {"device_budget_bytes": new},
                    f"in-step peak {int(peak)} B over the last {self.interval} steps is under "
                    f"{self.low_bytes} B (capacity {self.capacity_bytes} B less twice the "
                    f"headroom): budget {old} -> {new} B",
                )
        return None

    def gain(self) -> float:
        """How much of a budget change shows in the peak: the change of the mean peak over
        the change of the budget between the last two budgets with at least two peaks
        each, clipped to ``[MIN_GAIN, 1]``; ``DEFAULT_GAIN`` until two are known.

        Measured on the CPU stand-in (tests/helpers/headroom_job.py): budgets of 5.75 and
        2 MiB gave mean peaks of 10.97 and 10.18 MiB, a gain of 0.21: most of the peak is
        memory outside the pool. A cut is the overshoot divided by the gain, so the budget
        gets under the target in one or two decisions rather than five.
        """
        if len(self._levels) < 2:
            return DEFAULT_GAIN
        (b0, p0), (b1, p1) = self._levels[-2:]
        if b0 == b1:
            return DEFAULT_GAIN
        return min(1.0, max(MIN_GAIN, (p0 - p1) / (b0 - b1)))

    def _set_budget(self, new: int) -> None:
        if len(self._level) >= 2:
            self._levels.append((self.budget, sum(self._level) / len(self._level)))
        self._level.clear()
        self.budget = new

    def _shrink(
        self, peak: float, factor: int, config: ZeroConfig, near_oom: bool, tail: bool = False
    ) -> HeadroomDecision | None:
        # The step-to-step spread of the recent peaks is margin the budget must leave too:
        # the allocator's peak moves by about a tenth of itself from step to step with the
        # same budget (measured on the CPU stand-in), and only part of a budget cut shows
        # in the peak (the pool does not always fill its budget).
        recent = self._window[-self.interval :]
        spread = max(recent) - min(recent) if len(recent) > 1 and not tail else 0.0
        self._window.clear()
        over = peak - self.target_bytes
        cut = math.ceil((factor / 2 * over / self.gain() + spread) / self.page) * self.page
        new = max(self.min_budget, self.budget - cut)
        updates: dict[str, Any] = {}
        what = "near an OOM" if near_oom else "over the target"
        subject = f"in-step peak {int(peak)} B is {what}"
        if tail:
            subject = (
                f"in-step peaks reach {int(peak)} B (the largest of the last steps plus "
                "their spread), over the target"
            )
        if new < self.budget:
            updates["device_budget_bytes"] = new
        prefetch = TUNABLE_KEYS["prefetch_bucket_size"]
        if near_oom and config.prefetch_bucket_size > 0 and prefetch.acts_in(config.to_dict()):
            updates["prefetch_bucket_size"] = config.prefetch_bucket_size // 2
        if not updates or new == self.min_budget and self.budget == self.min_budget:
            if self.state is HeadroomState.FLOOR:
                return None
            self.state = HeadroomState.FLOOR
            return HeadroomDecision(
                updates,
                f"{subject} ({self.target_bytes} B) with the budget "
                f"at its floor of {self.min_budget} B: memory outside the pool (activations, "
                "framework buffers) exceeds the target; lower the batch or the model's width",
            )
        old = self.budget
        self._set_budget(new)
        return HeadroomDecision(
            updates,
            f"{subject} ({self.target_bytes} B = capacity "
            f"{self.capacity_bytes} B less {self.headroom_fraction:.0%}): budget {old} -> {new} B"
            + (", prefetch halved" if "prefetch_bucket_size" in updates else ""),
        )
