"""The fault test of a job that heals itself: a 2-worker ZeRO stage-3 job with parameters
and optimizer states on NVMe takes 10 kill -9 of a random worker at random steps and 5
SIGTERMs under ``zero-runtime launch --max-restarts 20``.

The job is tests/helpers/heal_job.py (the tiny model of tests/helpers/checkpoint_job.py,
``fit`` with ``ZeroBackupAndRestore(save_freq=--save-every)``, 2 workers x 1 CPU replica).
First the same job runs uninterrupted (the reference), then the faulted one: the 15 faults
in a seeded random order, one per worker group, each to a random rank a random 1-4 steps
after the group resumed (a kill right after a step line can land inside a backup's save).
Checked and written to ``bench/results/fault_heal.json``:

- ``finished``: the launcher exited 0 by itself after 15 restarts;
- ``bitwise``: its final weights equal the reference's bitwise;
- ``orphans``: processes left whose command line names this run's directories (0);
- ``checkpoints``: at every restart, ``latest`` named a complete checkpoint (every file its
  index lists, with its size and SHA-256) and no published checkpoint was incomplete;
  ``.tmp-*`` directories seen then (saves a kill cut short, never published; the next
  save removes them);
- ``nvme_bytes``: the NVMe directory's size at the start and the end;
- ``steps_lost`` per failure (a kill loses at most the steps since the last backup plus
  the step in flight; a preemption none), ``restart_seconds`` (failure -> the next
  group's first step) and the job's goodput, from the launcher's events
  (zero_runtime/launch/goodput.py): steps kept / steps run and seconds on kept steps /
  wall time (every TensorFlow start-up included).

Usage: ``.venv/bin/python bench/bench_fault_heal.py [--seed 42] [--epochs 12]``
(``--kills 1 --terms 1 --epochs 3 --out /tmp/x.json``: a quick check of the script)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from bench_restart import run_header

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "fault_heal.json"
JOB = ROOT / "tests" / "helpers" / "heal_job.py"
KILLS, TERMS = 10, 5
_STEP = re.compile(r"rank (\d) pid (\d+) attempt (\d+) step (\d+)")
_RESUMED = re.compile(r"rank 0 resumed at step (\d+)")
_START = re.compile(r"rank 0 pid \d+ attempt (\d+) start")


def _launch(work: Path, name: str, args: argparse.Namespace, *extra: str) -> subprocess.Popen:
    """``zero-runtime launch --nproc 2 EXTRA heal_job.py`` with ``work/<name>_{ckpt,out,nvme}``."""
    for d in ("out", "nvme"):
        (work / f"{name}_{d}").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "zero_runtime.cli", "launch", "--nproc", "2", *extra]
    cmd += ["--checkpoint-dir", str(work / f"{name}_ckpt"), str(JOB)]
    cmd += [str(work / f"{name}_out"), str(work / f"{name}_nvme"), "--save-every"]
    cmd += [str(args.save_every), "--epochs", str(args.epochs), "--per-epoch", "6"]
    cmd += ["--step-seconds", str(args.step_seconds)]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_checkpoints(root: Path) -> dict:
    """The checkpoint directory between two groups: whether ``latest`` names a complete
    checkpoint and every published one is complete (each file its index lists, with its
    size and SHA-256), and the ``.tmp-*`` directories present."""
    published, incomplete = [], []
    for entry in sorted(root.iterdir()) if root.exists() else []:
        index = entry / "index.json"
        if not entry.is_dir() or entry.name.startswith(".tmp-") or not index.exists():
            continue
        published.append(entry.name)
        files = json.loads(index.read_text())["files"]
        for name, rec in files.items():
            path = entry / name
            if not path.exists() or path.stat().st_size != rec["bytes"]:
                incomplete.append(f"{entry.name}/{name}")
            elif _sha256(path) != rec["sha256"]:
                incomplete.append(f"{entry.name}/{name} (checksum)")
    latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
    return {
        "latest": latest,
        "latest_complete": latest is None or (latest in published and not incomplete),
        "published": published,
        "incomplete": incomplete,
        "tmp_dirs": sorted(p.name for p in root.glob(".tmp-*")) if root.exists() else [],
    }


def run_faulted(work: Path, args: argparse.Namespace, faults: list[tuple[str, int, int]]):
    """Launch the job and apply ``faults`` (kind, rank, steps after the resume), one per
    group; returns what was observed."""
    job = _launch(
        work, "job", args, "--max-restarts", "20", "--preemption-grace", "30",
        "--logdir", str(work / "job_logs"),
    )  # fmt: skip
    pids: dict[tuple[int, int], int] = {}
    resumed = {0: 0}  # attempt -> the step it resumed at
    sent: list[dict] = []
    checks: list[dict] = []
    current, faulted = 0, -1  # the group running now, the last group a fault was sent to
    start = time.monotonic()
    try:
        for line in job.stdout:
            found = _START.search(line)
            if found:
                current = int(found.group(1))
            found = _RESUMED.search(line)
            if found:
                resumed[current] = int(found.group(1))
            if line.startswith("[launcher] restart "):
                checks.append(check_checkpoints(work / "job_ckpt"))
            found = _STEP.search(line)
            if not found:
                continue
            rank, pid, attempt, step = (int(g) for g in found.groups())
            pids[(attempt, rank)] = pid
            if attempt <= faulted or len(sent) >= len(faults):
                continue
            kind, target, after = faults[len(sent)]
            if step >= resumed.get(attempt, 0) + after and (attempt, target) in pids:
                sig = signal.SIGKILL if kind == "kill" else signal.SIGTERM
                os.kill(pids[(attempt, target)], sig)
                faulted = attempt
                sent.append({"kind": kind, "rank": target, "pid": pids[(attempt, target)]})
                sent[-1].update(attempt=attempt, step=step, resumed_at=resumed.get(attempt, 0))
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return job.returncode, time.monotonic() - start, pids, sent, checks


def orphans(work: Path) -> list[int]:
    """Live processes whose command line names a path under ``work``."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(str(work) in part for part in proc.info["cmdline"] or ()):
                found.append(proc.info["pid"])
        except psutil.Error:
            continue
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--epochs", type=int, default=12, help="epochs of 6 steps (default 12)")
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--kills", type=int, default=KILLS, help=f"kill -9 faults (default {KILLS})")
    p.add_argument("--terms", type=int, default=TERMS, help=f"SIGTERM faults (default {TERMS})")
    p.add_argument("--out", default=str(OUT), help="the result file")
    args = p.parse_args()
    rng = random.Random(args.seed)
    kinds = ["kill"] * args.kills + ["term"] * args.terms
    rng.shuffle(kinds)
    faults = [(kind, rng.randrange(2), rng.randint(1, 4)) for kind in kinds]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fault-heal-") as tmp:
        work = Path(tmp)
        t0 = time.monotonic()
        reference = _launch(work, "ref", args)
        ref_log, _ = reference.communicate(timeout=1800)
        ref_seconds = time.monotonic() - t0
        if reference.returncode != 0:
            print(ref_log[-4000:])
            raise SystemExit(f"the reference run failed with {reference.returncode}")
        (work / "job_nvme").mkdir()
        nvme_start = _dir_bytes(work / "job_nvme")
        status, seconds, pids, sent, checks = run_faulted(work, args, faults)
        time.sleep(1.0)
        left = orphans(work)
        alive = [pid for pid in pids.values() if psutil.pid_exists(pid)]
        nvme_end = _dir_bytes(work / "job_nvme")
        want = np.load(work / "ref_out" / "final.npz")
        final = work / "job_out" / "final.npz"
        got = np.load(final) if final.exists() else None
        bitwise = (
            got is not None
            and all(np.array_equal(got[k], want[k]) for k in want.files)
            and len(got.files) == len(want.files)
        )
        events = [json.loads(x) for x in (work / "job_ckpt" / "restarts.jsonl").open()]
    resumes = [e for e in events if e["event"] == "resume" and e["attempt"] > 0]
    restarts = [e for e in events if e["event"] == "restart"]
    final_event = events[-1]
    lost = [
        {"kind": e["kind"], "steps_lost": e["steps_lost"], "seconds_lost": e["seconds_lost"],
         "restart_seconds": e["restart_seconds"], "resumed_at": e["step"]}
        for e in resumes
    ]  # fmt: skip
    kills_lost = [x["steps_lost"] for x in lost if x["kind"] == "restart"]
    terms_lost = [x["steps_lost"] for x in lost if x["kind"] == "preemption"]
    restart_s = [x["restart_seconds"] for x in lost if x["restart_seconds"] is not None]
    result = {
        **run_header(load_before),
        "job": (
            f"tests/helpers/heal_job.py: ZeRO stage 3, parameters and optimizer states on "
            f"NVMe, 2 workers x 1 CPU replica, {args.epochs} epochs x 6 steps, "
            f"ZeroBackupAndRestore(save_freq={args.save_every}); zero-runtime launch "
            f"--max-restarts 20; {args.kills} kill -9 and {args.terms} SIGTERM, one per group, "
            f"to a random rank 1-4 steps after its resume (seed {args.seed})"
        ),
        "finished": status == 0,
        "exit_status": status,
        "restarts": len(restarts),
        "faults_sent": sent,
        "bitwise": bitwise,
        "orphans": len(left) + len(alive),
        "checkpoints": {
            "checked_at_restarts": len(checks),
            "latest_always_complete": all(c["latest_complete"] for c in checks),
            "incomplete_published": sorted({i for c in checks for i in c["incomplete"]}),
            "tmp_dirs_seen": sum(len(c["tmp_dirs"]) for c in checks),
        },
        "nvme_bytes": {"start": nvme_start, "end": nvme_end},
        "steps_lost": {
            "per_kill": kills_lost,
            "per_sigterm": terms_lost,
            "max_per_kill": max(kills_lost, default=None),
            "bound_per_kill": args.save_every + 1,
        },
        "restart_seconds": {
            "median": round(statistics.median(restart_s), 2) if restart_s else None,
            "max": round(max(restart_s), 2) if restart_s else None,
        },
        "goodput": final_event.get("goodput"),
        "job_wall_seconds": round(seconds, 1),
        "reference_wall_seconds": round(ref_seconds, 1),
        "failures": lost,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: result[k] for k in ("finished", "restarts", "bitwise", "orphans", "goodput")}
    print(json.dumps(summary | {"checkpoints": result["checkpoints"]}, indent=1))
    return 0 if result["finished"] and bitwise else 1


if __name__ == "__main__":
    sys.exit(main())
