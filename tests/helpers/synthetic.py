"""Synthetic Memory Hierarchy event files with known values, for plugin and browser tests.

Written with the real write API, :class:`tb_plugin.summary.SummaryWriter`, so the tests
read what the runtime would write. Every value is a function of (run, step), so a test
can compute what the plugin must answer.
"""

from __future__ import annotations

import json
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
TRACED_STEP_SECONDS = 4.0  # the stand-in run's step 0, which traced its step function
# A run name that is also HTML: the view must show it as text and run nothing.
RUN_HTML_NAME = "beta <img src=x onerror=window.__xss=1>"
RUNS = (RUN_STANDIN, RUN_HTML_NAME)
# A variable name that is also HTML (in the beta run's placement).
HTML_VARIABLE = "<img src=x onerror=window.__xss=2>/kernel"
# Steps of each run's memory_hierarchy/config_event records.
CONFIG_EVENT_STEPS = {RUN_STANDIN: (10, 30), RUN_HTML_NAME: (20,)}
# The stand-in run failed with an out-of-memory error at its last step: its post-mortem
# (memory_hierarchy/oom and <run>/memory_hierarchy_oom.json, the shared OOM contract).
OOM_RUN = RUN_STANDIN
OOM_STEP = NUM_STEPS - 1
OOM_FILE = "memory_hierarchy_oom.json"
# A holder name that is also HTML: the OOM view must show it as text.
HTML_HOLDER = "<img src=x onerror=window.__xss=3>/activations"
OOM_RECENT_STEPS = 8  # steps in the post-mortem's flight-recorder window
# Checkpoint saves (memory_hierarchy/checkpoint) and restores
# (memory_hierarchy/checkpoint_restore) of each run: step -> op.
CHECKPOINT_OPS = {RUN_STANDIN: {15: "save", 35: "save"}, RUN_HTML_NAME: {25: "save", 45: "restore"}}
# A checkpoint tag that is also HTML (the beta run's save): the view must show it as text.
HTML_CHECKPOINT_TAG = "<b>ckpt</b>"
# Restarts and resizes of each run's job (zero-runtime launch --logdir: the events file
# tb_plugin.metadata.RESTARTS_FILE in the run's directory): resume step -> kind.
RESTART_STEPS = {
    RUN_STANDIN: {20: "restart", 30: "resize", 40: "resize"},
    RUN_HTML_NAME: {10: "restart"},
}
# A restart cause that is also HTML (the beta run's): the view must show it as text.
HTML_CAUSE = (
    "restart 1/3 after rank 0: exited with status 1: ValueError: <img src=x onerror=window.__xss=4>"
)


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


def pages(run: str, step: int) -> dict[str, float] | None:
    """The memory_hierarchy/pages vector of ``run`` at ``step``; None: not written.

    Only the stand-in run moves pages: h2d ``step % 4`` pages of 1 MiB, d2h ``step % 3``,
    h2n 1 page every 5th step, n2h none, 2 clean pages evicted to NVMe (no write) every
    7th step; prefetch hits ``3 * (step % 4)`` of ``3 * (step % 4) + 1`` prefetches; 2 ms
    of stall per miss.
    """
    if run != RUN_STANDIN:
        return None
    h2d, d2h, h2n = step % 4, step % 3, 1 if step % 5 == 0 else 0
    hits, misses = 3 * (step % 4), 1
    return {
        "d2h_pages": float(d2h),
        "d2h_bytes": float(d2h * MIB),
        "h2d_pages": float(h2d),
        "h2d_bytes": float(h2d * MIB),
        "h2n_pages": float(h2n),
        "h2n_bytes": float(h2n * MIB),
        "n2h_pages": 0.0,
        "n2h_bytes": 0.0,
        "evictions": float(d2h),
        "prefetch_hits": float(hits),
        "prefetch_misses": float(misses),
        "stall_seconds": 0.002 * misses,
        "io_seconds": 0.001 * (h2d + d2h + h2n),
        "h2n_clean_pages": 2.0 if step % 7 == 0 else 0.0,
        "h2n_clean_bytes": 2.0 * MIB if step % 7 == 0 else 0.0,
    }


def prefetch_hit_rate(run: str, step: int) -> float:
    """hits / (hits + misses) of ``run`` at ``step`` (the stand-in run only)."""
    p = pages(run, step)
    assert p is not None
    return p["prefetch_hits"] / (p["prefetch_hits"] + p["prefetch_misses"])


def timing(run: str, step: int) -> dict[str, float]:
    """The memory_hierarchy/timing vector of ``run`` at ``step`` (seconds).

    The stand-in run measures everything, and its step 0 traced the step function
    (:data:`TRACED_STEP_SECONDS`); the other run only ``step_seconds`` (the rest is NaN:
    not measured, as with the demo's stage-1 runtime).
    """
    step_seconds = 0.1 + 0.001 * step
    if run != RUN_STANDIN:
        return {"step_seconds": step_seconds}
    compute, comm, overlap, stall, io = 0.06, 0.04, 0.03, 0.002, 0.01
    return {
        "step_seconds": TRACED_STEP_SECONDS if step == 0 else step_seconds,
        "compute_seconds": compute,
        "comm_seconds": comm,
        "overlap_seconds": overlap,
        "stall_seconds": stall,
        "overlap_ratio": overlap / comm,
        "io_seconds": io,
        "traced": float(step == 0),
    }


def placement(run: str) -> dict:
    """The memory_hierarchy/placement object written at step 0 of ``run``."""
    variables = [
        ("dense/kernel", [512, 256], "host"),
        ("dense/bias", [256], "host"),
        ("embedding/embeddings", [1000, 512], "nvme"),
        ("lm_head/kernel", [512, 1000], "host"),
    ]
    if run == RUN_HTML_NAME:
        variables.append((HTML_VARIABLE, [8, 8], "host"))
    rows = []
    for name, shape, opt_tier in variables:
        size = math.prod(shape)
        rows.append(
            {
                "name": name,
                "shape": shape,
                "dtype": "float32",
                "bytes": 4 * size,
                "partitioning": "optimizer state sharded 1/2 (ZeRO-1)",
                "shard_bytes_per_replica": 4 * -(-size // 2),
                "param_tier": "device",
                "grad_tier": "device",
                "optimizer_tier": opt_tier,
            }
        )
    return {"variables": rows}


def estimate(run: str) -> dict | None:
    """The memory_hierarchy/estimate object of ``run`` (None: not written, beta run)."""
    if run != RUN_STANDIN:
        return None
    return {
        "per_replica": {"device_bytes": 50 * MIB, "host_bytes": 320 * MIB, "nvme_bytes": 0},
        "local_replicas": 2,
        "per_process": {"device_bytes": 100 * MIB, "host_bytes": 640 * MIB, "nvme_bytes": 0},
        "per_process_peak": {"device_bytes": 150 * MIB, "host_bytes": 640 * MIB, "nvme_bytes": 0},
        "num_params": 1_000_000,
        "precision": "fp32",
        "optimizer": "adam",
        "source": "synthetic",
    }


def config_event(run: str, step: int) -> dict:
    """The memory_hierarchy/config_event object of ``run`` at ``step``."""
    if run == RUN_HTML_NAME:
        return {"description": "<b>offload</b> optimizer to nvme", "key": "offload_optimizer"}
    return {"key": "prefetch_depth", "old": step // 10, "new": step // 10 + 1}


def oom_postmortem(run: str) -> dict | None:
    """The post-mortem of ``run``'s out-of-memory failure at :data:`OOM_STEP` (None: none).

    The device tier (256 MiB budget) holds 250 MiB when a 96 MiB page-in of the Adam
    moments fails; the advice ranks offloading the optimizer first (it frees 40 MiB and
    fits), raising the budget second, and a stage change that would not fit last.
    """
    if run != OOM_RUN:
        return None
    step = OOM_STEP
    recent = []
    for s in range(step - OOM_RECENT_STEPS + 1, step + 1):
        t = tiers(run, s)
        recent.append(
            {
                "step": s,
                "tiers": {
                    tier: {
                        "used_bytes": t[tier]["used_bytes"],
                        "capacity_bytes": None
                        if math.isnan(t[tier]["capacity_bytes"])
                        else t[tier]["capacity_bytes"],
                    }
                    for tier in metadata.TIERS
                },
            }
        )
    return {
        "version": 1,
        "step": step,
        "wall_time": wall_time(step),
        "failed_request": {
            "bytes": 96 * MIB,
            "tier": "device",
            "tensor": "adam/m/dense_kernel:shard1",
            "op": "page_in",
            "error_type": "PoolOutOfMemoryError",
            "message": "cannot place 96 pages of 1 MiB on device: 250 MiB of 256 MiB in use",
        },
        "tiers": {
            "device": {
                "capacity_bytes": 256 * MIB,
                "used_bytes": 250 * MIB,
                "holders": [
                    {"name": "params", "kind": "param", "bytes": 128 * MIB, "pages": 128},
                    {"name": "grads", "kind": "grad", "bytes": 64 * MIB, "pages": 64},
                    {"name": "adam/v", "kind": "optimizer", "bytes": 40 * MIB, "pages": 40},
                    {"name": HTML_HOLDER, "kind": "activation", "bytes": 18 * MIB, "pages": None},
                ],
            },
            "host": {
                "capacity_bytes": 4 * GIB,
                "used_bytes": 708 * MIB,
                "holders": [
                    {"name": "adam/m", "kind": "optimizer", "bytes": 708 * MIB, "pages": 708}
                ],
            },
            "nvme": {"capacity_bytes": None, "used_bytes": 0, "holders": []},
        },
        "recent_steps": recent,
        "config": run_info(run)["config"],
        "config_version": 2,
        "config_history": [config_event(run, s) for s in CONFIG_EVENT_STEPS[run]],
        "readings": {k: v for k, v in readings(run, step).items()},
        "advice": [
            {
                "rank": 2,
                "change": {"device_budget_bytes": 384 * MIB},
                "description": "Raise the device budget to 384 MiB",
                "frees_bytes": 0,
                "fits": True,
                "speed_cost": "none",
            },
            {
                "rank": 1,
                "change": {"offload_optimizer": "cpu"},
                "description": "Keep the optimizer states in host memory",
                "frees_bytes": 40 * MIB,
                "fits": True,
                "speed_cost": "low",
            },
            {
                "rank": 3,
                "change": {"stage": 3},
                "description": "Partition the parameters too (ZeRO stage 3)",
                "frees_bytes": 64 * MIB,
                "fits": False,
                "verdict": "may fit",
                "missing_bytes": 8 * MIB,
                "speed_cost": "medium",
            },
        ],
        "nothing_fits": False,
        "summary": (
            "Step 49 could not place 96 MiB of Adam moments on the device tier (CPU "
            "stand-in, 256 MiB budget, 250 MiB in use). Keeping the optimizer states in "
            "host memory would have freed 40 MiB and made it fit."
        ),
    }


def checkpoint(run: str, step: int) -> dict | None:
    """The checkpoint record of ``run`` at ``step`` (None: none; a save is written under
    ``memory_hierarchy/checkpoint``, a restore under ``memory_hierarchy/checkpoint_restore``), with
    the fields ``zero_runtime.checkpoint.CheckpointManager`` writes (docs/events.md):
    alpha saves 48 MiB in 0.25 s (step 15) and 0.5 s (step 35); beta saves 12 MiB in
    0.125 s (step 25, tag :data:`HTML_CHECKPOINT_TAG`) and restores 12 MiB in 0.0625 s
    (step 45, saved on 2 replicas)."""
    op = CHECKPOINT_OPS.get(run, {}).get(step)
    if op is None:
        return None
    alpha = run == RUN_STANDIN
    tag = f"step{step:08d}" if alpha else HTML_CHECKPOINT_TAG if op == "save" else "step00000045"
    record = {
        "op": op,
        "tag": tag,
        "path": f"/ckpt/{run[:4]}/{tag}",
        "step": step,
        "bytes": 48 * MIB if alpha else 12 * MIB,
        "seconds": (0.25 if step == 15 else 0.5) if alpha else 0.125 if op == "save" else 0.0625,
        "replicas": 2,
        "rank": 0,
    }
    if op == "restore":
        record["saved_replicas"] = 2
    return record


def goodput(run: str) -> dict:
    """The ``goodput`` of ``run``'s job at its end (the ``exit`` event): alpha kept 49 of
    52 steps, 24.5 s of 100 s; beta 49 of 50, 24.5 of 60 s."""
    alpha = run == RUN_STANDIN
    every = 52 if alpha else 50
    wall = 100.0 if alpha else 60.0
    return {
        "useful_steps": 49,
        "all_steps": every,
        "steps_ratio": round(49 / every, 4),
        "useful_seconds": 24.5,
        "wall_seconds": wall,
        "time_ratio": round(24.5 / wall, 4),
    }


def restart_events(run: str) -> list[dict]:
    """The events ``zero-runtime launch`` writes for ``run``'s job (docs/multiworker/restarts.md):
    alpha is killed at step 22 and resumes at 20 (2 steps, 15 s lost), shrinks 2 -> 1
    after its rank 1 is killed again (resumes at 30, 1 step lost) and grows back on
    SIGUSR1 (resumes at 40, nothing lost): 2 restarts, 2 resizes; beta restarts once at
    step 10 with the cause :data:`HTML_CAUSE`."""
    t0 = wall_time(0) - 10.0
    events = [
        {"event": "start", "time": t0, "attempt": 0, "nproc": 2, "ports": [1, 2]},
        {"event": "resume", "time": t0 + 10.0, "attempt": 0, "nproc": 2, "step": 0}
        | {"kind": None, "cause": None, "steps_lost": None, "seconds_lost": None}
        | {"restart_seconds": None, "goodput": None},
    ]
    nproc, restarts = 2, 0
    for attempt, (step, kind) in enumerate(sorted(RESTART_STEPS[run].items()), 1):
        lost = {20: 2, 30: 1, 40: 0, 10: 1}[step]
        when = wall_time(step)
        if kind == "restart" or nproc == 2:  # a failure first
            restarts += 1
            line = HTML_CAUSE if run == RUN_HTML_NAME else "after rank 1: killed by SIGKILL"
            cause = line if run == RUN_HTML_NAME else f"restart {restarts}/3 {line}"
            events.append(
                {"event": "restart", "time": when - 9.0, "restart": restarts, "max_restarts": 3}
                | {"rank": 1, "reported_by": 1, "pid": 100 + attempt, "exit_status": 137}
                | {"signal": "SIGKILL", "cause": "killed by SIGKILL", "uptime_seconds": 5.0}
                | {"last_step": step + lost}
            )
        if kind == "resize":
            reason = "asked (SIGUSR1)" if nproc == 1 else "rank 1 failed 2 time(s) in a row"
            events.append(
                {"event": "resize", "time": when - 9.0, "attempt": attempt, "from_nproc": nproc}
                | {"to_nproc": 3 - nproc, "reason": reason}
            )
            resize = f"resize {nproc} -> {3 - nproc} workers: {reason}"
            cause = resize if nproc == 1 else f"{cause}; {resize}"
            nproc = 3 - nproc
        events.append({"event": "start", "time": when - 8.0, "attempt": attempt, "nproc": nproc})
        events.append(
            {"event": "resume", "time": when, "attempt": attempt, "nproc": nproc, "step": step}
            | {"kind": kind, "cause": cause, "steps_lost": lost}
            | {"seconds_lost": 10.0 + 2.5 * lost, "restart_seconds": 9.0, "goodput": None}
        )
    final = goodput(run)
    events.append(
        {"event": "exit", "time": t0 + final["wall_seconds"], "status": 0, "restarts": restarts}
        | {"reason": "every worker exited 0", "goodput": final}
    )
    return events


def write_run(logdir: str, run: str, steps: range) -> None:
    """Append ``steps`` of ``run`` to ``logdir/run``.

    run_info, placement and estimate at step 0; tiers, readings, pages (stand-in run
    only) and timing at every step; config events at :data:`CONFIG_EVENT_STEPS`; the
    stand-in run's out-of-memory post-mortem at :data:`OOM_STEP` (tag and file);
    checkpoint records at :data:`CHECKPOINT_OPS` (:func:`checkpoint`; the tag per op);
    with the last step, the job's restart events file (:func:`restart_events`).
    """
    writer = SummaryWriter(os.path.join(logdir, run))
    try:
        for step in steps:
            wall = wall_time(step)
            if step == 0:
                writer.json(metadata.TAG_RUN_INFO, 0, run_info(run), wall_time=wall)
                writer.json(metadata.TAG_PLACEMENT, 0, placement(run), wall_time=wall)
                est = estimate(run)
                if est is not None:
                    writer.json(metadata.TAG_ESTIMATE, 0, est, wall_time=wall)
            writer.matrix(metadata.TAG_TIERS, step, tiers(run, step), wall_time=wall)
            writer.vector(metadata.TAG_READINGS, step, readings(run, step), wall_time=wall)
            page = pages(run, step)
            if page is not None:
                writer.vector(metadata.TAG_PAGES, step, page, wall_time=wall)
            writer.vector(metadata.TAG_TIMING, step, timing(run, step), wall_time=wall)
            if step in CONFIG_EVENT_STEPS.get(run, ()):
                writer.json(
                    metadata.TAG_CONFIG_EVENT, step, config_event(run, step), wall_time=wall
                )
            ckpt = checkpoint(run, step)
            if ckpt is not None:
                tag = metadata.CHECKPOINT_OP_TAGS[ckpt["op"]]  # restores: their own tag
                writer.json(tag, step, ckpt, wall_time=wall)
            postmortem = oom_postmortem(run) if step == OOM_STEP else None
            if postmortem is not None:
                writer.json(metadata.TAG_OOM, step, postmortem, wall_time=wall)
                with open(os.path.join(logdir, run, OOM_FILE), "w", encoding="utf-8") as fh:
                    json.dump(postmortem, fh, allow_nan=False)
            if step == NUM_STEPS - 1:
                path = os.path.join(logdir, run, metadata.RESTARTS_FILE)
                with open(path, "w", encoding="utf-8") as fh:
                    fh.writelines(json.dumps(e) + "\n" for e in restart_events(run))
    finally:
        writer.close()


def write_logdir(logdir: str) -> str:
    """Write every run of :data:`RUNS` with :data:`NUM_STEPS` steps; returns ``logdir``."""
    for run in RUNS:
        write_run(logdir, run, range(NUM_STEPS))
    return logdir
