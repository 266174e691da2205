"""Stage 3's device step peak per parameter, untiled, tiled and with activation
checkpointing: how far memory-centric tiling and checkpointing lower it under one device
budget.

Family: ``bench_max_model.family_config(k)`` (``demo.model.build_gpt``, ``d_model = 64 k``,
``2 k`` blocks, batch 4 x 32 tokens, Adam), built inside ``strategy.zero_init()``, stage 3
with parameters on NVMe and optimizer states on the host, 64 KiB pages, the pool's device
budget 64 MiB (a quarter of bench_max_model's 256 MiB, as there; a step whose device plan
exceeds it is refused: zero_runtime/stage3/device_plan.py). Three configurations per
``k``, each one training step in a fresh process with the BFC allocator
(``TF_CPU_ALLOCATOR_USE_BFC=true``; the step's allocator peak over both replicas, as
bench_max_model measures it):

- ``units``: the GPT, run by units (zero_runtime/stage3/gather.py), each unit's gradient
  shard handed to the host optimizer during backward, ``tile_size`` None (no tiling);
- ``units_tiled``: the same, ``tile_size='auto'``, from the budget (64 MiB // 128 = 524288
  elements: from k = 6 on, the MLP kernels and the head tile).
- ``units_tiled_ckpt``: the same with ``activation_checkpointing`` (each transformer
  block keeps only its input and is recomputed in backward,
  zero_runtime/stage3/checkpointing.py).

Trials run interleaved (k-major, the three configurations in turn) so machine load falls
on all alike; the figure compared is bytes of allocator peak per parameter. Writes
``bench/results/units_peak.json`` with the date, machine and load average.

Usage: ``.venv/bin/python bench/bench_units_peak.py [--ks 4,6] [--timeout 900]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_max_model import family_config, machine  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "units_peak.json"
MODES = ("units", "units_tiled", "units_tiled_ckpt")
POOL_DEVICE_BYTES = 64 << 20
MIB = 1 << 20


def run_trial(spec: dict) -> dict:
    """One training step of family member ``spec['k']`` in configuration ``spec['mode']``
    (runs in its own process); returns bytes and seconds."""
    sys.path.insert(0, str(ROOT))
    from zero_runtime.devices import local_devices

    local_devices(2)
    import keras
    import numpy as np
    import tensorflow as tf

    import zero_runtime
    from demo.model import GPTConfig, build_gpt
    from zero_runtime.telemetry.collector import TelemetryCollector

    TelemetryCollector.reset_peak_each_step = False  # peaks over whole steps
    cfg = GPTConfig(**family_config(spec["k"]))
    mode = spec["mode"]
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 3,
            "offload_param": "nvme",
            "offload_optimizer": "cpu",
            "nvme_path": spec["nvme_path"],
            "page_size_bytes": 65536,
            "device_budget_bytes": POOL_DEVICE_BYTES,
            "persistence_threshold": 0,
            "max_reuse_distance": 0,
            "collective_timeout_seconds": spec["timeout"],
            "tile_size": "auto" if mode.startswith("units_tiled") else None,
            "activation_checkpointing": mode == "units_tiled_ckpt",
        }
    )
    with strategy.zero_init():
        model = build_gpt(cfg, seed=0)
    with strategy.scope():
        sharded = strategy.shard_model(model)
        sharded.compile(
            optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    engine = strategy.runtime.accounting.stage3_engines[0]
    x = np.random.RandomState(0).randint(0, cfg.vocab_size, (4, cfg.seq_len + 1)).astype("int32")
    tf.config.experimental.reset_memory_stats("CPU:0")
    t0 = time.perf_counter()
    sharded.fit(x[:, :-1], x[:, 1:], batch_size=4, verbose=0)
    seconds = time.perf_counter() - t0
    peak = int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    params = int(sum(math.prod(w.shape) for w in model.trainable_weights))
    out = {
        "params": params,
        "step_peak_bytes": peak,
        "peak_bytes_per_param": round(peak / params, 2),
        "step_seconds_with_trace": round(seconds, 1),
        "device_plan_bytes": engine.device_plan.total,
        "tiled_layers": len(engine.tile_plans),
    }
    strategy.close()
    return out


def main() -> None:
    """Run the trials interleaved and write the results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="4,6", help="family members, comma-separated")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per trial")
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        print("TRIAL " + json.dumps(run_trial(json.loads(args.trial))), flush=True)
        return
    load_before = os.getloadavg()
    trials = []
    t0 = time.perf_counter()
    for k in [int(s) for s in args.ks.split(",")]:
        for mode in MODES:
            with tempfile.TemporaryDirectory(prefix="units_peak_") as nvme:
                spec = {"k": k, "mode": mode, "nvme_path": nvme, "timeout": args.timeout}
                env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
                proc = subprocess.run(
                    [sys.executable, __file__, "--trial", json.dumps(spec)],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TRIAL ")]
            rec = {"k": k, "mode": mode, "cfg": family_config(k)}
            if proc.returncode == 0 and lines:
                rec.update(json.loads(lines[-1][6:]))
            else:
                rec["error"] = " | ".join(proc.stderr.strip().splitlines()[-3:])
            rec["load_after"] = os.getloadavg()[0]
            print(json.dumps(rec), flush=True)
            trials.append(rec)
    result = {
        **machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "replicas": 2,
        "pool_device_budget_bytes": POOL_DEVICE_BYTES,
        "device_budget_bytes_of_max_model": 256 * MIB,
        "measure": "BFC allocator peak in-use bytes over one training step (both logical "
        "CPU replicas), fresh process per trial; bytes per parameter compared",
        "total_seconds": round(time.perf_counter() - t0, 1),
        "trials": trials,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
