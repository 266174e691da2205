"""OOM advice benchmark: are the post-mortem's "fits" suggestions right?

Each scenario is a real subprocess run of ``python -m demo.train`` with a tiny GPT
(``--d-model 32 --layers 1 --seq-len 32 --batch-size 4``, 2 CPU replicas, a few steps) and
a config that runs out of memory: stages 0-3, the device tier (the runtime's accounting
with the plain CPU allocator, or the BFC allocator's reading), the host tier (a
``host_budget_bytes`` of a few pages), the NVMe tier (a ``nvme_budget_bytes`` of one page),
budgets just below the need, a stage-3 unit larger than the budget, and the host's
available memory below the runtime's margin (``ZERO_RUNTIME_HOST_MARGIN_BYTES``).

For each scenario that did run out of memory the benchmark reads
``memory_hierarchy_oom.json``, applies the report's top suggestion labelled ``fits``
(``advice[].verdict == "fits"``, else ``advice[].fits``) as ``--set KEY=VALUE`` overrides and
reruns the same job:

- precision = suggestions labelled "fits" that completed / suggestions labelled "fits";
- recall = scenarios with a "fits" suggestion / scenarios where some suggestion fits, where
  "some suggestion fits" is known from the labelled one that completed, or (no "fits"
  label) from rerunning the top "may fit" suggestion.

Writes ``bench/results/oom_advice.json`` (date, machine, per-scenario rows). Goal:
precision 100%.

    python bench/bench_oom_advice.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "results", "oom_advice.json")
STEPS = 4
JOB = [
    "--steps", str(STEPS), "--d-model", "32", "--layers", "1", "--seq-len", "32",
    "--batch-size", "4", "--corpus-bytes", "65536",
]  # fmt: skip
PAGE = 65536  # the pool's smallest page
WIDE = ["--d-model", "128"]  # stage 3: the embedding (288 x 128 fp32) spans 3 pages
# The tiny GPT's parameters (Ψ): embedding 256 x 32 + one block + the head; the
# runtime's accounting of the device tier over both replicas (fp32 Adam, SC20 §5.1):
# stage 0: 2 x 16 Ψ, stage 1: 2 x (4 + 4 + 4) Ψ, stage 2: 2 x (4 + 2 + 4) Ψ.
PSI = 30_432


# Device-tier scenarios: (stage, offload_optimizer or None for the demo's default, the
# runtime's device accounting in bytes per Ψ over both replicas, the readings to fail).
DEVICE_SCENARIOS = (
    (0, None, 32, ("accounting", "allocator")),
    (1, "none", 24, ("accounting", "allocator")),
    (2, "none", 20, ("accounting", "allocator")),
    (2, "cpu", 12, ("accounting",)),
)
# How the device tier is read: reading -> (BFC allocator on, budget / accounted need). The
# runtime's accounting (plain CPU allocator) fails just below its need; the BFC
# allocator's reading also holds TensorFlow's own buffers, so it fails above it.
DEVICE_READINGS = {"accounting": (False, 0.95), "allocator": (True, 1.1)}


def overrides(change: dict) -> list[str]:
    """``--set`` arguments applying a config ``change`` (an advice's, or a scenario's)."""
    return [a for k, v in change.items() for a in ("--set", f"{k}={json.dumps(v)}")]


def _s(**kv) -> list[str]:
    """``overrides`` of keyword arguments (the scenario table's shorthand)."""
    return overrides(kv)


def device_scenarios(base: dict) -> list[dict]:
    """The device-tier scenarios of ``DEVICE_SCENARIOS``, by reading then by table row."""
    out = []
    for reading, (bfc, factor) in DEVICE_READINGS.items():
        for stage, offload, per_psi, readings in DEVICE_SCENARIOS:
            if reading not in readings:
                continue
            keys = {**base, "stage": stage}
            if offload is not None:
                keys["offload_optimizer"] = offload
            keys["device_budget_bytes"] = int(factor * per_psi * PSI)
            cpu = "cpu-" if offload == "cpu" else ""
            name = f"s{stage}-{cpu}device-{reading}"
            out.append(dict(name=name, bfc=bfc, tier="device", args=overrides(keys)))
    return out


def scenarios(nvme: str) -> list[dict]:
    """The OOM scenarios: name, extra demo arguments, BFC allocator on/off, expected tier."""
    base = {"page_size_bytes": PAGE}
    return device_scenarios(base) + [
        dict(name="s3-unit-over-budget", bfc=False, tier="device",
             args=WIDE + _s(**base, stage=3, offload_param="cpu", offload_optimizer="cpu",
                     persistence_threshold=0, device_budget_bytes=4 * PAGE)),
        dict(name="s3-device-just-below", bfc=False, tier="device",
             args=WIDE + _s(**base, stage=3, offload_param="none", offload_optimizer="none",
                     persistence_threshold=0, device_budget_bytes=4 * PAGE)),
        dict(name="s1-nvme-full", bfc=False, tier="nvme",
             args=_s(**base, stage=1, offload_optimizer="nvme", nvme_path=nvme,
                     nvme_budget_bytes=PAGE)),
        dict(name="s3-host-full-nvme", bfc=False, tier="host",
             args=_s(**base, stage=3, offload_param="cpu", offload_optimizer="cpu",
                     persistence_threshold=0, nvme_path=nvme, host_budget_bytes=2 * PAGE)),
        dict(name="s1-host-memory-low", bfc=False, tier="host",
             env={"ZERO_RUNTIME_HOST_MARGIN_BYTES": str(1 << 50)},
             args=_s(**base, stage=1, offload_optimizer="cpu")),
        dict(name="s3-host-full", bfc=False, tier="host",
             args=WIDE + _s(**base, stage=3, offload_param="cpu", offload_optimizer="cpu",
                     persistence_threshold=0, host_budget_bytes=4 * PAGE)),
    ]  # fmt: skip


def run_demo(
    logdir: str, args: list[str], bfc: bool, extra_env: dict | None = None
) -> tuple[int, float, str]:
    """Run the demo once: (exit status, seconds, stderr tail)."""
    env = dict(
        os.environ,
        **(extra_env or {}),
        TF_CPU_ALLOCATOR_USE_BFC="true" if bfc else "false",
        TF_CPP_MIN_LOG_LEVEL="2",
        ZERO_RUNTIME_PROFILE_EVERY="0",
        PYTHONPATH=ROOT,
    )
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "demo.train", "--logdir", logdir, *JOB, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    return proc.returncode, time.time() - t0, proc.stderr[-1500:]


def verdict(a: dict) -> str:
    """An advice row's label: its ``verdict``, else "fits"/"does not fit" from ``fits``."""
    return a.get("verdict") or ("fits" if a.get("fits") else "does not fit")


def run_scenario(sc: dict, work: str) -> dict:
    """One scenario: the failing run, its report's advice, the rerun of the chosen change."""
    logdir = os.path.join(work, sc["name"])
    rc, secs, err = run_demo(logdir, sc["args"], sc["bfc"], sc.get("env"))
    path = os.path.join(logdir, "gpt_zero1", "memory_hierarchy_oom.json")
    row = {"name": sc["name"], "bfc": sc["bfc"], "args": sc["args"], "exit": rc,
           "seconds": round(secs, 1)}  # fmt: skip
    if rc != 1 or not os.path.exists(path):
        row["error"] = "did not run out of memory" if rc == 0 else err
        return row
    report = json.load(open(path, encoding="utf-8"))
    row["tier"] = report["failed_request"]["tier"]
    row["expected_tier"] = sc["tier"]
    row["summary"] = report["summary"]
    row["advice"] = [
        {"change": a["change"], "verdict": verdict(a), "missing_bytes": a.get("missing_bytes")}
        for a in report["advice"]
    ]
    fits = [a for a in report["advice"] if verdict(a) == "fits"]
    may = [a for a in report["advice"] if verdict(a) == "may fit"]
    chosen = fits[0] if fits else (may[0] if may else None)
    if chosen is None:
        row["labelled"] = None
        return row
    row["labelled"] = verdict(chosen)
    row["applied"] = chosen["change"]
    rc2, secs2, err2 = run_demo(
        os.path.join(work, sc["name"] + "-rerun"), sc["args"] + overrides(chosen["change"]),
        sc["bfc"], sc.get("env"),
    )  # fmt: skip
    row["rerun_exit"] = rc2
    row["rerun_seconds"] = round(secs2, 1)
    row["rerun_fit"] = rc2 == 0
    if rc2 not in (0, 1):
        row["rerun_error"] = err2
    return row


def main() -> None:
    """Run the scenarios (all, or ``--only``), write ``OUT``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", default=OUT)
    opts = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="oom-advice-") as work:
        nvme = os.path.join(work, "nvme")
        os.makedirs(nvme)
        for sc in scenarios(nvme):
            if opts.only and sc["name"] not in opts.only:
                continue
            row = run_scenario(sc, work)
            print(
                json.dumps(
                    {
                        k: row.get(k)
                        for k in ("name", "tier", "labelled", "applied", "rerun_fit", "error")
                    }
                ),
                flush=True,
            )
            rows.append(row)
    ooms = [r for r in rows if "tier" in r]
    labelled = [r for r in ooms if r.get("labelled") == "fits"]
    correct = [r for r in labelled if r.get("rerun_fit")]
    some_fit = [r for r in ooms if r.get("rerun_fit")]
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },  # fmt: skip
        "job": JOB,
        "scenarios": len(rows),
        "ooms": len(ooms),
        "distinct_failures": sorted({(r["tier"], r["name"].split("-")[0]) for r in ooms}),
        "fits_labelled": len(labelled),
        "fits_that_fit": len(correct),
        "precision": len(correct) / len(labelled) if labelled else None,
        "scenarios_where_a_suggestion_fits": len(some_fit),
        "recall": len(correct) / len(some_fit) if some_fit else None,
        "precision_goal": 1.0,
        "precision_met": bool(labelled) and len(correct) == len(labelled),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
