"""Synthetic Memory Hierarchy event files with known values, for plugin and browser tests.

Written with the real write API, :class:`tb_plugin.summary.SummaryWriter`, so the tests
read what the runtime would write. Every value is a function of (run, step), so a test
can compute what the plugin must answer.
"""

from __future__ import annotations

import math
import os

from tb_plugin import metadata
from tb_plugin.summary import SummaryWriter

MIB = 2**20
GIB = 2**30
NUM_STEPS = 50  # steps 0 .. NUM_STEPS - 1 in every run
BASE_WALL_TIME = 1_700_000_000.0  # seconds since the epoch at step 0
WALL_TIME_PER_STEP = 0.5  # seconds

RUN_STANDIN = "alpha"  # device tier is a CPU stand-in
# A run name that is also HTML: the view must show it as text and run nothing.
RUN_HTML_NAME = "beta <img src=x onerror=window.__xss=1>"
RUNS = (RUN_STANDIN, RUN_HTML_NAME)


def wall_time(step: int) -> float:
    """The wall time (seconds since the epoch) written for ``step``."""
    return BASE_WALL_TIME + WALL_TIME_PER_STEP * step


def run_info(run: str) -> dict:
    """The memory_hierarchy/run_info object written at step 0 of ``run``."""
    if run == RUN_STANDIN:
        return {
            "stage": 3,
            "num_replicas": 2,
            "device_is_standin": True,
            "device_description": "CPU:0 budget 256 MiB",
            "fallback_mirrored": False,
            "config": {"stage": 3, "offload_optimizer": "host"},
        }
    return {
        "stage": 2,
        "num_replicas": 1,
        "device_is_standin": False,
        "device_description": "GPU:0 (synthetic)",
        "fallback_mirrored": True,
        "config": {"stage": 2},
    }


def tiers(run: str, step: int) -> dict[str, dict[str, float]]:
    """The memory_hierarchy/tiers matrix of ``run`` at ``step`` (bytes; NaN = unbounded)."""
    scale = 1 if run == RUN_STANDIN else 2
    used = {
        "device": scale * (64 + step) * MIB,
        "host": scale * (512 * MIB + 4 * MIB * step),
        "nvme": scale * 16 * MIB * step,
    }
    capacity = {"device": scale * 256 * MIB, "host": scale * 4 * GIB, "nvme": math.nan}
    out = {}
    for tier, u in used.items():
        out[tier] = {
            "used_bytes": float(u),
            "capacity_bytes": capacity[tier],
            "peak_bytes": float(u + MIB),
            "param_bytes": u / 2,
            "grad_bytes": u / 4,
            "optimizer_bytes": u / 8,
            "other_bytes": u / 8,
        }
    return out


def readings(run: str, step: int) -> dict[str, float]:
    """The memory_hierarchy/readings vector of ``run`` at ``step`` (NVML absent: NaN)."""
    t = tiers(run, step)
    return {
        "framework_device_bytes": t["device"]["used_bytes"],
        "framework_device_peak_bytes": t["device"]["peak_bytes"],
        "process_rss_bytes": t["host"]["used_bytes"] + 100 * MIB,
        "nvme_disk_bytes": t["nvme"]["used_bytes"],
    }


def write_run(logdir: str, run: str, steps: range) -> None:
    """Append ``steps`` of ``run`` to ``logdir/run`` (run_info at step 0)."""
    writer = SummaryWriter(os.path.join(logdir, run))
    try:
        for step in steps:
            if step == 0:
                writer.json(metadata.TAG_RUN_INFO, 0, run_info(run), wall_time=wall_time(0))
            writer.matrix(metadata.TAG_TIERS, step, tiers(run, step), wall_time=wall_time(step))
            writer.vector(
                metadata.TAG_READINGS, step, readings(run, step), wall_time=wall_time(step)
            )
    finally:
        writer.close()


def write_logdir(logdir: str) -> str:
    """Write every run of :data:`RUNS` with :data:`NUM_STEPS` steps; returns ``logdir``."""
    for run in RUNS:
        write_run(logdir, run, range(NUM_STEPS))
    return logdir
