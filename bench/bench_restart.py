"""Restart to first new step: how long a 2-worker demo job takes to train again after a
worker is killed, under ``zero-runtime launch --max-restarts``.

Each round launches the demo GPT (``demo/train.py``, its default model and ZeRO config)
as 2 workers x 1 CPU replica with ``--checkpoint-dir DIR --resume --checkpoint-every 5
--log-every 1``, lets it reach step ``--kill-at`` and SIGKILLs rank 1. The launcher sees
rank 1 die, stops rank 0 and starts a new group, which restores the last checkpoint and
trains the remaining steps. From the launcher's timestamped output:

- ``detect_seconds``: kill -> the launcher's line naming the dead rank;
- ``stop_seconds``: -> its ``restart 1/1`` line (the survivor stopped);
- ``startup_seconds``: restart -> both workers printed the model's size (Python and
  TensorFlow start, the cluster forms, the strategy and the model are built);
- ``restore_seconds``: -> both printed ``resumed from`` (the checkpoint restored);
- ``first_step_seconds``: -> the first step line of the new group (the step traced,
  compiled and run);
- ``restart_to_first_new_step_seconds`` (the sum of the last three) and
  ``kill_to_first_new_step_seconds``; the cold start of the first group (launch -> its
  first step) and ``python -c 'import tensorflow'`` alone, for scale;
- ``steps_lost``: steps trained before the kill that the new group trained again;
- ``goodput``: useful steps' time (the steps of the run x the median step time) / the
  job's wall time, start-ups included (a short job: start-ups dominate), and
  ``goodput_at_one_failure_per_hour``: 1 - (kill to first new step + the lost steps'
  time) / 3600 s, for a long job failing once an hour.

Writes ``bench/results/restart.json``.

Usage: ``.venv/bin/python bench/bench_restart.py [--rounds 2] [--steps 40] [--kill-at 12]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "restart.json"
_STEP = re.compile(r"^\[rank (\d)\] demo\.train: step (\d+)/")
_RESUMED = re.compile(r"^\[rank (\d)\] demo\.train: resumed from \S+ at step (\d+)")


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put((time.monotonic(), line.rstrip("\n")))
    lines.put((time.monotonic(), None))


def _worker_pid(launcher: int, rank: int) -> int:
    """The pid of the launcher's child with ``ZERO_RUNTIME_RANK=rank``."""
    for child in psutil.Process(launcher).children():
        try:
            if child.environ().get("ZERO_RUNTIME_RANK") == str(rank):
                return child.pid
        except psutil.Error:
            continue
    raise RuntimeError(f"no worker of rank {rank} under pid {launcher}")


def run_header(load_before: tuple[float, float, float]) -> dict:
    """A result's ``date``, ``machine`` (CPUs, processor, RAM bytes) and the load averages
    (1, 5, 15 min) ``load_average_before`` (given: taken at the start) and ``_after``."""
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "nproc": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(),
            "ram_bytes": psutil.virtual_memory().total,
        },
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def one_round(steps: int, kill_at: int, work: Path) -> dict:
    """One launch with one kill; the timeline in seconds (module docstring)."""
    ckpt, logs = work / "ckpt", work / "logs"
    cmd = [sys.executable, "-m", "zero_runtime.cli", "launch", "--nproc", "2"]
    cmd += ["--max-restarts", "1", "--checkpoint-dir", str(ckpt), str(ROOT / "demo" / "train.py")]
    cmd += ["--replicas", "1", "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--resume"]
    cmd += ["--checkpoint-every", "5", "--log-every", "1", "--logdir", str(logs)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t_launch = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    t: dict[str, float] = {}
    step_times: list[float] = []
    last_step_at, killed_step, resumed_step, params = None, None, None, set()
    while True:
        now, line = lines.get(timeout=600)
        if line is None:
            break
        step = _STEP.match(line)
        if step and "restart" not in t:
            n = int(step.group(2))
            t.setdefault("first_step_0", now)
            if last_step_at is not None and step.group(1) == "0":
                step_times.append(now - last_step_at)
            if step.group(1) == "0":
                last_step_at = now
            if n >= kill_at and "kill" not in t:
                os.kill(_worker_pid(proc.pid, 1), signal.SIGKILL)
                t["kill"], killed_step = time.monotonic(), n
        elif "[launcher] rank" in line and "exited with status" in line and "kill" in t:
            t.setdefault("detect", now)
        elif line.startswith("[launcher] restart 1/1"):
            t["restart"] = now
        elif "restart" in t and " parameters, ZeRO stage " in line:
            params.add(line[:8])
            if len(params) == 2:
                t["startup"] = now
        elif "restart" in t and _RESUMED.match(line):
            resumed_step = int(_RESUMED.match(line).group(2))
            t["restored"] = now
        elif "restart" in t and step:
            t.setdefault("first_new_step", now)
    proc.wait(timeout=60)
    wall = time.monotonic() - t_launch
    if proc.returncode != 0 or "first_new_step" not in t:
        raise RuntimeError(f"the job failed (status {proc.returncode}): {t}")
    median_step = statistics.median(step_times)
    return {
        "detect_seconds": round(t["detect"] - t["kill"], 2),
        "stop_seconds": round(t["restart"] - t["detect"], 2),
        "startup_seconds": round(t["startup"] - t["restart"], 2),
        "restore_seconds": round(t["restored"] - t["startup"], 2),
        "first_step_seconds": round(t["first_new_step"] - t["restored"], 2),
        "restart_to_first_new_step_seconds": round(t["first_new_step"] - t["restart"], 2),
        "kill_to_first_new_step_seconds": round(t["first_new_step"] - t["kill"], 2),
        "cold_start_to_first_step_seconds": round(t["first_step_0"] - t_launch, 2),
        "killed_after_step": killed_step,
        "resumed_at_step": resumed_step,
        "steps_lost": killed_step - resumed_step,
        "median_step_seconds": round(median_step, 4),
        "wall_seconds": round(wall, 2),
        "goodput": round(steps * median_step / wall, 3),
        # one such failure an hour costs its restart plus its lost steps
        "goodput_at_one_failure_per_hour": round(
            1
            - (t["first_new_step"] - t["kill"] + (killed_step - resumed_step) * median_step) / 3600,
            4,
        ),
    }


def tensorflow_import_seconds() -> float:
    """Seconds for a fresh ``python -c 'import tensorflow'``."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import tensorflow"], check=True, capture_output=True)
    return round(time.monotonic() - start, 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=12)
    args = p.parse_args()
    load_before = os.getloadavg()
    rounds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as work:
            rounds.append(one_round(args.steps, args.kill_at, Path(work)))
        print(f"round {i}: {json.dumps(rounds[-1])}", flush=True)
    keys = [k for k in rounds[0] if k.endswith("_seconds") or k.startswith("goodput")]
    result = {
        **run_header(load_before),
        "job": (
            f"demo/train.py defaults (GPT, ZeRO stage 1), 2 workers x 1 CPU replica, "
            f"{args.steps} steps, a checkpoint every 5; rank 1 SIGKILLed after step "
            f"{args.kill_at}; zero-runtime launch --max-restarts 1"
        ),
        "tensorflow_import_seconds": tensorflow_import_seconds(),
        "median": {k: round(statistics.median(r[k] for r in rounds), 4) for k in keys},
        "rounds": rounds,
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
