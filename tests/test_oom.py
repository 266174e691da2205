"""OOM post-mortem: the demo really exceeds its device budget in a subprocess,
ends with an out-of-memory error, leaves the post-mortem as a summary and as a JSON file,
and completes once the top advised change is applied; a pool OOM from deep inside a step
(the NVMe tier really full) still writes the JSON post-mortem; ``zero-runtime oom-report``
reads it back."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

import zero_runtime
from zero_runtime import cli, oom
from zero_runtime.config import ZeroConfig
from zero_runtime.runtime.advice import Evidence, Unit, advise, diagnose

REPO = Path(__file__).resolve().parent.parent
RUN = "gpt_zero1"
# The demo's device tier by the runtime's accounting (allocator statistics off, so the
# check is deterministic): params 1 097 728 + grads 1 097 728 + Adam states 1 097 728 bytes
# over both replicas = 3 293 184 > 3 MiB.
BUDGET = 3 << 20
BASE = [
    "--set",
    "offload_optimizer=none",
    "--set",
    "page_size_bytes=65536",
    "--set",
    f"device_budget_bytes={BUDGET}",
]


def _demo(logdir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        TF_CPU_ALLOCATOR_USE_BFC="false",
        TF_CPP_MIN_LOG_LEVEL="2",
        ZERO_RUNTIME_PROFILE_EVERY="0",
    )
    return subprocess.run(
        [sys.executable, "-m", "demo.train", "--logdir", str(logdir), "--steps", "20", *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )


def test_advice_ranks_job_changes_before_a_budget_raise():
    config = ZeroConfig(
        stage=1, offload_optimizer="none", device_budget_bytes=3 << 20, page_size_bytes=65536
    )
    advice = advise(
        failed_tier="device",
        required_bytes=3_293_184,
        capacity_bytes=3 << 20,
        holders={"param": 1_097_728, "grad": 1_097_728, "optimizer": 1_097_728},
        config=config,
        num_replicas=2,
        physical_bytes={"device": 8 << 30},
        free_bytes={"host": 8 << 30},
        implemented={(1, "cpu"), (1, "none"), (2, "none")},
    )
    assert [a["rank"] for a in advice] == [1, 2, 3]
    assert advice[0]["change"] == {"offload_optimizer": "cpu"}
    assert advice[0]["frees_bytes"] == 1_097_728 and advice[0]["fits"]
    assert advice[1]["change"] == {"stage": 2} and advice[1]["frees_bytes"] == 548_864
    assert advice[2]["change"] == {"device_budget_bytes": 4 << 20}  # the machine's, last
    # Nothing fits: the excess is larger than anything that can move, on a tiny machine.
    none = advise(
        failed_tier="device",
        required_bytes=64 << 20,
        capacity_bytes=3 << 20,
        holders={"optimizer": 1 << 20},
        config=config,
        num_replicas=2,
        physical_bytes={"device": 16 << 20},
        free_bytes={"host": 8 << 30},
        implemented=None,
    )
    assert none and not any(a["fits"] for a in none)


MiB = 1 << 20
IMPL = {(s, o) for s in (1, 2, 3) for o in ("none", "cpu", "nvme")} | {(0, "none")}


def _advise(config, **kw):
    args = dict(
        failed_tier="device",
        num_replicas=2,
        physical_bytes={"device": 8 << 30, "host": 8 << 30, "nvme": 8 << 30},
        free_bytes={"host": 8 << 30, "nvme": 8 << 30},
        implemented=IMPL,
    )
    args.update(kw)
    return advise(config=config, **args)


def _by_change(advice):
    return {json.dumps(a["change"], sort_keys=True): a for a in advice}


def test_budget_raise_covers_the_in_step_peak_not_the_boundary_use():
    """A raise to the boundary use ("raise to 9 MiB, fits") would OOM at 9.6-10.1 MiB.
    With the allocator's figures recorded (boundary use 9.2-9.4 MiB over the last steps,
    in-step peak 27 MiB), the raise goes above the peak with the margin and the job
    changes that only free the boundary bytes are not labelled "fits" without the
    margin."""
    config = ZeroConfig(stage=1, offload_optimizer="none", device_budget_bytes=9 * MiB)
    ev = Evidence(
        allocator=True,
        recent_used=(int(9.2 * MiB), int(9.4 * MiB)),
        recent_peaks=(27 * MiB, 26 * MiB),
        num_params=137_216,
        local_replicas=2,
    )
    holders = {"param": 1_097_728, "grad": 1_097_728, "optimizer": 1_097_728}
    advice = _advise(
        config, required_bytes=int(9.4 * MiB), capacity_bytes=9 * MiB, holders=holders,
        evidence=ev,
    )  # fmt: skip
    rows = _by_change(advice)
    raise_row = next(a for a in advice if "device_budget_bytes" in a["change"])
    assert raise_row["change"]["device_budget_bytes"] >= 1.25 * 27 * MiB
    assert raise_row["verdict"] == "fits"
    # Offloading frees 1.05 MiB of 9.4: 8.35 MiB + 25% of 9 MiB margin > 9 MiB.
    off = rows['{"offload_optimizer": "cpu"}']
    assert off["verdict"] == "may fit" and not off["fits"]
    assert off["missing_bytes"] == int(9.4 * MiB) - 1_097_728 + int(0.25 * 9 * MiB) - 9 * MiB
    assert advice[0] is raise_row  # the only verified change ranks first
    # The same figures by the runtime's own accounting (deterministic): a 5% margin,
    # 9.4 - 1.05 + 0.45 <= 9 MiB for the offload; 9.4 - 0.52 + 0.45 > 9 MiB for stage 2.
    acc = _advise(
        config, required_bytes=int(9.4 * MiB), capacity_bytes=9 * MiB, holders=holders,
        evidence=dataclasses.replace(ev, allocator=False, recent_peaks=()),
    )  # fmt: skip
    assert _by_change(acc)['{"offload_optimizer": "cpu"}']["verdict"] == "fits"
    assert _by_change(acc)['{"stage": 2}']["verdict"] == "may fit"


def test_stage3_unit_larger_than_budget_is_the_named_cause():
    """Both replicas gather the same 3.9 MiB embedding: no job change can fit a 4 MiB
    budget (the floor stays), max_live_parameters above the gathered elements is not
    offered, and the summary's cause names the unit."""
    config = ZeroConfig(
        stage=3, offload_param="none", offload_optimizer="none", device_budget_bytes=4 * MiB
    )
    units = (Unit("embedding", int(3.9 * MiB), 1_022_362), Unit("block_0", MiB, 262_144))
    ev = Evidence(num_params=1_300_000, local_replicas=2, units=units, shard_bytes=3 * MiB)
    holders = {"param": 3 * MiB, "optimizer": MiB}
    advice = _advise(
        config, required_bytes=int(4.5 * MiB), capacity_bytes=4 * MiB, holders=holders,
        evidence=ev,
    )  # fmt: skip
    rows = _by_change(advice)
    assert not any("max_live_parameters" in a["change"] for a in advice)
    for key in ('{"offload_param": "cpu"}', '{"offload_optimizer": "cpu"}'):
        assert rows[key]["verdict"] == "does not fit"
        assert rows[key]["missing_bytes"] == 2 * int(3.9 * MiB) - 4 * MiB
    raise_row = next(a for a in advice if "device_budget_bytes" in a["change"])
    # Upper bound: every unit gathered on both replicas plus params and Adam's 2 slots.
    upper = 2 * (3 * MiB + 2 * 3 * MiB + int(3.9 * MiB) + MiB)
    assert raise_row["predicted_bytes"] == upper and raise_row["verdict"] == "fits"
    assert advice[0] is raise_row
    cause = diagnose("device", 4 * MiB, int(4.5 * MiB), holders, ev)
    assert cause.startswith("the largest gathered unit, `embedding` 3.90 MiB per replica × 2")
    # A limit below the gathered elements that still lets only the embedding in at once
    # (1.2 M: embedding + block_0 is 1.28 M) frees nothing when halved: not offered.
    low = _advise(
        config.replace(max_live_parameters=1_200_000), required_bytes=int(4.5 * MiB),
        capacity_bytes=64 * MiB, holders=holders, evidence=ev,
    )  # fmt: skip
    assert not any("max_live_parameters" in a["change"] for a in low)


def test_lower_max_live_parameters_is_replayed_and_dropped_when_it_frees_nothing():
    """Advice that frees nothing is not offered. Three 1 MiB units of 262 144
    elements: a limit of 600 000 gathers two at once, 300 000 only one: 1 MiB freed per
    replica, replayed on the upper bound (shards + persistent + gathered at once)."""
    config = ZeroConfig(
        stage=3, offload_param="cpu", offload_optimizer="cpu", device_budget_bytes=8 * MiB,
        max_live_parameters=600_000,
    )  # fmt: skip
    units = tuple(Unit(f"block_{i}", MiB, 262_144) for i in range(3))
    ev = Evidence(num_params=800_000, local_replicas=2, units=units, shard_bytes=MiB)
    advice = _advise(
        config, required_bytes=9 * MiB, capacity_bytes=8 * MiB, holders={"param": 4 * MiB},
        evidence=ev,
    )  # fmt: skip
    (live,) = [a for a in advice if "max_live_parameters" in a["change"]]
    assert live["change"]["max_live_parameters"] == 300_000
    assert live["frees_bytes"] == 2 * MiB  # two gathered units -> one, on 2 replicas
    assert live["predicted_bytes"] == 2 * MiB  # one unit gathered on each replica
    assert live["verdict"] == "fits"
    assert all(a["frees_bytes"] > 0 for a in advice)


def test_nvme_full_offers_host_memory_when_it_has_room():
    """An NVMe-full failure offers offload_optimizer=cpu when the host holds the states
    with the margin."""
    config = ZeroConfig(
        stage=1, offload_optimizer="nvme", nvme_path="/tmp", nvme_budget_bytes=65536,
        page_size_bytes=65536,
    )  # fmt: skip
    ev = Evidence(num_params=30_432, local_replicas=2)
    kw = dict(
        failed_tier="nvme", required_bytes=196_608, capacity_bytes=65536,
        holders={"optimizer": 65536}, evidence=ev,
    )  # fmt: skip
    rows = _by_change(_advise(config, **kw))
    cpu = rows['{"offload_optimizer": "cpu"}']
    assert cpu["verdict"] == "fits" and cpu["predicted_bytes"] == 0
    # The host has 100 KiB free: Adam's 8 B/param over 2 replicas, page-rounded, is more.
    tight = _by_change(
        _advise(
            config,
            free_bytes={"host": 100 << 10, "nvme": 0},
            physical_bytes={"nvme": 65536, "host": 8 << 30},
            **kw,
        )
    )
    assert tight['{"offload_optimizer": "cpu"}']["verdict"] == "does not fit"
    raise_row = next(a for a in tight.values() if "nvme_budget_bytes" in a["change"])
    assert raise_row["verdict"] == "does not fit"  # the disk has 0 bytes more


def test_a_pool_failure_without_the_whole_need_is_never_verified():
    """A pool fails at the first page it cannot place: with no model of the whole need
    (the stage-3 engine still placing its shards: no Ψ, no units) the failed figure is a
    lower bound, so a budget raise to it is "may fit"; with Ψ the estimator's host bytes
    make the raise verifiable."""
    config = ZeroConfig(
        stage=3, offload_param="cpu", offload_optimizer="cpu", host_budget_bytes=262144,
        page_size_bytes=65536,
    )  # fmt: skip
    kw = dict(
        failed_tier="host", required_bytes=327_680, capacity_bytes=262_144,
        holders={"param": 262_144},
    )  # fmt: skip
    (raise_row,) = _advise(config, evidence=Evidence(local_replicas=2), **kw)
    assert raise_row["change"] == {"host_budget_bytes": 1 << 20}
    assert raise_row["verdict"] == "may fit" and "not known" in raise_row["description"]
    known = _advise(config, evidence=Evidence(num_params=300_000, local_replicas=2), **kw)
    (raise_row,) = [a for a in known if "host_budget_bytes" in a["change"]]

    # Stage 3, both offloads on the host: params 4 + Adam 8 bytes per element, 150 000
    # elements per replica, each term rounded up to 64 KiB pages, for 2 local replicas.
    def pages(n):
        return -(-n // 65536) * 65536

    host = 2 * (pages(4 * 150_000) + pages(8 * 150_000))
    assert raise_row["predicted_bytes"] == host
    assert raise_row["change"]["host_budget_bytes"] >= 1.25 * host
    assert raise_row["verdict"] == "fits"


def test_tier_row_uses_one_accounting_for_used_and_holders():
    """Not "28 MiB used" beside holders summing to 44 MiB: a tier row's used bytes
    are the sum of its holders; the checked reading is kept beside them with its source,
    and a reading above the holders adds the unattributed remainder as a holder."""
    holders = [
        oom.holder("parameters", "param", 11 * MiB),
        oom.holder("gradients", "grad", 11 * MiB),
        oom.holder("optimizer states", "optimizer", 22 * MiB),
    ]
    row = oom.tier_row(12 * MiB, holders, 28 * MiB, "allocator")
    assert row["used_bytes"] == 44 * MiB == sum(h["bytes"] for h in row["holders"])
    assert (row["checked_bytes"], row["checked_source"]) == (28 * MiB, "allocator")
    assert row["accounted_bytes"] == 44 * MiB and len(row["holders"]) == 3
    above = oom.tier_row(12 * MiB, holders[:1], 28 * MiB, "allocator")
    assert above["used_bytes"] == 28 * MiB == sum(h["bytes"] for h in above["holders"])
    (extra,) = [h for h in above["holders"] if h["name"] == oom.UNATTRIBUTED]
    assert extra == {"name": oom.UNATTRIBUTED, "kind": "other", "bytes": 17 * MiB, "pages": None}
    with pytest.raises(ValueError, match="checked_source='gpu'"):
        oom.tier_row(None, [], 1, "gpu")
    failed = {"bytes": None, "tier": "device", "error_type": "DeviceBudgetExceededError"}
    report = oom.build_report(
        step=0, failed=failed, tiers={"device": row}, recent_steps=[], config={},
        config_version=0, config_history=[], readings={}, advice=[], cause=None,
    )  # fmt: skip
    assert "44.00 MiB by the runtime's accounting of 12.00 MiB" in report["summary"]
    assert "TensorFlow's allocator read 28.00 MiB at the check" in report["summary"]
    assert report["request_text"].startswith("no single request: the budget is checked")
    assert set(report["figures"]["checked_bytes"]) == {"allocator"}


def test_stage0_advice_verifies_zero_infinity_and_drops_what_frees_nothing():
    """The demo's stage-0 OOM does not rank "raise the budget" first, nor offer
    ZeRO-Infinity with "frees 0 B, may fit" and stages 1-2 as "may fit (short)". With the
    estimator's stage-3 figures of the model (Stage3Plan), ZeRO-Infinity is replayed and
    verified, and ranks first; the stages whose replay stays over the budget are "does
    not fit" with the bytes over; nothing freeing 0 bytes is offered."""
    from zero_runtime.runtime.advice import Stage3Plan

    config = ZeroConfig(stage=0, device_budget_bytes=12 * MiB)
    holders = {"param": 11 * MiB, "grad": 11 * MiB, "optimizer": 22 * MiB}
    plan = Stage3Plan(
        device_bytes=int(4.4 * MiB), host_bytes=int(8.25 * MiB), largest_unit="block_0"
    )
    ev = Evidence(
        allocator=True, recent_used=(26 * MiB, 28 * MiB), recent_peaks=(28 * MiB,),
        num_params=1_445_824, local_replicas=2, stage3_plan=plan,
    )  # fmt: skip
    advice = _advise(
        config, required_bytes=44 * MiB, capacity_bytes=12 * MiB, holders=holders, evidence=ev,
    )  # fmt: skip
    top = advice[0]
    assert top["change"] == {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}
    assert top["verdict"] == "fits" and top["predicted_bytes"] == 2 * int(4.4 * MiB)
    # The stage-3 check reads the pool's own accounting: its 5% margin, not the
    # allocator's 25% (or the spread of its readings) that this failure was checked with.
    assert top["margin_bytes"] == int(0.05 * 12 * MiB)
    assert top["frees_bytes"] == 44 * MiB - 2 * int(4.4 * MiB)
    assert "block_0" in top["description"]
    rows = _by_change(advice)
    for key, over in (('{"stage": 1}', 44 - 11 - 12), ('{"stage": 2}', 44 - 16.5 - 12)):
        assert rows[key]["verdict"] == "does not fit", rows[key]
        assert rows[key]["missing_bytes"] == int(over * MiB)
    raise_row = next(a for a in advice if "device_budget_bytes" in a["change"])
    assert advice.index(raise_row) == 1  # after the verified change of the job
    assert all(a["frees_bytes"] > 0 for a in advice)
    # Without the model's figures ZeRO-Infinity cannot be replayed: not offered.
    unknown = _advise(
        config, required_bytes=44 * MiB, capacity_bytes=12 * MiB, holders=holders,
        evidence=dataclasses.replace(ev, stage3_plan=None),
    )  # fmt: skip
    assert not any(a["change"].get("stage") == 3 for a in unknown)
    # The plan over the budget on the local replicas: "does not fit".
    big = dataclasses.replace(plan, device_bytes=7 * MiB)
    (row,) = [
        a
        for a in _advise(
            config,
            required_bytes=44 * MiB,
            capacity_bytes=12 * MiB,
            holders=holders,
            evidence=dataclasses.replace(ev, stage3_plan=big),
        )  # fmt: skip
        if a["change"].get("stage") == 3
    ]
    assert row["verdict"] == "does not fit" and row["missing_bytes"] == 2 * MiB


def test_report_message_keeps_the_oom_line_of_a_graph_execution_error():
    """TensorFlow's graph execution error repeats the Keras call stack per node; the
    report's message drops those stack lines, so the "OOM when allocating" line (which a
    4000-character cut of the raw text lost in the demo) is kept."""
    stack = '  File "/x/keras/src/layers/layer.py", line 1002, in __call__\n\n' * 200
    raw = (
        "Graph execution error:\n\nDetected at node replica_1/gpt/mlp/Gelu defined at (most "
        f"recent call last):\n{stack}"
        "OOM when allocating tensor with shape[8,32,768] and type float on "
        "/job:localhost/replica:0/task:0/device:CPU:0 by allocator mklcpu\n"
        "\t [[{{node replica_1/gpt/mlp/Gelu}}]]\n\npost-mortem: /tmp/x.json"
    )
    short = oom.short_message(raw)
    assert short.splitlines() == [
        "Graph execution error:",
        "Detected at node replica_1/gpt/mlp/Gelu defined at (most recent call last):",
        "OOM when allocating tensor with shape[8,32,768] and type float on "
        "/job:localhost/replica:0/task:0/device:CPU:0 by allocator mklcpu",
        "\t [[{{node replica_1/gpt/mlp/Gelu}}]]",
    ]
    assert oom.request_from_message(short) == 8 * 32 * 768 * 4
    assert len(oom.short_message("x" * 10_000)) == oom.MESSAGE_CHARS


def test_holder_names_carry_no_object_ids():
    assert oom.display_name("g/gpt.block_0.mlp_norm.gamma#7f3254ce0f10/r0") == (
        "g/gpt.block_0.mlp_norm.gamma/r0"
    )
    assert oom.holder("e/embedding#7f32/r1/p0", "param", 10)["name"] == "e/embedding#7f32/r1/p0"
    assert oom.holder("e/embedding#7f3254ce/r1/p0", "param", 10)["name"] == "e/embedding/r1/p0"


@pytest.fixture(scope="module")
def oom_logdir(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    logdir = tmp_path_factory.mktemp("oom_demo")
    return logdir, _demo(logdir, *BASE)


def test_demo_over_budget_writes_postmortem_in_both_forms(oom_logdir):
    logdir, proc = oom_logdir
    assert proc.returncode == 1, proc.stderr[-3000:]
    path = logdir / RUN / oom.OOM_FILENAME
    # One line naming the step, tier and cause (the post-mortem's summary), no traceback.
    assert "out of memory: Step 0 ran out of memory on the device tier" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"OOM post-mortem: {path}" in proc.stderr
    # The report's path once in the whole log (not in both the runtime's own log line
    # and the demo's).
    assert (proc.stdout + proc.stderr).count(str(path)) == 1, proc.stderr
    report = json.loads(path.read_text())
    assert report["version"] == 1 and report["step"] == 0
    assert report["failed_request"]["tier"] == "device"
    assert report["failed_request"]["error_type"] == "DeviceBudgetExceededError"
    device = report["tiers"]["device"]
    assert device["capacity_bytes"] == BUDGET and device["used_bytes"] == 3_293_184
    kinds = {h["kind"]: h["bytes"] for h in device["holders"]}
    assert kinds == {"param": 1_097_728, "grad": 1_097_728, "optimizer": 1_097_728}
    # One accounting: used is the holders' sum; the check's figure and source beside it.
    assert sum(h["bytes"] for h in device["holders"]) == device["used_bytes"]
    assert (device["checked_bytes"], device["checked_source"]) == (3_293_184, "accounting")
    assert report["request_text"].startswith("no single request")
    assert report["figures"]["checked_bytes"] == {}  # the reading is the accounting here
    assert "sum of the holders" in report["figures"]["used_bytes"]
    assert report["advice"][0]["change"] == {"offload_optimizer": "cpu"}
    assert report["advice"][0]["fits"] and not report["nothing_fits"]
    assert report["config"]["device_budget_bytes"] == BUDGET
    assert "device tier" in report["summary"]
    ea = EventAccumulator(str(logdir / RUN), size_guidance={"tensors": 0})
    ea.Reload()
    (event,) = ea.Tensors("memory_hierarchy/oom")
    summary = json.loads(tensor_util.make_ndarray(event.tensor_proto).item())
    assert summary["failed_request"] == report["failed_request"]
    assert summary["advice"] == report["advice"]


def test_top_advice_applied_completes(oom_logdir, tmp_path):
    logdir, _ = oom_logdir
    report = json.loads((logdir / RUN / oom.OOM_FILENAME).read_text())
    change = [f"{k}={json.dumps(v)}" for k, v in report["advice"][0]["change"].items()]
    proc = _demo(tmp_path, *BASE, *[a for c in change for a in ("--set", c)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 20 steps" in proc.stdout
    assert not (tmp_path / RUN / oom.OOM_FILENAME).exists()


def test_oom_report_cli(oom_logdir, tmp_path, capsys):
    logdir, _ = oom_logdir
    assert cli.main(["oom-report", str(logdir)]) == 0
    text = capsys.readouterr().out
    assert "tier device" in text and '1. offload_optimizer="cpu"' in text
    assert cli.main(["oom-report", str(logdir / RUN), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["failed_request"]["tier"] == "device"
    assert cli.main(["oom-report", str(tmp_path)]) == 1
    assert "no memory_hierarchy_oom.json" in capsys.readouterr().err


def test_pool_oom_deep_inside_a_step_writes_json(tmp_path):
    """The NVMe tier holds one page; the write-behind of the second page fails inside the
    optimizer's host update (a tf.numpy_function inside Keras's train step)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 1,
            "offload_optimizer": "nvme",
            "nvme_path": str(nvme),
            "page_size_bytes": 65536,
            "nvme_budget_bytes": 65536,
            "sub_group_size": 200,
        },
        logdir=str(tmp_path / "run"),
    )
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
    x = np.ones((32, 8), np.float32)
    with pytest.raises(tf.errors.ResourceExhaustedError) as info:
        model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0)
    path = tmp_path / "run" / oom.OOM_FILENAME
    assert str(path) in str(info.value)  # the user-visible message says where it is
    report = json.loads(path.read_text())
    assert report["failed_request"]["tier"] == "nvme"
    assert report["failed_request"]["bytes"] > 0 and report["failed_request"]["tensor"]
    nvme_tier = report["tiers"]["nvme"]
    assert nvme_tier["capacity_bytes"] == 65536 and nvme_tier["used_bytes"] == 65536
    assert nvme_tier["holders"][0]["pages"] == 1
    assert strategy.write_postmortem(info.value) == str(path)  # idempotent
    strategy.close()


def test_host_memory_margin_stops_the_step(tmp_path):
    """Available host memory below the margin at a step boundary: HostMemoryLowError."""
    strategy = zero_runtime.ZeroInfinityStrategy({"stage": 1}, logdir=str(tmp_path))
    strategy.runtime.host_margin_bytes = 1 << 50  # 1 PiB must stay free: never true here
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss="mse")
    x = np.ones((16, 4), np.float32)
    with pytest.raises(tf.errors.ResourceExhaustedError, match="post-mortem"):
        model.fit(x, x[:, :2], batch_size=16, epochs=1, verbose=0)
    report = json.loads((tmp_path / oom.OOM_FILENAME).read_text())
    assert report["failed_request"]["tier"] == "host"
    assert report["failed_request"]["error_type"] == "HostMemoryLowError"
    assert report["readings"]["process_rss_bytes"] > 0
    strategy.close()


UNCAUGHT = """
import sys, zero_runtime, tensorflow as tf
strategy = zero_runtime.ZeroInfinityStrategy({"stage": 1}, logdir=sys.argv[1])
tf.zeros([1 << 40], tf.float32)  # 4 TiB: TensorFlow's allocator raises, nobody catches
"""


def test_uncaught_tensorflow_oom_writes_postmortem_through_excepthook(tmp_path):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="false", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-c", UNCAUGHT, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "ResourceExhaustedError" in proc.stderr
    report = json.loads((tmp_path / oom.OOM_FILENAME).read_text())
    failed = report["failed_request"]
    assert failed["error_type"] == "ResourceExhaustedError" and failed["tier"] == "device"
    assert failed["bytes"] == 4 << 40  # parsed from "shape[1099511627776] and type float"


def test_a_stage3_unit_above_the_device_budget_is_refused_before_training(tmp_path):
    """A stage-3 unit whose gathered parameters exceed the device budget (a Dense 128 x 256
    kernel, 128 KiB gathered per replica, two units at once on two replicas, against a
    64 KiB budget) is refused when the model is sharded, naming the figures and the
    fixes, before anything is replaced: no step starts that would run out of memory in a
    gather (the gathered units are TensorFlow tensors the device plan counts,
    zero_runtime/stage3/device_plan.py)."""
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 3,
            "offload_param": "cpu",
            "offload_optimizer": "cpu",
            "page_size_bytes": 65536,
            "device_budget_bytes": 65536,
        },
        logdir=str(tmp_path),
    )
    try:
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((128,)), keras.layers.Dense(256), keras.layers.Dense(4)]
            )
            with pytest.raises(ValueError) as caught:
                strategy.shard_model(model)
    finally:
        strategy.close()
    message = str(caught.value)
    gathered = 2 * 2 * 4 * (128 * 256 + 256)  # 2 units x 2 replicas x the Dense 128 x 256
    assert f"needs {oom.fmt_bytes(gathered)}" in message
    assert "device_budget_bytes=65536 (64.00 KiB)" in message
    assert "tile_size='auto'" in message and f"device_budget_bytes >= {gathered}" in message
    assert not any(v.__class__.__name__ == "ShardedVariable" for v in model.weights)
