"""Step time of ZeRO stages 1 and 2 vs MirroredStrategy on the same model and data.

One process, 2 replicas (logical CPU devices on a CPU-only host). Each configuration
trains the same Keras model (embedding + MLP, ~2.1M parameters) with Adam on the same
data. Every configuration's model is built and warmed up first (tracing); then the
configurations are measured *interleaved*: ``--rounds`` rounds, each fitting every
configuration for ``--steps`` steps (in alternating order), so load from other processes
on a shared machine falls on all of them alike. A step's time is its wall time measured by
a Keras callback (the first step of each fit call is dropped: it starts the iterator); a
configuration's figure is the median over all its steps. Ratios are each configuration's
median over MirroredStrategy's (stock Keras Adam, given dense gradients as the parity
references are). Goals: stage 1 and stage 2 (with and without ``overlap_comm``) without
offload <= 1.10, and stage 2 with overlap <= stage 2 without; stage 2 with cpu offload
<= 1.5.

With the default ``reduce_bucket_size`` (5e8 elements) the model's gradients form one
bucket, so ``overlap_comm`` has nothing to overlap: the two stage-2 graphs differ only by
control dependencies, and their difference is measurement noise. The ``*_buckets``
configurations use 4 buckets, where overlap can start a bucket's reduce-scatter during the
backward pass.

Writes ``bench/results/step_time.json`` (with the load average before and after: the
machine may be shared).

Usage: ``.venv/bin/python bench/bench_step_time.py [--rounds R] [--steps N] [--batch B]``
"""

from __future__ import annotations

# isort: skip_file  (the environment must be set before TensorFlow is imported)
import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# No sampled profiler traces: a trace a runtime starts at one of its step ends stays on
# until its next step ends, i.e. over the other configurations' interleaved steps (the
# sampled step itself, 1 in 50 by default, is outside the medians anyway).
os.environ.setdefault("ZERO_RUNTIME_PROFILE_EVERY", "0")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import _checkout  # noqa: E402, F401  (this checkout's zero_runtime, not the editable install's)

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
    "stage2_buckets": {"stage": 2, "offload_optimizer": "none", "reduce_bucket_size": 600_000},
    "stage2_buckets_no_overlap": {
        "stage": 2,
        "offload_optimizer": "none",
        "reduce_bucket_size": 600_000,
        "overlap_comm": False,
    },
}
GOALS = {"stage1": 1.10, "stage2": 1.10, "stage2_no_overlap": 1.10, "stage2_cpu": 1.5}
#: (with overlap, without): the first's median step must not exceed the second's.
OVERLAP_PAIRS = (("stage2", "stage2_no_overlap"), ("stage2_buckets", "stage2_buckets_no_overlap"))


def build_model(width: int = 768) -> keras.Model:
    """Embedding (2000 x 64) + 4 dense layers (3 of ``width``): about 2.1M float32
    parameters at the default width 768, 10.6M at 2048."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 64),  # (B, 16, 64)
            keras.layers.Flatten(),  # (B, 1024)
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


class _StepTimer(keras.callbacks.Callback):
    """Per step: wall seconds (``times``) and this process's CPU seconds, all threads
    (``cpu_times``)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._t = self._c = 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self._c = time.process_time()
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._t)
        self.cpu_times.append(time.process_time() - self._c)


def _data(steps: int, batch: int) -> tf.data.Dataset:
    rng = np.random.RandomState(0)
    x = rng.randint(0, VOCAB, size=(steps * batch, SEQ)).astype("int32")
    y = (x.sum(axis=1) % 10).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).prefetch(2)


def build_trained(strategy, make_optimizer, ds: tf.data.Dataset, width: int = 768) -> keras.Model:
    """The bench model (``build_model(width)``) compiled under ``strategy`` and warmed up
    (traced) on 3 steps."""
    with strategy.scope():
        model = build_model(width)
        model.compile(
            optimizer=make_optimizer(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(ds.take(3), verbose=0)  # trace + warm up
    return model


def time_steps(model: keras.Model, ds: tf.data.Dataset) -> list[float]:
    """Per-step seconds of one fit over ``ds``, without its first step."""
    timer = _StepTimer()
    model.fit(ds, verbose=0, callbacks=[timer])
    return timer.times[1:]


INTERLEAVED_NOTE = (
    "configurations measured interleaved in one process; a load average above ~1 means "
    "other processes shared the 2 cores during the run"
)


def interleaved_parser(description: str, rounds: int, steps: int, batch: int):
    """The argument parser of a bench that times configurations interleaved: ``--rounds``
    (default ``rounds``), ``--steps`` per configuration per round (``steps``) and the
    global ``--batch`` (``batch``); a bench adds its own arguments to it."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--steps", type=int, default=steps, help="steps per configuration per round")
    ap.add_argument("--batch", type=int, default=batch)
    return ap


def run_header(load_before: tuple[float, ...], note: str = INTERLEAVED_NOTE) -> dict:
    """The first keys of every results file: UTC ``date``, ``nproc``, the 1/5/15-minute
    load averages before the run (``load_before``, from ``os.getloadavg()``) and now,
    and ``note``."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "note": note,
    }


def main() -> None:
    """Build every configuration, measure them interleaved and write the results file."""
    args = interleaved_parser(__doc__.splitlines()[0], 12, 9, 64).parse_args()
    load_before = os.getloadavg()
    ds = _data(args.steps, args.batch)
    mirrored = tf.distribute.MirroredStrategy(list(DEVICES.devices))
    models = {"mirrored": build_trained(mirrored, lambda: DenseGradAdam(1e-3), ds)}
    strategies = []
    for name, cfg in CONFIGS.items():
        strategy = zero_runtime.ZeroInfinityStrategy(cfg)
        strategies.append(strategy)
        models[name] = build_trained(strategy, lambda: keras.optimizers.get("adam"), ds)
    names = list(models)
    times: dict[str, list[float]] = {n: [] for n in names}
    mirrored_halves: list[list[float]] = [[], []]
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            t = time_steps(models[name], ds)
            times[name] += t
            if name == "mirrored":
                mirrored_halves[2 * r // args.rounds] += t
    for strategy in strategies:
        strategy.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["mirrored"]
    ratios = {k: v / base for k, v in medians.items() if k != "mirrored"}
    result = {
        **run_header(load_before),
        "replicas": len(DEVICES.devices),
        "devices": list(DEVICES.devices),
        "model_params": build_model().count_params(),
        "global_batch": args.batch,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "timed_steps_per_config": len(times["mirrored"]),
        "median_step_seconds": medians,
        "mirrored_baseline_seconds": base,
        # Noise estimate: Mirrored's median over the first and the second half of rounds.
        "mirrored_half_medians": [statistics.median(h) for h in mirrored_halves if h],
        "ratios_vs_mirrored": ratios,
        "goals": GOALS,
        "goals_met": {k: ratios[k] <= g for k, g in GOALS.items()},
        "overlap_not_slower": {f"{a}<={b}": medians[a] <= medians[b] for a, b in OVERLAP_PAIRS},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
