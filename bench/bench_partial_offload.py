"""Partial optimizer offload (``offload_optimizer_ratio``, DeepSpeed's Twin-Flow ratio):
step time between no offload and full offload, measured side by side in one run.

The model, data, replicas and interleaved measurement are those of
``bench/bench_step_time.py`` (``bench/_common.py``'s functions): for stages 1 and 2, the
configurations ``offload_optimizer='none'``, ``'cpu'`` with ratios 0.25, 0.5 and 0.75, and
``'cpu'`` (ratio 1.0), plus MirroredStrategy as the common baseline. Goal: each partial
run's median step lies between the no-offload and the full-offload runs'.

On a CPU-only host the "device" part of the update also runs on the CPU, so the gain of
updating both parts at once comes only from TensorFlow's inter-op parallelism (2 cores
here); on a GPU the device part runs on the accelerator while the host part runs on the
CPU (ZeRO-Offload++).

Each configuration's figures: median wall seconds per step and median process CPU
seconds per step (all threads; less sensitive to other processes' load), and the position
``(partial - none) / (cpu - none)`` of each partial run (0..1: between).

Writes ``bench/results/partial_offload.json`` (default model, ~2.1M parameters); the
committed ``bench/results/partial_offload_wide.json`` is
``--width 2048 --batch 16 --rounds 8 --steps 6 --out bench/results/partial_offload_wide.json``
(10.6M parameters: the optimizer step a visible share of the step).

Usage: ``.venv/bin/python bench/bench_partial_offload.py [--rounds R] [--steps N]
[--batch B] [--width W] [--out PATH] [--note TEXT]``
"""

from __future__ import annotations

# isort: skip_file  (_common sets the environment before TensorFlow is imported)
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as base  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from helpers.reference_optimizers import DenseGradAdam  # noqa: E402

import zero_runtime  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "partial_offload.json"
RATIOS = (0.25, 0.5, 0.75)
CONFIGS = {
    f"stage{s}_{name}": {"stage": s, **cfg}
    for s in (1, 2)
    for name, cfg in (
        ("none", {"offload_optimizer": "none"}),
        *(
            (f"ratio{r}", {"offload_optimizer": "cpu", "offload_optimizer_ratio": r})
            for r in RATIOS
        ),
        ("cpu", {"offload_optimizer": "cpu"}),
    )
}


def _time_steps(model: keras.Model, ds: tf.data.Dataset) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds of each step of one fit over ``ds``, without its first step."""
    timer = base.StepTimer()
    model.fit(ds, verbose=0, callbacks=[timer])
    return timer.times[1:], timer.cpu_times[1:]


def _positions(medians: dict[str, float]) -> dict[str, float]:
    """``(partial - none) / (cpu - none)`` per stage and ratio (in [0, 1]: between; either
    of the two ends may be the faster one)."""
    return {
        f"stage{s}_ratio{r}": round(
            (medians[f"stage{s}_ratio{r}"] - medians[f"stage{s}_none"])
            / (medians[f"stage{s}_cpu"] - medians[f"stage{s}_none"]),
            3,
        )
        for s in (1, 2)
        for r in RATIOS
    }


def main() -> None:
    """Build every configuration, measure them interleaved and write the results file."""
    ap = base.interleaved_parser(__doc__.splitlines()[0], 8, 9, 64)
    ap.add_argument("--width", type=int, default=768, help="hidden width of the bench model")
    ap.add_argument("--out", type=Path, default=RESULTS, help="the results file")
    ap.add_argument("--note", default="", help="added to the results file's note")
    args = ap.parse_args()
    load_before = os.getloadavg()
    ds = base.make_data(args.steps, args.batch)
    mirrored = tf.distribute.MirroredStrategy(list(base.DEVICES.devices))
    models = {"mirrored": base.build_trained(mirrored, lambda: DenseGradAdam(1e-3), ds, args.width)}
    strategies = []
    for name, cfg in CONFIGS.items():
        strategy = zero_runtime.ZeroInfinityStrategy(cfg)
        strategies.append(strategy)
        models[name] = base.build_trained(
            strategy, lambda: keras.optimizers.get("adam"), ds, args.width
        )
    names = list(models)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu_times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            wall, cpu = _time_steps(models[name], ds)
            times[name] += wall
            cpu_times[name] += cpu
    for strategy in strategies:
        strategy.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    cpu_medians = {name: statistics.median(t) for name, t in cpu_times.items()}
    between = {
        f"stage{s}_ratio{r}": min(medians[f"stage{s}_none"], medians[f"stage{s}_cpu"])
        <= medians[f"stage{s}_ratio{r}"]
        <= max(medians[f"stage{s}_none"], medians[f"stage{s}_cpu"])
        for s in (1, 2)
        for r in RATIOS
    }
    result = {
        **base.run_header(load_before, f"{base.INTERLEAVED_NOTE}. {args.note}".strip()),
        "width": args.width,
        "model_params": base.build_model(args.width).count_params(),
        "global_batch": args.batch,
        "ratios": list(RATIOS),
        "timed_steps_per_config": len(times["mirrored"]),
        "median_step_seconds": medians,
        "ratios_vs_mirrored": {k: v / medians["mirrored"] for k, v in medians.items()},
        "partial_between_none_and_cpu": between,
        # (partial - none) / (cpu - none) of the medians: 0 = as no offload, 1 = as full
        "position_between_none_and_cpu": {
            "wall": _positions(medians),
            "cpu_time": _positions(cpu_medians),
        },
        # Process CPU seconds per step (every thread of this process): the work a step
        # costs, less sensitive than wall time to other processes' load.
        "median_step_cpu_seconds": cpu_medians,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
