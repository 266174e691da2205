"""Cost of timing the strategy's own collectives on every step.

With ``ZeroInfinityStrategy.time_strategy_collectives`` (default False) the strategy's own
collectives (stage 1's gradient all-reduce and shard all-gather, Keras's loss reduction)
run under the collective watchdog's two host callbacks, whose timestamps are the step's
comm intervals. This compares step time with them (``timed``) and without (``bare``):
one process, two strategies and two copies of the demo GPT (``demo.model.build_gpt``
defaults, stage 1, host optimizer offload, 2 logical CPU replicas), alternating blocks of
``--block`` steps of each (one ``fit`` call per block; the first step of each call is
dropped), so drift from other processes on the shared cores cancels. Step time is the
median of per-step wall times from a Keras callback; overhead = timed / bare - 1.
Goal: <= 2 % (the telemetry budget, bench/bench_telemetry.py).

Writes ``bench/results/timing_callbacks.json``.

Usage: ``.venv/bin/python bench/bench_timing_callbacks.py [--blocks N] [--block B]``
"""

from __future__ import annotations

# isort: skip_file  (the environment must be set before TensorFlow is imported)
import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import _checkout  # noqa: E402, F401  (this checkout's zero_runtime, not the editable install's)
import psutil  # noqa: E402

import zero_runtime  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULT = ROOT / "bench" / "results" / "timing_callbacks.json"
CONFIG = {"stage": 1, "offload_optimizer": "cpu", "telemetry_every_n_steps": 1}


def main() -> int:
    """Run the benchmark, print and write the result; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=12, help="blocks per mode (alternating)")
    p.add_argument("--block", type=int, default=6, help="steps per block")
    args = p.parse_args()
    import keras

    from bench.bench_telemetry import _cpu_model
    from demo import data, model

    strategies = {}
    for mode, timed in (("timed", True), ("bare", False)):  # before any TensorFlow op
        zero_runtime.ZeroInfinityStrategy.time_strategy_collectives = timed
        strategies[mode] = zero_runtime.ZeroInfinityStrategy(
            CONFIG, logdir=tempfile.mkdtemp(prefix=f"bench-timing-{mode}-")
        )
    cfg = model.GPTConfig()
    corpus = data.load_corpus(1 << 20, seed=0)
    train = data.make_dataset(data.split_corpus(corpus).train, cfg.seq_len, 16, seed=0)
    runs = {}
    for mode, strategy in strategies.items():
        with strategy.scope():
            gpt = model.build_gpt(cfg, seed=0)
            gpt.compile(optimizer="adam", loss=model.make_loss())
        gpt.fit(train, steps_per_epoch=args.block, epochs=1, verbose=0)  # trace, warm up
        runs[mode] = (strategy, gpt)
    zero_runtime.ZeroInfinityStrategy.time_strategy_collectives = False  # the default
    times: dict[str, list[float]] = {"timed": [], "bare": []}

    class Clock(keras.callbacks.Callback):
        def __init__(self, mode: str) -> None:
            super().__init__()
            self.mode = mode

        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch > 0:
                times[self.mode].append(time.perf_counter() - self.t0)

    for _ in range(args.blocks):
        for mode, (_, gpt) in runs.items():
            gpt.fit(train, steps_per_epoch=args.block, epochs=1, verbose=0, callbacks=[Clock(mode)])
    measured = {  # records whose comm seconds were measured (not NaN, not missing)
        mode: sum(
            1
            for x in strategy.runtime.recorder.last()
            if not math.isnan(x.timing.get("comm_seconds", math.nan))
        )
        for mode, (strategy, _) in runs.items()
    }
    recorded = {mode: len(strategy.runtime.recorder.last()) for mode, (strategy, _) in runs.items()}
    for strategy, _ in runs.values():
        strategy.close()
    timed, bare = statistics.median(times["timed"]), statistics.median(times["bare"])
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "cpu": _cpu_model(),
        "config": CONFIG,
        "steps_per_mode": len(times["timed"]),
        "block_steps": args.block,
        "median_step_seconds": {"timed": timed, "bare": bare},
        "mean_step_seconds": {m: statistics.mean(v) for m, v in times.items()},
        "records_with_comm_measured": measured,
        "records": recorded,
        "overhead_median": timed / bare - 1,
        "goal": "overhead_median <= 0.02",
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
