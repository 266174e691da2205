"""The event files of a short demo run read back with TensorBoard's EventAccumulator:
every tag docs/events.md documents is present, in its stated units, and sampled steps
carry comm/compute intervals parsed from TensorFlow's profiler trace; step 0 is marked as
traced (its time includes tracing the step function)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tbparse import SummaryReader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from tb_plugin import metadata

REPO = Path(__file__).resolve().parent.parent
STEPS = 6
# Tags a stage-1 run without live tuning or OOM writes (config_event, oom: on their event).
WRITTEN = [
    metadata.TAG_TIERS,
    metadata.TAG_READINGS,
    metadata.TAG_PAGES,
    metadata.TAG_TIMING,
    metadata.TAG_RUN_INFO,
    metadata.TAG_PLACEMENT,
    metadata.TAG_ESTIMATE,
    metadata.TAG_COLLECTIVES,
    metadata.TAG_STEP_INFO,
]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The event directory of one short demo run (STEPS steps, a trace every 2 steps)."""
    tmp_path = tmp_path_factory.mktemp("telemetry_events")
    env = dict(
        os.environ,
        TF_CPU_ALLOCATOR_USE_BFC="true",
        TF_CPP_MIN_LOG_LEVEL="2",
        ZERO_RUNTIME_PROFILE_EVERY="2",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "demo.train", "--logdir", str(tmp_path), "--steps", str(STEPS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path / "gpt_zero1"


def test_demo_events_have_every_documented_tag_in_units(demo_run):
    docs = (REPO / "docs" / "events.md").read_text()
    for tag in metadata.LAYOUTS:
        assert f"`{tag}`" in docs, f"{tag} is not documented in docs/events.md"
    ea = EventAccumulator(str(demo_run), size_guidance={"tensors": 0})
    ea.Reload()
    assert set(WRITTEN) <= set(ea.Tags()["tensors"])

    def rows(tag):
        return {e.step: tensor_util.make_ndarray(e.tensor_proto) for e in ea.Tensors(tag)}

    tiers = rows(metadata.TAG_TIERS)
    assert sorted(tiers) == list(range(STEPS))
    for m in tiers.values():
        assert m.shape == (3, len(metadata.TIER_COLUMNS))
        assert m[0, 0] > 1e5 and m[1, 0] > 0  # device and host used, bytes
        assert m[0, 3] == 2 * 4 * 137_216  # device param bytes: 137 216 float32 x 2 replicas
    timing = rows(metadata.TAG_TIMING)
    info = rows(metadata.TAG_STEP_INFO)
    profiled = [s for s, v in info.items() if v[3] == 1]
    assert profiled == [2, 4]  # every 2 steps, the step after the boundary
    gathered = []  # unsampled steps whose all-gather was timed
    for s, v in timing.items():
        t = dict(zip(metadata.TIMING_COLUMNS, v))
        assert 0 < t["step_seconds"] < 60  # seconds
        if s in profiled:  # collectives and ops from the trace
            assert t["comm_seconds"] > 0 and t["compute_seconds"] > t["comm_seconds"]
            assert 0 <= t["overlap_ratio"] <= 1
            assert t["overlap_seconds"] <= t["comm_seconds"] + 1e-12
        else:
            # Stage 1's gradient all-reduce is the strategy's own (no host timestamps);
            # its all-gather of the updated shards is the runtime's raw collective, timed
            # by the watchdog's arm -> disarm: comm is that gather alone.
            # (not on a step whose gather ran inside the previous sampled trace window).
            if not math.isnan(t["comm_seconds"]):
                assert 0 < t["comm_seconds"] < t["step_seconds"]
                assert 0 <= t["overlap_seconds"] <= t["comm_seconds"] + 1e-12
                assert 0 <= t["overlap_ratio"] <= 1
                gathered.append(s)
        assert t["traced"] == (1.0 if s == 0 else 0.0)  # step 0 traces the step function
        assert math.isnan(t["io_seconds"])  # no NVMe in this run: not measured
    assert len(gathered) >= len(timing) // 2, gathered
    for v in info.values():
        assert tuple(v[:3]) == (0, 1, 0)  # config version, stage, fallback flag
    coll = rows(metadata.TAG_COLLECTIVES)
    for v in coll.values():
        c = dict(zip(metadata.COLLECTIVE_COLUMNS, v))
        assert c["all_reduce_bytes"] > 0 and c["all_reduce_bytes"] % 4 == 0
        assert c["all_gather_bytes"] == c["all_reduce_bytes"] / 2  # shard = flat / N, x N
        assert c["reduce_scatter_bytes"] == 0 and c["all_gather_calls"] == 2
    readings = rows(metadata.TAG_READINGS)
    r = dict(zip(metadata.READING_COLUMNS, readings[0]))
    assert math.isnan(r["nvml_used_bytes"])  # no GPU: absent, not zero
    assert r["process_rss_bytes"] > 100e6 and math.isnan(r["nvme_disk_bytes"])
    pages = rows(metadata.TAG_PAGES)
    assert all(np.isnan(v).all() for v in pages.values())  # no pool in this run
    placement = ea.Tensors(metadata.TAG_PLACEMENT)
    assert len(placement) == 1  # first step; the placement did not change
    assert json.loads(tensor_util.make_ndarray(placement[0].tensor_proto).item())["variables"]


def test_tbparse_reads_the_headline_scalars(demo_run):
    """tbparse (an outside reader, no plugin) finds the ``zero/...`` scalars of the demo
    run, with the values of the tensors they repeat, at every step."""
    docs = (REPO / "docs" / "events.md").read_text()
    for tag in metadata.SCALAR_TAGS:
        assert f"`{tag}`" in docs, f"{tag} is not documented in docs/events.md"
    frame = SummaryReader(str(demo_run)).tensors  # TF2 scalars: tbparse's `tensors`
    frame = frame[frame["tag"].str.startswith(metadata.SCALAR_PREFIX)]
    got = {(r.tag, int(r.step)): float(r.value) for r in frame.itertuples()}
    ea = EventAccumulator(str(demo_run), size_guidance={"tensors": 0})
    ea.Reload()
    assert metadata.PLUGIN_NAME not in set(ea.PluginTagToContent("scalars").values())
    scalar_tags = {
        t for t in ea.PluginTagToContent("scalars") if t.startswith(metadata.SCALAR_PREFIX)
    }
    # A stage-1 host-offload run: tiers and step time measured, no paged pool.
    expect = {f"zero/{t}/{c}" for t in ("device", "host") for c in ("used_bytes", "peak_bytes")}
    expect |= {"zero/timing/step_seconds"}
    assert expect <= scalar_tags <= set(metadata.SCALAR_TAGS)
    assert "zero/pages/prefetch_hit_rate" not in scalar_tags  # not measured: not written
    tiers = {
        e.step: tensor_util.make_ndarray(e.tensor_proto) for e in ea.Tensors(metadata.TAG_TIERS)
    }
    timing = {
        e.step: tensor_util.make_ndarray(e.tensor_proto) for e in ea.Tensors(metadata.TAG_TIMING)
    }
    used = metadata.TIER_COLUMNS.index("used_bytes")
    peak = metadata.TIER_COLUMNS.index("peak_bytes")
    for step in range(STEPS):
        for row, tier in enumerate(("device", "host")):
            assert got[(f"zero/{tier}/used_bytes", step)] == np.float32(tiers[step][row, used])
            assert got[(f"zero/{tier}/peak_bytes", step)] == np.float32(tiers[step][row, peak])
        assert got[("zero/device/used_bytes", step)] > 1e5  # bytes
        step_seconds = got[("zero/timing/step_seconds", step)]
        assert step_seconds == np.float32(timing[step][0]) and 0 < step_seconds < 60
    # The host tier holds the Adam moments of 137,216 parameters (2 slots, 2 shards).
    assert got[("zero/host/used_bytes", STEPS - 1)] >= 2 * 2 * 4 * (137_216 // 2)
