"""OOM post-mortem (issue #10): the demo really exceeds its device budget in a subprocess,
ends with an out-of-memory error, leaves the post-mortem as a summary and as a JSON file,
and completes once the top advised change is applied; a pool OOM from deep inside a step
(the NVMe tier really full) still writes the JSON post-mortem; ``zero-runtime oom-report``
reads it back."""

from __future__ import annotations

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
    advice = oom.advise(
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
    none = oom.advise(
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
    report = json.loads(path.read_text())
    assert report["version"] == 1 and report["step"] == 0
    assert report["failed_request"]["tier"] == "device"
    assert report["failed_request"]["error_type"] == "DeviceBudgetExceededError"
    device = report["tiers"]["device"]
    assert device["capacity_bytes"] == BUDGET and device["used_bytes"] == 3_293_184
    kinds = {h["kind"]: h["bytes"] for h in device["holders"]}
    assert kinds == {"param": 1_097_728, "grad": 1_097_728, "optimizer": 1_097_728}
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
    nvme.mkdir()
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


STAGE3_GATHER_OOM = """
import json, sys
import keras, numpy as np, tensorflow as tf
import zero_runtime
strategy = zero_runtime.ZeroInfinityStrategy(
    {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu", "page_size_bytes": 65536,
     "persistence_threshold": 0, "device_budget_bytes": 65536,
     "collective_timeout_seconds": 30},
    logdir=sys.argv[1],
)
with strategy.scope():
    # Block 0's kernel gathered: 128 x 256 float32 = 128 KiB = 2 pages per replica, over the
    # device tier's 1 page (its shards, 1 page per replica, are on the host).
    model = keras.Sequential([keras.Input((128,)), keras.layers.Dense(256), keras.layers.Dense(4)])
    sharded = strategy.shard_model(model)
    sharded.compile(optimizer="adam", loss="mse")
x = np.ones((8, 128), np.float32)
try:
    sharded.fit(x, np.ones((8, 4), np.float32), batch_size=8, epochs=1, verbose=0)
except tf.errors.ResourceExhaustedError as exc:
    print(json.dumps({"type": type(exc).__name__, "message": str(exc)}))
    sys.exit(3)
"""


def test_pool_oom_inside_a_stage3_gather_writes_postmortem(tmp_path):
    """A stage-3 block whose gathered parameters exceed the device budget: the pool's OOM
    inside the gather (a host callback of Keras's train step) writes the post-mortem, JSON
    and summary, before the ResourceExhaustedError reaches fit's caller."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="false", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-c", STAGE3_GATHER_OOM, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    caught = json.loads(proc.stdout.strip().splitlines()[-1])
    path = tmp_path / oom.OOM_FILENAME
    assert f"post-mortem: {path}" in caught["message"]  # the message says where it is
    report = json.loads(path.read_text())
    failed = report["failed_request"]
    assert failed["tier"] == "device" and failed["error_type"] == "PoolOutOfMemoryError"
    assert failed["bytes"] > 0 and failed["tensor"]  # the gathered buffer it could not place
    device = report["tiers"]["device"]
    assert device["capacity_bytes"] == 65536
    assert device["used_bytes"] + failed["bytes"] > device["capacity_bytes"]
    assert report["advice"]  # which setting would have made it fit
    # The same report as a summary in the run's event file.
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("memory_hierarchy/oom")
    assert len(events) == 1
    summary = json.loads(tensor_util.make_ndarray(events[0].tensor_proto).item())
    assert summary["failed_request"] == failed
