"""The runtime's parts on their own, driven through their explicit inputs (no strategy, no
training): the step clock, the budget checks and the post-mortem writer, the control
poller, and the strategy-variant registry. The coordinator's wiring of them is covered by
the telemetry, OOM and control tests that train real models."""

from __future__ import annotations

import json
import math

import pytest

from zero_runtime import control, oom, strategy_variants
from zero_runtime.config import ZeroConfig
from zero_runtime.devices import DeviceInfo
from zero_runtime.runtime.clock import StepClock, StepEnd
from zero_runtime.runtime.postmortem import FailureContext, PostMortem, check_budgets
from zero_runtime.telemetry import Readings, StepStats, TierStats

MIB = 1 << 20


def test_step_clock_ends_a_step_when_every_local_replica_reported():
    times = iter([100.0, 101.5, 104.0])
    clock = StepClock(2, clock=lambda: next(times))  # started at 100.0
    assert clock.replica_done(0) is None
    assert clock.replica_done(1) is None  # another iteration in flight: counted apart
    assert clock.replica_done(0) == StepEnd(step=0, wall_time=101.5, seconds=1.5)
    assert clock.replica_done(1) == StepEnd(step=1, wall_time=104.0, seconds=2.5)


def test_step_clock_refuses_no_replicas():
    with pytest.raises(ValueError, match="local_replicas must be >= 1, got 0"):
        StepClock(0)


def test_budget_checks_name_the_tier_over_its_limit():
    err = check_budgets(7, 2 * MIB, lambda: 3.0 * MIB, host_margin_bytes=0)
    assert isinstance(err, oom.DeviceBudgetExceededError)
    assert (err.used_bytes, err.budget_bytes, err.tier) == (3 * MIB, 2 * MIB, "device")
    assert "step 7" in str(err)

    def unreadable() -> float:
        raise AssertionError("no budget: the device tier must not be read")

    assert check_budgets(7, None, unreadable, host_margin_bytes=0) is None
    low = check_budgets(7, None, unreadable, host_margin_bytes=1 << 50)  # 1 PiB never free
    assert isinstance(low, oom.HostMemoryLowError) and low.tier == "host"


def _tier(used: float, capacity: float, **holders: float) -> TierStats:
    return TierStats(used_bytes=used, capacity_bytes=capacity, peak_bytes=used, **holders)


def _context(config: ZeroConfig) -> FailureContext:
    nan = math.nan
    readings = Readings(nan, nan, nan, nan, 1.0 * MIB, nan)
    device = _tier(
        3.0 * MIB, 2.0 * MIB, param_bytes=MIB, grad_bytes=MIB, optimizer_bytes=MIB, other_bytes=0
    )
    host = _tier(0.0, 64.0 * 1024 * MIB, param_bytes=0, grad_bytes=0, optimizer_bytes=0)
    nvme = _tier(0.0, nan, param_bytes=0, grad_bytes=0, optimizer_bytes=0)
    snap = StepStats(3, 1.7e9, {"device": device, "host": host, "nvme": nvme}, readings, {}, {})
    return FailureContext(snap, [snap], config, 0, [])


def test_postmortem_writes_the_report_of_its_inputs_once(tmp_path):
    config = ZeroConfig(
        stage=1, offload_optimizer="none", device_budget_bytes=2 * MIB, page_size_bytes=65536
    )
    published = []
    pm = PostMortem(
        str(tmp_path),
        DeviceInfo(("/cpu:0", "/cpu:1"), True, "device (CPU stand-in)"),
        num_replicas=2,
        publish=lambda step, report: published.append((step, report["step"])),
    )
    err = oom.DeviceBudgetExceededError(3 * MIB, 2 * MIB, 3)
    assert pm.fail(err, 3, err, lambda: _context(config)) is err
    path = tmp_path / oom.OOM_FILENAME
    report = json.loads(path.read_text())
    assert err.postmortem_path == pm.path == str(path) and published == [(3, 3)]
    assert report["tiers"]["device"]["used_bytes"] == 3 * MIB
    assert {h["kind"]: h["bytes"] for h in report["tiers"]["device"]["holders"]} == {
        "param": MIB,
        "grad": MIB,
        "optimizer": MIB,
    }
    # Offloading frees 1 MiB: 2 MiB left, exactly the budget, so not verified with the
    # 5% margin (docs/oom.md); the budget raise (3 MiB + 25%, in whole MiB) is.
    advice = {json.dumps(a["change"]): a for a in report["advice"]}
    offload = advice['{"offload_optimizer": "cpu"}']
    assert offload["verdict"] == "may fit" and offload["missing_bytes"] == int(0.05 * 2 * MIB)
    assert report["advice"][0]["change"] == {"device_budget_bytes": 4 * MIB}
    assert report["advice"][0]["verdict"] == "fits"
    assert pm.written_for(err) == str(path)  # a second call for the same error: that file
    assert pm.written_for(RuntimeError(f"re-raised: {path}")) == str(path)
    assert pm.written_for(RuntimeError("another")) is None


def test_postmortem_never_hides_the_oom_behind_a_report_bug(tmp_path):
    pm = PostMortem(str(tmp_path), DeviceInfo(("/cpu:0",), True, "x"), num_replicas=1)
    err = oom.HostMemoryLowError(1, 2, 0)

    def broken() -> FailureContext:
        raise KeyError("accounting bug")

    assert pm.fail(err, 0, err, broken) is err
    assert err.postmortem_path is None and not (tmp_path / oom.OOM_FILENAME).exists()


def test_control_poller_decides_from_the_file_or_adopts_the_sync(tmp_path):
    channel = control.ControlChannel(str(tmp_path), ZeroConfig())
    poller = control.ControlPoller(channel)
    assert poller.poll(1) is None  # no request file
    control.write_request(str(tmp_path), {"device_budget_bytes": 8 * MIB})
    outcome = poller.poll(5)
    assert outcome.status is control.Status.APPLIED and outcome.step == 5
    assert channel.config.device_budget_bytes == 8 * MIB and channel.version == 1
    calls = []

    def sync(ch, step):
        calls.append((ch, step))
        return None

    assert poller.poll(6, sync) is None and calls == [(channel, 6)]


def test_strategy_variants_pick_the_registered_subclass_that_applies():
    class Base:
        pass

    class Sub(Base):
        pass

    active = []
    assert strategy_variants.select(Base) is Base and strategy_variants.registered(Base) == ()
    strategy_variants.register("test-only variant", lambda: bool(active), Sub)
    assert [v.cls for v in strategy_variants.registered(Base)] == [Sub]
    assert strategy_variants.select(Base) is Base  # registered, but does not apply
    active.append(True)
    assert strategy_variants.select(Base) is Sub
    with pytest.raises(TypeError, match="cls must be a class"):
        strategy_variants.register("bad", lambda: True, Sub())


def test_tf_config_without_a_registered_multiworker_variant_is_an_error(monkeypatch):
    """``zero_runtime.strategy.ZeroInfinityStrategy`` used directly, before anything imported
    ``zero_runtime.multiworker``: a cluster's worker must not silently train alone."""
    from zero_runtime.strategy import ZeroInfinityStrategy

    monkeypatch.setattr(strategy_variants, "_VARIANTS", [])
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["h:1", "h:2"]}}')
    with pytest.raises(RuntimeError, match="no multi-worker strategy is registered"):
        ZeroInfinityStrategy({"stage": 1})
