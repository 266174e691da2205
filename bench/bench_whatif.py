"""What-if before apply: predicted vs measured effect of live changes on running jobs.

Two stage-3 training jobs in this process (Keras ``fit`` under ``ZeroInfinityStrategy``,
2 CPU replicas, four Dense blocks 64 -> 256 x 3 -> 10, 64 KiB pages, blocks kept gathered
from forward to backward, ``tests/helpers/tuning_job.py --stage3``'s model):

- job ``host``: parameter shards on the host. First the recording's cost: blocks of
  ``--block`` steps alternate the pool's access trace on and off (``set_tracing``; the
  runtime writes a step file only for traced steps), step time from a Keras callback,
  overhead = median on / median off - 1, and the time inside the step the trace adds (the
  step boundary's snapshot and file write: ``write_seconds_median``). Then five live
  changes, each written as a control request at a step end like the tab's ``POST /tune``:
  ``device_budget_bytes`` down (1 MiB: the gathered blocks spill), up (1.5 MiB: fewer
  spill), up (4 MiB: all fit), ``max_reuse_distance`` 0 and ``persistence_threshold`` 0
  (read at build time: no change in the running job, predicted as such).
- job ``nvme``: parameter shards on NVMe (a temporary directory) with a 10-page host tier
  for their 20 pages (they page in and out every step), the prefetch thread paging them
  in: ``prefetch_bucket_size`` down to one block's shards, then 0, then all blocks.

Before each change its effect is predicted from the job's access trace files (the plugin's
``GET /whatif`` path: ``zero_runtime.memory.simulate.predict``); after it, the job runs
``--after`` steps and the measured figures are the same trace files' (the pool's own
counters and peaks) of the steps after the apply step. Compared per change: page moves
per step (all directions) and the device peak of the pool's pages; error = |predicted -
measured| / measured (0 when both are 0; a measured 0 against a predicted non-zero counts
as 100 %). Goal: median error <= 20 % over the changes, for both figures.

Writes ``bench/results/whatif.json`` (date, machine, load averages at start and end).

Usage: ``.venv/bin/python bench/bench_whatif.py [--blocks N] [--block B] [--after S]``
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
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import _checkout  # noqa: E402, F401  (this checkout's zero_runtime, not the editable install's)
import numpy as np  # noqa: E402
import psutil  # noqa: E402

import zero_runtime  # noqa: E402
from zero_runtime import control  # noqa: E402
from zero_runtime.memory import simulate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "whatif.json"
PAGE = 65536  # bytes per page
MIB = 1 << 20
WARMUP_STEPS = 10  # steps: tracing and first allocations
GOAL = 0.20

HOST_CHANGES = [
    ("device budget down", {"device_budget_bytes": MIB}),
    ("device budget up", {"device_budget_bytes": 3 * MIB // 2}),
    ("device budget up (all fit)", {"device_budget_bytes": 4 * MIB}),
    ("reuse distance", {"max_reuse_distance": 0}),
    ("persistence threshold", {"persistence_threshold": 0}),
]
NVME_CHANGES = [
    ("prefetch size down (one block)", {"prefetch_bucket_size": 40_000}),
    ("prefetch off", {"prefetch_bucket_size": 0}),
    ("prefetch size up (all blocks)", {"prefetch_bucket_size": 50_000_000}),
]
NVME_HOST_PAGES = 10


def _config(offload: str, nvme_dir: str | None) -> dict:
    config = {
        "stage": 3,
        "offload_param": offload,
        "offload_optimizer": "cpu",
        "page_size_bytes": PAGE,
        "persistence_threshold": 300,  # biases persistent, kernels sharded
        "max_reuse_distance": 10**9,  # keep every block gathered from forward to backward
        "collective_timeout_seconds": 60,
    }
    if nvme_dir is not None:
        config["nvme_path"] = nvme_dir
        # 10 pages of host for the shards' 20: they page in from NVMe and out every step.
        config["host_budget_bytes"] = NVME_HOST_PAGES * PAGE
    return config


def _error(predicted: float, measured: float) -> float:
    if measured == 0:
        return 0.0 if predicted == 0 else 1.0
    return abs(predicted - measured) / measured


class Driver:
    """A Keras callback that drives one job: the cost phase, then the changes."""

    def __init__(self, run: str, pool, changes, blocks: int, block: int, after: int) -> None:
        import keras

        self.keras = keras
        self.run, self.pool, self.changes = run, pool, list(changes)
        self.blocks, self.block, self.after = blocks, block, after
        self.cost_steps = 2 * blocks * block
        self.times: dict[str, list[float]] = {"on": [], "off": []}
        self.results: list[dict] = []
        self.pending: dict | None = None
        self.next_change_at = WARMUP_STEPS + self.cost_steps + 10  # traced steps first
        self.done = False
        self.tracing_now = True

    def callback(self):
        driver = self

        class Cb(driver.keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                driver.begin(batch)

            def on_train_batch_end(self, batch, logs=None):
                driver.end(batch, self.model)

        return Cb()

    def _tracing(self, batch: int) -> bool:
        i = batch - WARMUP_STEPS
        return not (0 <= i < self.cost_steps) or (i // self.block) % 2 == 0

    def begin(self, batch: int) -> None:
        self.tracing_now = self._tracing(batch)
        self.pool.set_tracing(self.tracing_now)
        self.t0 = time.perf_counter()

    def end(self, batch: int, model) -> None:
        seconds = time.perf_counter() - self.t0
        i = batch - WARMUP_STEPS
        if 0 <= i < self.cost_steps:
            self.times["on" if self._tracing(batch) else "off"].append(seconds)
        if self.pending is not None:
            ack = control.read_ack(self.run)
            if (
                ack
                and ack.get("version") == self.pending["version"]
                and "applied_step" not in self.pending
            ):
                self.pending["applied_step"] = ack["step"]
            applied = self.pending.get("applied_step")
            if applied is not None and batch >= applied + self.after:
                self._measure(applied, batch)
        if self.pending is None and batch >= self.next_change_at:
            if not self.changes:
                self.done = True
                model.stop_training = True
                return
            self._propose(*self.changes.pop(0))

    def _propose(self, name: str, updates: dict) -> None:
        records = simulate.run_records(self.run)
        t0 = time.perf_counter()
        prediction = simulate.predict(records, records[-1]["config"], updates)
        replay_seconds = time.perf_counter() - t0
        version = control.write_request(self.run, updates)
        self.pending = {
            "name": name,
            "updates": updates,
            "version": version,
            "prediction": prediction,
            "replay_seconds": replay_seconds,
        }

    def _measure(self, applied: int, batch: int) -> None:
        p = self.pending
        rows = [r for r in simulate.run_records(self.run) if applied < r["step"] <= batch]
        measured = simulate.summarize([r["measured"] for r in rows])
        steady = p["prediction"]["predicted"]["steady"]
        pm, mm = sum(steady["moves_per_step"].values()), sum(measured["moves_per_step"].values())
        pp, mp = steady["peak_bytes"]["device"], measured["peak_bytes"]["device"]
        self.results.append(
            {
                "change": p["name"],
                "updates": p["updates"],
                "applied_step": applied,
                "measured_steps": [r["step"] for r in rows],
                "predicted_from_steps": p["prediction"]["steps"],
                "replay_exact": p["prediction"]["replay_exact"],
                "replay_seconds": p["replay_seconds"],
                "notes": p["prediction"]["notes"],
                "oom_predicted": p["prediction"]["oom"],
                "recorded_before": {
                    "moves_per_step": p["prediction"]["recorded"]["moves_per_step"],
                    "device_peak_bytes": p["prediction"]["recorded"]["peak_bytes"]["device"],
                },
                "predicted": {"moves_per_step": steady["moves_per_step"], "moves_total": pm,
                              "device_peak_bytes": pp,
                              "prefetch_misses": steady["prefetch_misses"]},
                "measured": {"moves_per_step": measured["moves_per_step"], "moves_total": mm,
                             "device_peak_bytes": mp,
                             "prefetch_misses": measured["prefetch_misses"]},
                "error_moves": _error(pm, mm),
                "error_device_peak": _error(pp, mp),
            }
        )  # fmt: skip
        print(f"{p['name']}: moves/step predicted {pm:.2f} measured {mm:.2f}; "
              f"device peak predicted {pp} measured {mp}", flush=True)  # fmt: skip
        self.pending = None
        self.next_change_at = batch + 2  # a traced step under the new values first


def run_job(name: str, offload: str, changes, args, write_times: list[float]) -> Driver:
    """Train one job until its changes are measured; returns its driver. ``write_times``
    gets the seconds of each traced step's trace write (the runtime's step boundary)."""
    import keras
    import tensorflow as tf

    logroot = tempfile.mkdtemp(prefix=f"bench-whatif-{name}-")
    run = os.path.join(logroot, name)
    nvme_dir = tempfile.mkdtemp(prefix="bench-whatif-nvme-") if offload == "nvme" else None
    strategy = zero_runtime.ZeroInfinityStrategy(
        _config(offload, nvme_dir), logdir=run, num_cpu_replicas=2
    )
    runtime = strategy.runtime
    write = runtime._write_access_trace  # noqa: SLF001 - timed in place

    holder: list[Driver] = []

    def timed_write():
        t0 = time.perf_counter()
        try:
            return write()
        finally:
            driver = holder[0] if holder else None
            if driver is not None and driver.tracing_now:
                write_times.append(time.perf_counter() - t0)

    runtime._write_access_trace = timed_write  # noqa: SLF001
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = strategy.shard_model(
            keras.Sequential(
                [keras.Input((64,))]
                + [keras.layers.Dense(256, activation="relu") for _ in range(3)]
                + [keras.layers.Dense(10)]
            )
        )
        model.compile(
            optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    blocks = args.blocks if name == "host" else 0
    driver = Driver(run, model.engine.pool, changes, blocks, args.block, args.after)
    holder.append(driver)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 64)).astype("float32")  # [N, 64]
    y = rng.integers(0, 10, size=(256,)).astype("int32")  # [N]
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True).repeat()
    model.fit(data, steps_per_epoch=10_000, epochs=1, verbose=0, callbacks=[driver.callback()])
    model.close()
    strategy.close()
    assert driver.done, f"job {name} stopped before its changes were measured"
    return driver


def main() -> int:
    """Run the benchmark, print and write the result; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=20, help="cost blocks per mode (alternating)")
    p.add_argument("--block", type=int, default=4, help="steps per cost block")
    p.add_argument("--after", type=int, default=8, help="steps measured after each apply")
    args = p.parse_args()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    writes: list[float] = []
    host = run_job("host", "cpu", HOST_CHANGES, args, writes)
    nvme = run_job("nvme", "nvme", NVME_CHANGES, args, [])
    changes = host.results + nvme.results
    live = [
        c for c in changes if not c["notes"] or not any("does not change" in n for n in c["notes"])
    ]
    on, off = statistics.median(host.times["on"]), statistics.median(host.times["off"])

    def med(key, rows):
        return statistics.median(r[key] for r in rows) if rows else None

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "cpu": _cpu_model(),
        "load_average_1_5_15": {
            "at_start": load_at_start,
            "at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "note": "predictions are made from the job's own trace files before each request is "
        "written; measured = the same files' pool counters and peaks of the steps after the "
        "apply step (the apply step itself, which holds a shrink's moves, left out). "
        "max_reuse_distance and persistence_threshold are read at build time: the running "
        "job does not change and the prediction says so; median_error_live leaves them out",
        "changes": changes,
        "median_error": {"moves": med("error_moves", changes),
                         "device_peak": med("error_device_peak", changes)},
        "median_error_live": {"moves": med("error_moves", live),
                              "device_peak": med("error_device_peak", live)},
        "goal": f"median error <= {GOAL:.0%} (moves per step and device peak)",
        "goal_met": all(v is not None and v <= GOAL for v in (
            med("error_moves", changes), med("error_device_peak", changes))),
        "trace_cost": {
            "steps_per_mode": len(host.times["on"]),
            "block_steps": args.block,
            "median_step_seconds": {"trace_on": on, "trace_off": off},
            "overhead_median": on / off - 1,
            "write_seconds_median": statistics.median(writes) if writes else None,
            "write_fraction_of_step": (statistics.median(writes) / off) if writes else None,
            "bounds": {"steps_kept": 8, "events_per_step": 200_000},
        },
    }  # fmt: skip
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_error", "median_error_live", "goal_met",
                                             "trace_cost")}, indent=2))  # fmt: skip
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
