"""``device_budget_bytes='auto'``: the runtime holds its own device headroom
(zero_runtime/runtime/headroom.py).

The controller's rules on recorded peaks, ``'auto'``'s resolution against the device's
capacity, and an end-to-end run (tests/helpers/headroom_job.py: a stage-3 model with a
row-paged embedding table whose row pages the device tier caches, NVMe offload, in a
fresh process whose BFC allocator is capped) that must finish with no OOM and its
measured in-step peak within the headroom on >= 95% of steps after warm-up (measured
98%).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero_runtime.config import ZeroConfig, ZeroConfigError
from zero_runtime.devices import DeviceInfo
from zero_runtime.runtime.headroom import (
    CPU_LIMIT_ENV,
    HeadroomController,
    HeadroomState,
    resolve_auto,
)

MIB = 1 << 20
PAGE = 64 << 10
STANDIN = DeviceInfo(("/cpu:0", "/cpu:1"), True, "device (CPU stand-in)")
NVME3 = ZeroConfig(stage=3, offload_param="nvme", nvme_path="/tmp", page_size_bytes=PAGE)


def _controller(**kw) -> HeadroomController:
    # capacity 100 MiB, headroom 10%: target 90 MiB, near-OOM 95 MiB, low 80 MiB
    return HeadroomController(100 * MIB, 0.1, PAGE, **kw)


def test_budget_starts_at_the_target_rounded_down_to_pages():
    c = _controller()
    assert c.target_bytes == int(100 * MIB * 0.9)
    assert c.budget == c.target_bytes // PAGE * PAGE
    assert c.state is HeadroomState.WARMING_UP


def test_first_step_and_unmeasured_steps_decide_nothing():
    c = _controller(interval_steps=2)
    assert c.observe(0, 99 * MIB, NVME3) is None  # traced step: ignored even near OOM
    assert c.state is HeadroomState.HOLDING
    assert c.observe(1, math.nan, NVME3) is None
    assert c.observe(2, 50 * MIB, NVME3) is None  # window of 1 < interval


def test_near_oom_shrinks_at_once_by_three_times_the_overshoot_and_halves_prefetch():
    c = _controller()
    c.observe(0, 0, NVME3)
    budget = c.budget
    d = c.observe(1, 96 * MIB, NVME3)
    assert d is not None
    cut = math.ceil(3 * (96 * MIB - c.target_bytes) / PAGE) * PAGE  # one peak: no spread
    assert d.updates == {
        "device_budget_bytes": budget - cut,
        "prefetch_bucket_size": NVME3.prefetch_bucket_size // 2,
    }
    assert c.budget == budget - cut
    assert "near an OOM" in d.reason and "prefetch halved" in d.reason


def test_prefetch_is_left_alone_where_it_does_not_act():
    c = _controller()
    c.observe(0, 0, ZeroConfig())
    d = c.observe(1, 96 * MIB, ZeroConfig())  # stage 1: prefetch acts only at stage 3 + NVMe
    assert set(d.updates) == {"device_budget_bytes"}


def test_over_the_target_shrinks_at_once_and_growth_waits_for_a_quiet_window():
    c = _controller(interval_steps=3)
    c.observe(0, 0, NVME3)
    budget = c.budget
    assert c.observe(1, 85 * MIB, NVME3) is None
    d = c.observe(2, 92 * MIB, NVME3)
    spread = 92 * MIB - 85 * MIB  # of the recent peaks
    cut = math.ceil((2 * (92 * MIB - c.target_bytes) + spread) / PAGE) * PAGE
    assert d.updates == {"device_budget_bytes": budget - cut}
    assert "over the target" in d.reason
    # well under for a whole window: grows by half the slack, never past the target
    for s in (3, 4):
        assert c.observe(s, 40 * MIB, NVME3) is None
    d = c.observe(5, 40 * MIB, NVME3)
    grow = (c.target_bytes - 40 * MIB) / 2 // PAGE * PAGE
    top = c.target_bytes // PAGE * PAGE
    assert d.updates == {"device_budget_bytes": min(budget - cut + grow, top)}
    # a window with one step above the low mark does not grow it
    for s, peak in ((6, 79 * MIB), (7, 84 * MIB), (8, 79 * MIB), (9, 79 * MIB)):
        assert c.observe(s, peak, NVME3) is None


def test_a_long_tail_shrinks_the_budget_before_a_step_goes_over():
    c = _controller(interval_steps=5)
    c.observe(0, 0, NVME3)
    budget = c.budget
    assert c.observe(1, 86 * MIB, NVME3) is None  # one or two peaks: no judgement yet
    assert c.observe(2, 83 * MIB, NVME3) is None
    d = c.observe(3, 84 * MIB, NVME3)  # reach 86 + (86 - 83) = 89 MiB: under 90
    assert d is None
    d = c.observe(4, 81 * MIB, NVME3)  # reach 86 + (86 - 81) = 91 MiB: over 90
    reach = 86 * MIB + 5 * MIB
    assert reach > c.target_bytes
    cut = math.ceil(2 * (reach - c.target_bytes) / PAGE) * PAGE
    assert d.updates == {"device_budget_bytes": budget - cut}
    assert "reach" in d.reason and "over the target" in d.reason
    # the window starts again at the new budget: three calm peaks decide nothing
    for s in (5, 6, 7):
        assert c.observe(s, 84 * MIB, NVME3) is None


def test_a_floor_is_reported_once_and_a_manual_change_turns_it_off():
    c = HeadroomController(10 * MIB, 0.5, PAGE, interval_steps=1)
    c.observe(0, 0, ZeroConfig())
    d = c.observe(1, 9 * MIB, ZeroConfig())  # near OOM: down to the floor of 2 pages
    assert d.updates == {"device_budget_bytes": 2 * PAGE}
    d = c.observe(2, 9 * MIB, ZeroConfig())
    assert d.updates == {} and "memory outside the pool" in d.reason
    assert c.state is HeadroomState.FLOOR
    assert c.observe(3, 9 * MIB, ZeroConfig()) is None  # said once
    c.turn_off()
    assert c.observe(4, 1 * MIB, ZeroConfig()) is None


def test_auto_is_resolved_from_the_allocator_cap_or_refused_naming_it(monkeypatch):
    config = ZeroConfig(device_budget_bytes="auto", headroom_fraction=0.25, page_size_bytes=PAGE)
    assert config.device_budget_bytes == "auto"
    monkeypatch.delenv(CPU_LIMIT_ENV, raising=False)
    with pytest.raises(ZeroConfigError, match=CPU_LIMIT_ENV):
        resolve_auto(config, STANDIN)
    monkeypatch.setenv(CPU_LIMIT_ENV, "64")
    resolved, controller = resolve_auto(config, STANDIN)
    assert resolved.device_budget_bytes == controller.budget == 48 * MIB
    assert controller.describe()["capacity_bytes"] == 64 * MIB
    assert resolve_auto(ZeroConfig(), STANDIN) == (ZeroConfig(), None)


@pytest.mark.parametrize("value", ["Auto", "", "max"])
def test_other_strings_are_refused_naming_auto(value):
    with pytest.raises(ZeroConfigError, match="or 'auto'"):
        ZeroConfig(device_budget_bytes=value)


@pytest.mark.slow
def test_auto_holds_the_headroom_in_a_run_that_pages(tmp_path):
    """A stage-3 run under an allocator cap: no OOM, pages move, the in-step peak stays
    within the headroom on >= 95% of the steps after warm-up, and the controller's
    decisions are config events with source 'auto'."""
    out = tmp_path / "record.json"
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run(
        [sys.executable, str(root / "tests/helpers/headroom_job.py"), str(out), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    peaks = record["peaks"][record["warmup_steps"] :]
    assert len(peaks) >= 20
    within = sum(p <= record["capacity_bytes"] * (1 - record["headroom_fraction"]) for p in peaks)
    assert within / len(peaks) >= 0.95, record
    assert record["page_moves"] > 0  # the budget forces paging
    assert record["final_loss"] < record["first_loss"]
    assert record["auto_events"] >= 1 and all(e["source"] == "auto" for e in record["events"])
    # The floor is the engine's device plan (two gathered units per replica and the row
    # caches: Stage3Engine.min_device_budget), far above MIN_PAGES.
    assert record["floor_bytes"] > 4 * 65536
    assert min(record["budgets"]) >= record["floor_bytes"]


def test_the_floor_rises_to_the_working_set_and_holds():
    c = _controller()
    c.raise_floor(70 * MIB + 1)  # rounded up to pages
    assert c.min_budget == 70 * MIB + PAGE
    c.raise_floor(PAGE)  # never lowered
    assert c.min_budget == 70 * MIB + PAGE
    c.observe(0, 0, NVME3)
    d = c.observe(1, 99 * MIB, NVME3)  # a cut to 63 MiB stops at the floor
    assert d.updates["device_budget_bytes"] == 70 * MIB + PAGE
