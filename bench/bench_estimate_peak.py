"""The estimator's device peak against the allocator's measured in-step peak, on the demo.

Goal: the predicted device peak within 15% of the measured allocator peak on the demo at
stages 1-3. For each stage, in a fresh subprocess (the BFC CPU
allocator serves the device tier's CPU stand-in, ``TF_CPU_ALLOCATOR_USE_BFC=true``):
``demo.model.build_gpt`` (default ~137k-parameter config) under
``ZeroInfinityStrategy({"stage": s, "offload_optimizer": "none"})`` with 2 local replicas,
Adam, batch 8 x 64 tokens; one step traces, then the allocator's peak is reset and 3 more
steps train. Recorded per stage:

- ``measured_peak_bytes``: ``get_memory_info("CPU:0")["peak"]`` over the 3 steps (every
  tensor of both logical devices: variables, optimizer states, gradients, activations,
  collective buffers);
- ``measured_boundary_bytes``: ``["current"]`` after them;
- ``predicted_peak_bytes``: the estimator's in-step device peak for the 2 local
  replicas, ``estimator.estimate_for_model(..., accounting="sc21", batch_shape=(4, 64),
  loss=...)``: model states at the step boundary, the stage-3 working memory, and the
  activations the forward pass keeps for backward (``estimator.activation_bytes``,
  read from the traced training graph; at stage 3 with the engine's per-unit
  recompute);
- ``activation_bytes``: that activation term for the 2 replicas;
- ``sc21_bytes``: the same estimate without activations (model states + working memory);
- ``record_peak_bytes``: the runtime's ``memory_hierarchy/estimate`` record's
  ``per_process_peak.device_bytes`` (model states with the transient full gradient, no
  activations; None at stage 3);
- ``error``: predicted / measured - 1; the goal: |error| <= 15% at stages
  1-3 (``goal_met``).

Writes ``bench/results/estimate_peak.json``.

    python bench/bench_estimate_peak.py
"""

# isort: skip_file  (the environment must be set before TensorFlow is imported)
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "results", "estimate_peak.json")
REPLICAS = 2
BATCH, SEQ = 8, 64  # the global batch and tokens per sequence the trial trains on


def _trial(stage: int) -> dict:
    """Run in the subprocess: one stage's figures (see the module docstring)."""
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, ROOT)
    import keras
    import numpy as np
    import tensorflow as tf

    import zero_runtime
    from demo.model import build_gpt
    from zero_runtime import estimator
    from zero_runtime.devices import local_devices
    from zero_runtime.telemetry.collector import TelemetryCollector

    local_devices(REPLICAS)
    TelemetryCollector.reset_peak_each_step = False
    config = {"stage": stage, "offload_optimizer": "none"}
    strategy = zero_runtime.ZeroInfinityStrategy(config)
    if stage == 3:
        with strategy.zero_init():
            model = build_gpt(seed=0)
        with strategy.scope():
            model = strategy.shard_model(model)
    else:
        with strategy.scope():
            model = build_gpt(seed=0)
    with strategy.scope():
        model.compile(
            optimizer=zero_runtime.optim.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    tokens = np.random.RandomState(0).randint(0, 256, size=(32, SEQ + 1)).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((tokens[:, :-1], tokens[:, 1:])).batch(BATCH)
    model.fit(ds.take(1), verbose=0)
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.fit(ds.skip(1), verbose=0)
    info = tf.config.experimental.get_memory_info("CPU:0")
    record = strategy.runtime.estimate(model.optimizer) if stage < 3 else None
    shapes = build_gpt(seed=0) if stage == 3 else model
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss(y_pred):
        return ce(tf.zeros(y_pred.shape[:-1], tf.int32), y_pred)

    sc21 = estimator.estimate_for_model(
        shapes,
        strategy.config,
        REPLICAS,
        precision="fp32",
        optimizer="adam",
        accounting="sc21",
        batch_shape=(BATCH // REPLICAS, SEQ),
        loss=loss,
    )
    predicted = REPLICAS * sc21.tiers.device_bytes
    activations = REPLICAS * sc21.activation_bytes
    out = {
        "stage": stage,
        "params": int(sc21.num_params),
        "measured_peak_bytes": int(info["peak"]),
        "measured_boundary_bytes": int(info["current"]),
        "predicted_peak_bytes": int(predicted),
        "activation_bytes": int(activations),
        "sc21_bytes": int(predicted - activations),
        "sc21_working_set_bytes_per_replica": sc21.working_set_bytes,
        "record_peak_bytes": (record or {}).get("per_process_peak", {}).get("device_bytes"),
    }
    out["error"] = predicted / out["measured_peak_bytes"] - 1
    out["within_15_percent"] = abs(out["error"]) <= 0.15
    strategy.close()
    return out


def main() -> None:
    """Run every stage in its own process and write ``OUT``."""
    results = []
    for stage in (1, 2, 3):
        proc = subprocess.run(
            [sys.executable, __file__, "--trial", str(stage)],
            capture_output=True,
            text=True,
            check=False,
            cwd=ROOT,
        )
        if proc.returncode != 0:
            results.append({"stage": stage, "error": proc.stderr.strip().splitlines()[-5:]})
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "replicas": REPLICAS,
        "goal": "|predicted / measured - 1| <= 0.15 at stages 1-3",
        "goal_met": all(r.get("within_15_percent") for r in results),
        "results": results,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--trial":
        print(json.dumps(_trial(int(sys.argv[2]))))
    else:
        main()
