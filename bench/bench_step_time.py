"""Step time of ZeRO stages 1 and 2 vs MirroredStrategy on the same model and data.

One process, 2 replicas (logical CPU devices on a CPU-only host). Each configuration
trains the same Keras model (embedding + MLP, ~2.2M parameters) with Adam on the same
data: one warm-up epoch (tracing), then ``--steps`` timed steps; the step time is the
median of per-step wall times measured by a Keras callback. Ratios are each
configuration's median over MirroredStrategy's (stock Keras Adam, given dense
gradients as the parity references are). Goals: stage 1 and stage 2 without offload
<= 1.10; stage 2 with cpu offload <= 1.5.

Writes ``bench/results/step_time.json``.

Usage: ``.venv/bin/python bench/bench_step_time.py [--steps N] [--batch B]``
"""

from __future__ import annotations

# isort: skip_file  (the environment must be set before TensorFlow is imported)
import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from zero_runtime.devices import local_devices  # noqa: E402

DEVICES = local_devices(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import zero_runtime  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.reference_optimizers import DenseGradAdam  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "step_time.json"
VOCAB, SEQ = 2000, 16

CONFIGS = {
    "stage1": {"stage": 1, "offload_optimizer": "none"},
    "stage1_cpu": {"stage": 1, "offload_optimizer": "cpu"},
    "stage2": {"stage": 2, "offload_optimizer": "none"},
    "stage2_no_overlap": {"stage": 2, "offload_optimizer": "none", "overlap_comm": False},
    "stage2_cpu": {"stage": 2, "offload_optimizer": "cpu"},
}
GOALS = {"stage1": 1.10, "stage2": 1.10, "stage2_cpu": 1.5}


def build_model() -> keras.Model:
    """Embedding (2000 x 64) + 3 dense layers of 768: about 2.2M float32 parameters."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 64),  # (B, 16, 64)
            keras.layers.Flatten(),  # (B, 1024)
            keras.layers.Dense(768, activation="relu"),
            keras.layers.Dense(768, activation="relu"),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(768, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


class _StepTimer(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._t)


def time_config(strategy, make_optimizer, steps: int, batch: int) -> list[float]:
    """Per-step seconds of ``steps`` steps after a warm-up epoch."""
    rng = np.random.RandomState(0)
    x = rng.randint(0, VOCAB, size=(steps * batch, SEQ)).astype("int32")
    y = (x.sum(axis=1) % 10).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).prefetch(2)
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=make_optimizer(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(ds.take(3), verbose=0)  # trace + warm up
    timer = _StepTimer()
    model.fit(ds, verbose=0, callbacks=[timer])
    return timer.times


def main() -> None:
    """Run every configuration and write the results file."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    mirrored = tf.distribute.MirroredStrategy(list(DEVICES.devices))
    medians = {}
    times = {}
    times["mirrored"] = time_config(mirrored, lambda: DenseGradAdam(1e-3), args.steps, args.batch)
    for name, cfg in CONFIGS.items():
        strategy = zero_runtime.ZeroInfinityStrategy(cfg)
        times[name] = time_config(
            strategy, lambda: keras.optimizers.get("adam"), args.steps, args.batch
        )
        strategy.close()
    # A second Mirrored measurement at the end: the machine is shared, so the spread
    # between the two is a noise estimate.
    times["mirrored_again"] = time_config(
        mirrored, lambda: DenseGradAdam(1e-3), args.steps, args.batch
    )
    for name, t in times.items():
        medians[name] = statistics.median(t)
    base = statistics.median(times["mirrored"] + times["mirrored_again"])
    ratios = {k: v / base for k, v in medians.items() if not k.startswith("mirrored")}
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "replicas": len(DEVICES.devices),
        "devices": list(DEVICES.devices),
        "model_params": build_model().count_params(),
        "global_batch": args.batch,
        "timed_steps": args.steps,
        "median_step_seconds": medians,
        "mirrored_baseline_seconds": base,
        "ratios_vs_mirrored": ratios,
        "goals": GOALS,
        "goals_met": {k: ratios[k] <= g for k, g in GOALS.items()},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
