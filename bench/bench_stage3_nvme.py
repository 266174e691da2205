"""Stage 3 with parameters and optimizer states on NVMe: step time against the I/O lower
bound of the bytes it moves, and against MirroredStrategy, measured in one run (goal:
step <= 1.5x the I/O lower bound of the bytes it moves).

One process, 2 replicas (logical CPU devices), the chain of ``bench_step_time.py`` (about
2.1M float32 parameters). Configurations:

- ``mirrored``: MirroredStrategy, Keras Adam on dense gradients (the parity reference);
- ``stage3_nvme``: ZeRO stage 3, ``offload_param='nvme'`` and ``offload_optimizer='nvme'``
  under a temporary directory on the same disk as fio's file, default budgets (the
  pool's host window holds the four largest units' shards: every other page of
  parameters and optimizer states is on NVMe, so each step reads and writes them).

Both are warmed up (traced), then timed interleaved, ``--rounds`` rounds of ``--steps``
steps. Every stage-3 step's page moves are read from the runtime's own step record (the
parameter pool's and the optimizer store's counters, summed as the telemetry sums them):
``n2h_bytes`` read from and ``h2n_bytes`` written to NVMe.

The disk is measured in the same run with fio (before and after the steps), O_DIRECT,
page-sized blocks, at the pool's queue depth (``min(io_threads, queue_depth)`` of
``PoolConfig``), libaio and psync, the better of the two (``bench_paging.run_fio``).
Per step:

- ``io_bound_serial`` = n2h_bytes / fio read + h2n_bytes / fio write (seconds): the disk
  doing one direction at a time, the figure the issue's goal is read against;
- ``io_bound_overlapped`` = max of the two terms (reads and writes fully overlapped);
- ``compute_or_io_bound`` = max(Mirrored's median step, io_bound_serial): no run can beat
  both its compute and its I/O.

Writes ``bench/results/stage3_nvme.json`` with the date, machine and load average.

Usage: ``.venv/bin/python bench/bench_stage3_nvme.py [--rounds R] [--steps N] [--batch B]
[--fio-size BYTES]``
"""

from __future__ import annotations

# isort: skip_file  (_common sets the environment before TensorFlow is imported)
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402  (devices, data, timer, the model)
import bench_paging as bp  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from helpers.reference_optimizers import DenseGradAdam  # noqa: E402  (_common put tests/ on the path)

import zero_runtime  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "stage3_nvme.json"
GOAL = 1.5  # stage 3 with NVMe: step <= 1.5x the I/O lower bound of its bytes


def nvme_config(directory: str) -> dict:
    """The stage-3 config with parameters and optimizer states on NVMe files under
    ``directory``, default budgets."""
    return {
        "stage": 3,
        "offload_param": "nvme",
        "offload_optimizer": "nvme",
        "nvme_path": directory,
    }


def io_bounds(
    n2h_bytes: float, h2n_bytes: float, read_bw: float, write_bw: float
) -> tuple[float, float]:
    """Seconds the disk needs for one step's page I/O: ``(serial, overlapped)``.

    ``serial`` = n2h_bytes / read_bw + h2n_bytes / write_bw (one direction at a time);
    ``overlapped`` = the larger of the two terms. Bytes and bytes/s (fio's rates).
    """
    read, write = n2h_bytes / read_bw, h2n_bytes / write_bw
    return read + write, max(read, write)


def capture_pages(strategy) -> list[dict[str, float]]:
    """Every step's summed page counters, appended as the runtime closes the step."""
    accounting = strategy.runtime.accounting
    seen: list[dict[str, float]] = []
    close = accounting.close_step

    def recording(*args, **kwargs):
        tiers, pages = close(*args, **kwargs)
        seen.append(dict(pages))
        return tiers, pages

    accounting.close_step = recording
    return seen


def main() -> None:
    """Measure the disk, the two configurations interleaved, the disk again; write the file."""
    ap = common.interleaved_parser(__doc__.splitlines()[0], 4, 6, 32)
    ap.add_argument("--fio-size", type=int, default=256 << 20, help="bytes per fio job")
    args = ap.parse_args()
    bp.fio_available()
    load_before = os.getloadavg()
    depth = bp.pool_io_depth()
    ds = common.make_data(args.steps, args.batch)
    with tempfile.TemporaryDirectory(prefix="stage3_nvme_", dir=os.getcwd()) as nvme:
        disk_before = bp.disk_rates(nvme, args.fio_size, depth)
        mirrored = tf.distribute.MirroredStrategy(list(common.DEVICES.devices))
        models = {"mirrored": common.build_trained(mirrored, lambda: DenseGradAdam(1e-3), ds)}
        strategy = zero_runtime.ZeroInfinityStrategy(nvme_config(nvme))
        models["stage3_nvme"] = common.build_trained(
            strategy, lambda: keras.optimizers.get("adam"), ds
        )
        pages = capture_pages(strategy)
        times: dict[str, list[float]] = {k: [] for k in models}
        moved: list[dict[str, float]] = []
        for r in range(args.rounds):
            for key in models if r % 2 == 0 else reversed(list(models)):
                del pages[:]
                times[key] += common.time_steps(models[key], ds)
                if key == "stage3_nvme":
                    moved += pages[1:]  # the timed steps (time_steps drops the first)
        strategy.close()
        disk_after = bp.disk_rates(nvme, args.fio_size, depth)
    read_bw = statistics.median([disk_before["read"], disk_after["read"]])
    write_bw = statistics.median([disk_before["write"], disk_after["write"]])
    n2h = statistics.median(p.get("n2h_bytes", 0.0) for p in moved)
    h2n = statistics.median(p.get("h2n_bytes", 0.0) for p in moved)
    medians = {k: statistics.median(t) for k, t in times.items()}
    serial, overlapped = io_bounds(n2h, h2n, read_bw, write_bw)
    both = max(medians["mirrored"], serial)
    step = medians["stage3_nvme"]
    note = (
        "configurations timed interleaved in one process, fio before and after them on "
        "the same disk; a load average above ~1 means other processes shared the 2 cores"
    )
    result = {
        **common.run_header(load_before, note),
        "replicas": len(common.DEVICES.devices),
        "model_params": models["mirrored"].count_params(),
        "global_batch": args.batch,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "pool_io_depth": depth,
        "fio_bytes_per_second": {"before": disk_before, "after": disk_after},
        "median_step_seconds": medians,
        "stage3_bytes_per_step": {"n2h": n2h, "h2n": h2n},
        # Median per timed step of every page counter (both pools: prefetch hits and
        # misses, stall and I/O seconds; memory/counters.py): what the step waited for.
        "stage3_page_counters_median": {
            k: statistics.median(float(p.get(k, 0.0)) for p in moved)
            for k in sorted({k for p in moved for k in p})
        },
        "bounds_seconds": {
            "io_bound_serial": serial,
            "io_bound_overlapped": overlapped,
            "compute_or_io_bound": both,
        },
        "ratios": {
            "stage3_nvme_vs_mirrored": step / medians["mirrored"],
            "stage3_nvme_vs_io_bound_serial": step / serial if serial else None,
            "stage3_nvme_vs_io_bound_overlapped": step / overlapped if overlapped else None,
            "stage3_nvme_vs_compute_or_io_bound": step / both,
        },
        "goal": f"stage3_nvme_vs_io_bound_serial <= {GOAL}",
        "goal_met": bool(serial) and step / serial <= GOAL,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
