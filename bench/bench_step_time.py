"""Step time of ZeRO stages 1, 2 and 3 vs MirroredStrategy on the same model and data,
and where stage 3's time goes.

One process, 2 replicas (logical CPU devices on a CPU-only host). Each configuration
trains the same Keras model (embedding + MLP, ~2.1M parameters) with Adam on the same
data. Every configuration's model is built and warmed up first (tracing); then the
configurations are measured *interleaved*: ``--rounds`` rounds, each fitting every
configuration for ``--steps`` steps (stage-3 configurations and ``mirrored_bf16``:
``--stage3-steps``, default 6, fewer so that the whole run stays within ~15 minutes on
2 shared cores; ~6 minutes measured), in alternating order, so load from other
processes falls on all of them alike. A step's time is its wall time measured by a Keras
callback (the first step of each fit call is dropped: it starts the iterator); a
configuration's figure is the median over all its steps (seconds). Ratios are each
configuration's median over MirroredStrategy's (stock Keras Adam, given dense gradients
as the parity references are). Goals: stage 1 and stage 2 (with and without
``overlap_comm``) without offload <= 1.10, and stage 2 with overlap <= stage 2 without;
stage 2 with cpu offload <= 1.5.

With the default ``reduce_bucket_size`` (5e8 elements) the model's gradients form one
bucket, so ``overlap_comm`` has nothing to overlap: the two stage-2 graphs differ only by
control dependencies, and their difference is measurement noise. The ``*_buckets``
configurations use 4 buckets, where overlap can start a bucket's reduce-scatter during the
backward pass.

Stage 3: ``stage3_<tier>`` with ``offload_param`` =
``offload_optimizer`` = ``tier`` (none / cpu: ``bench_stage3_units.STAGE3``; nvme:
``bench_stage3_nvme.nvme_config`` under a temporary directory on this disk), each in
float32 and, suffix ``_bf16``, under ``keras.mixed_precision`` policy
``mixed_bfloat16`` (set before the model is built, float32 again after), against
``mirrored`` / ``mirrored_bf16`` (Mirrored under the same policy). Goals: ``none`` <=
1.5x and ``cpu`` <= 2.0x its Mirrored's median step; ``nvme`` <= 1.5x
``page_io_serial`` (the I/O lower bound of its page bytes). For each, ``stage3.configs``
holds (field meanings also in the file's ``breakdown_note``):

- ``seconds_per_step`` (medians over steps, seconds; null = not measured by the runtime,
  nothing is estimated): ``step`` (this bench's timer), ``runtime_step``, ``stall`` (the
  pool's page waits, summed over the replicas' threads; ``pages`` of the runtime's
  ``StepStats`` records, ``strategy.runtime.recorder``), ``page_io`` (union of the NVMe
  jobs' intervals, ``timing.io_seconds``), ``page_io_thread_sum``; from a separate short
  *profiled pass* after the timed rounds (the runtime's sampled TF profiler,
  ``collector.profiler.every_n_steps`` = 2 for ``--profile-steps`` steps, so no timed
  step is profiled; ``ZERO_RUNTIME_PROFILE_EVERY`` stays 0): ``profiled_step``,
  ``compute`` (union of non-collective ops, host callbacks included), ``collectives``
  (union of all-gather + gradient-reduction ops) and ``overlap``. ``gather`` and
  ``reduce_scatter`` separately, ``recompute`` (activation checkpointing is off, but the
  units path recomputes each unit's call in its backward: inside ``compute``) and
  ``host_update`` (stage 3's optimizer reports no host seconds) are null.
- ``bytes_per_step``: ``<kind>_bytes`` of the collectives (per-replica input buffers,
  summed over the replicas, by real dtype) and the page counters ``n2h/h2n/h2d/d2h``.
- ``bound_seconds``, lower bounds of those bytes at this machine's bandwidths, measured
  in the same run before and after the steps (the median of the two): memcpy (bytes
  copied per second by ``np.copyto`` of 64 MiB, ``bench_host_adam.copy_bandwidth`` / 2)
  and fio (``bench_paging.disk_rates``: O_DIRECT, page-sized blocks, at the pool's
  queue depth). gather = (N-1) * all_gather_bytes / memcpy, reduce_scatter = (N-1)/N *
  reduce_scatter_bytes / memcpy, all_reduce = 2(N-1)/N * all_reduce_bytes / memcpy (the
  bytes each replica receives in a ring; nccl-tests ``PERFORMANCE.md`` bus bandwidth;
  stage 3 on CPU devices reduces by all-reduce + slice, ``stage3/engine.py``),
  host_device_copy = (h2d + d2h) / memcpy, page_io_serial = n2h / fio read + h2n / fio
  write (``bench_stage3_nvme.io_bounds``), bytes_serial = their sum.
- ``ratios``: ``vs_mirrored``, ``vs_bytes_bound_serial``, ``vs_page_io_bound_serial``
  (null without page I/O); ``goal``, ``goal_met``.

Writes ``bench/results/step_time.json`` (with the load average before and after: the
machine may be shared).

Usage: ``.venv/bin/python bench/bench_step_time.py [--rounds R] [--steps N] [--batch B]
[--stage3-steps N] [--profile-steps N] [--fio-size BYTES]``
"""

from __future__ import annotations

# isort: skip_file  (_common sets the environment before TensorFlow is imported)
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402, F401  (first: the environment, devices, tests/ on the path)
import bench_host_adam as bha  # noqa: E402
import bench_paging as bp  # noqa: E402
import bench_stage3_nvme as b3n  # noqa: E402
import bench_stage3_units as b3u  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from _common import (  # noqa: E402
    DEVICES,
    build_model,
    build_trained,
    interleaved_parser,
    make_data,
    run_header,
    time_steps,
)
from helpers.reference_optimizers import DenseGradAdam  # noqa: E402

import zero_runtime  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "step_time.json"

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

#: Stage 3 against MirroredStrategy: the tiers of ``offload_param`` and
#: ``offload_optimizer`` (both set to it) and the Keras global dtype policies, by name
#: suffix. ``mirrored_bf16`` is the mixed_bfloat16 configurations' own baseline.
STAGE3_TIERS = ("none", "cpu", "nvme")
POLICIES = {"": "float32", "_bf16": "mixed_bfloat16"}
#: tier -> (the ratio it is judged by, its maximum): stage 3's goals.
STAGE3_GOALS = {
    "none": ("vs_mirrored", 1.5),
    "cpu": ("vs_mirrored", 2.0),
    "nvme": ("vs_page_io_bound_serial", 1.5),
}


def build_under_policy(policy: str, strategy, make_optimizer, ds: tf.data.Dataset) -> keras.Model:
    """:func:`build_trained` with Keras's global dtype policy set to ``policy``
    (``"float32"``, ``"mixed_bfloat16"``) while the model is built, compiled and traced;
    the policy is float32 again afterwards."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        return build_trained(strategy, make_optimizer, ds)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def stage3_config(tier: str, nvme_dir: str) -> dict:
    """The stage-3 config of ``tier`` (``offload_param`` = ``offload_optimizer`` =
    ``tier``): ``bench_stage3_units.STAGE3``'s for none / cpu, ``bench_stage3_nvme``'s
    NVMe config under ``nvme_dir`` (created) for nvme."""
    if tier == "nvme":
        os.makedirs(nvme_dir, exist_ok=True)
        return b3n.nvme_config(nvme_dir)
    return dict(b3u.STAGE3[f"stage3_{tier}"])


def timed_fit(model: keras.Model, ds: tf.data.Dataset, runtime=None) -> tuple[list, list]:
    """:func:`time_steps` of one fit, with the runtime's StepStats records of the same
    steps (``runtime.recorder``; the first step's dropped as its time is; ``[]`` without
    a ``runtime``): ``(seconds per step, records)``."""
    before = runtime.steps_recorded if runtime is not None else 0
    times = time_steps(model, ds)
    n = runtime.steps_recorded - before if runtime is not None else 0
    return times, (runtime.recorder.last(n)[1:] if n > 0 else [])


def profiled_records(runtime, model: keras.Model, ds: tf.data.Dataset, every: int = 2) -> list:
    """One fit over ``ds`` with the runtime's profiler sampling every ``every`` steps
    (``collector.profiler``; 0 again after it, a trace still open discarded); the records
    whose timing came from a profiler trace (``StepStats.profiled``)."""
    sampler = runtime.collector.profiler
    before = runtime.steps_recorded
    sampler.every_n_steps = every
    try:
        model.fit(ds, verbose=0)
    finally:
        sampler.every_n_steps = 0
        sampler.stop()  # a trace started at the last step's end: not a whole step
    n = runtime.steps_recorded - before
    return [r for r in runtime.recorder.last(n) if r.profiled] if n > 0 else []


def median_field(records: list, field: str, key: str) -> float | None:
    """Median over ``records`` of ``getattr(record, field)[key]`` (NaN and missing
    values left out); None (not measured) when no record has it."""
    values = [getattr(r, field).get(key, math.nan) for r in records]
    values = [float(v) for v in values if v == v]
    return statistics.median(values) if values else None


def memcpy_rate(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes copied per second by ``np.copyto`` of a ``nbytes`` array (best of
    ``repeats``; ``bench_host_adam.copy_bandwidth`` counts read + written, so half)."""
    return bha.copy_bandwidth(nbytes, repeats) / 2


def stage3_breakdown(
    step: float,
    records: list,
    profiled: list,
    replicas: int,
    memcpy: float,
    disk: dict[str, float],
) -> dict:
    """One stage-3 configuration's per-step breakdown, bytes and lower bounds.

    Args:
        step: its median step, seconds (this bench's timer).
        records: the runtime's StepStats of its timed steps (unprofiled).
        profiled: its records from the profiled pass (:func:`profiled_records`).
        replicas: the replicas N.
        memcpy: bytes copied per second (:func:`memcpy_rate`).
        disk: fio's ``read`` / ``write`` bytes per second.

    Returns:
        ``seconds_per_step`` (medians; None = not measured by the runtime),
        ``bytes_per_step`` (medians), ``bound_seconds``, ``vs_bound`` (step / bound).
    """
    pages = {k: median_field(records, "pages", k) or 0.0 for k in ("n2h_bytes", "h2n_bytes")}
    pages |= {k: median_field(records, "pages", k) or 0.0 for k in ("h2d_bytes", "d2h_bytes")}
    coll = {
        k: median_field(records, "collectives", k) or 0.0
        for k in ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes")
    }
    calls = {
        k: median_field(records, "collectives", k) or 0.0
        for k in ("all_gather_calls", "reduce_scatter_calls", "all_reduce_calls")
    }
    comm = median_field(profiled, "timing", "comm_seconds")
    io_profiled = median_field(profiled, "timing", "io_seconds") or 0.0
    seconds = {
        "step": step,
        "runtime_step": median_field(records, "timing", "step_seconds"),
        "profiled_step": median_field(profiled, "timing", "step_seconds"),
        "compute": median_field(profiled, "timing", "compute_seconds"),
        "recompute": None,
        "gather": None,
        "reduce_scatter": None,
        "collectives": None if comm is None else max(0.0, comm - io_profiled),
        "overlap": median_field(profiled, "timing", "overlap_seconds"),
        "host_update": None,
        "page_io": median_field(records, "timing", "io_seconds"),
        "page_io_thread_sum": median_field(records, "pages", "io_seconds"),
        "stall": median_field(records, "pages", "stall_seconds"),
    }
    n = replicas
    io_serial, io_overlapped = b3n.io_bounds(
        pages["n2h_bytes"], pages["h2n_bytes"], disk["read"], disk["write"]
    )
    bound = {
        "gather": (n - 1) * coll["all_gather_bytes"] / memcpy,
        "reduce_scatter": (n - 1) / n * coll["reduce_scatter_bytes"] / memcpy,
        "all_reduce": 2 * (n - 1) / n * coll["all_reduce_bytes"] / memcpy,
        "host_device_copy": (pages["h2d_bytes"] + pages["d2h_bytes"]) / memcpy,
        "page_io_serial": io_serial,
        "page_io_overlapped": io_overlapped,
    }
    bound["bytes_serial"] = (
        sum(bound[k] for k in ("gather", "reduce_scatter", "all_reduce", "host_device_copy"))
        + io_serial
    )
    return {
        "seconds_per_step": seconds,
        "bytes_per_step": {**coll, **pages},
        "collective_calls_per_step": calls,
        "bound_seconds": bound,
        "vs_bound": {
            k: (step / bound[k] if bound[k] > 0 else None)
            for k in ("bytes_serial", "page_io_serial")
        },
        "timed_records": len(records),
        "timed_steps_traced": sum(int(r.timing.get("traced", 0.0) == 1.0) for r in records),
        "profiled_records": len(profiled),
    }


BREAKDOWN_NOTE = {
    "units": "seconds per step (medians over the steps); bytes per step (medians)",
    "step": "this bench's timer (Keras callback), the figure the ratios use",
    "runtime_step": "the runtime's own step duration (StepStats.timing step_seconds)",
    "profiled_step": (
        "the runtime's step duration of the profiled steps: the profiler slows them, so "
        "compute and collectives are read against it, not against step"
    ),
    "compute": (
        "profiled pass only (TF profiler trace of sampled steps, after the timed rounds): "
        "union of every non-collective op's interval, host callbacks (shard reads, the "
        "host update, page waits) included"
    ),
    "recompute": (
        "not measured (null): activation_checkpointing is off (default), but the units "
        "path recomputes each unit's call in its backward (stage3/gather.py); that time "
        "is inside compute"
    ),
    "gather / reduce_scatter": (
        "not measured separately (null): the profiler's comm is the union of all "
        "collective ops; their bytes are measured separately"
    ),
    "collectives": (
        "profiled pass: union of collective op intervals (all-gather + reduce-scatter), "
        "timing comm_seconds minus the NVMe I/O the runtime adds to it"
    ),
    "host_update": (
        "not measured (null): stage 3's optimizer reports 0 host seconds "
        "(optim/shard_update.py); on host tiers it runs inside compute"
    ),
    "page_io": "union of the NVMe I/O jobs' intervals (timing io_seconds); null: no NVMe tier",
    "page_io_thread_sum": "I/O threads' pread/pwrite + CRC seconds, summed over threads",
    "stall": "seconds the pool's acquire waited for pages, summed over the replicas' threads",
    "reduction": (
        "on CPU devices stage 3 reduces gradients by all-reduce + slice, not "
        "reduce-scatter (stage3/engine.py: the all_to_all reduce-scatter timed out on "
        "CPU), so its bytes are all_reduce_bytes and its bound the all-reduce's"
    ),
    "host_device_copy": (
        "counts the pools' h2d/d2h page moves only: the host tier's per-use shard reads "
        "(a host call returning the shard) and the host update's gradient copies are not "
        "page moves, so they are in neither the bytes nor this bound"
    ),
    "timed_steps_traced": "timed steps that traced their step function (a retrace: 0 expected)",
    "bytes": (
        "collectives: per-replica input buffers summed over the 2 replicas, by real dtype "
        "(CollectiveGroup.step_tally); pages: the pools' page counters"
    ),
    "bounds": (
        "bytes each replica must receive in a ring (nccl-tests PERFORMANCE.md "
        "bus-bandwidth factors) over memcpy: gather (N-1)*all_gather_bytes, "
        "reduce_scatter (N-1)/N*reduce_scatter_bytes, all_reduce 2(N-1)/N*"
        "all_reduce_bytes; host_device_copy (h2d+d2h) / memcpy (a host<->device move is "
        "a copy on the CPU stand-in); page_io_serial n2h/fio_read + h2n/fio_write "
        "(bench_stage3_nvme.io_bounds); bytes_serial their sum; memcpy = np.copyto "
        "bytes copied per second, one stream"
    ),
}


def _stage3_results(medians: dict, records: dict, profiled: dict, rates: dict) -> dict:
    """The results' ``stage3`` section: per stage-3 configuration its median step,
    ratios, breakdown and goal (bytes, bytes/s, seconds)."""
    out: dict = {}
    goals_met: dict[str, bool] = {}
    for suffix in POLICIES:
        base = medians[f"mirrored{suffix}"]
        for tier in STAGE3_TIERS:
            name = f"stage3_{tier}{suffix}"
            b = stage3_breakdown(
                medians[name],
                records[name],
                profiled[name],
                len(DEVICES.devices),
                rates["memcpy"],
                rates["fio"],
            )
            ratios = {
                "vs_mirrored": medians[name] / base,
                "vs_bytes_bound_serial": b["vs_bound"]["bytes_serial"],
                "vs_page_io_bound_serial": b["vs_bound"]["page_io_serial"],
            }
            key, limit = STAGE3_GOALS[tier]
            met = ratios[key] is not None and ratios[key] <= limit
            goals_met[name] = met
            out[name] = {
                "policy": POLICIES[suffix],
                "baseline": f"mirrored{suffix}",
                "median_step_seconds": medians[name],
                "ratios": ratios,
                "goal": f"{key} <= {limit}",
                "goal_met": met,
                **b,
            }
    return {"configs": out, "goals_met": goals_met, "breakdown_note": BREAKDOWN_NOTE}


def main() -> None:
    """Build every configuration, measure them interleaved, run the stage-3 profiled
    pass and write the results file."""
    ap = interleaved_parser(__doc__.splitlines()[0], 12, 9, 64)
    ap.add_argument(
        "--stage3-steps", type=int, default=6, help="steps per stage-3 configuration per round"
    )
    ap.add_argument("--profile-steps", type=int, default=7, help="steps of the profiled pass")
    ap.add_argument("--fio-size", type=int, default=256 << 20, help="bytes per fio job")
    args = ap.parse_args()
    bp.fio_available()
    load_before = os.getloadavg()
    ds = make_data(args.steps, args.batch)
    ds3 = make_data(args.stage3_steps, args.batch)
    with tempfile.TemporaryDirectory(prefix="step_time_nvme_", dir=os.getcwd()) as nvme:
        depth = bp.pool_io_depth()
        fio = [bp.disk_rates(nvme, args.fio_size, depth)]
        memcpy = [memcpy_rate()]
        mirrored = tf.distribute.MirroredStrategy(list(DEVICES.devices))
        models = {"mirrored": build_trained(mirrored, lambda: DenseGradAdam(1e-3), ds)}
        data = {"mirrored": ds}
        strategies = {}
        for name, cfg in CONFIGS.items():
            strategy = zero_runtime.ZeroInfinityStrategy(cfg)
            strategies[name] = strategy
            models[name] = build_trained(strategy, lambda: keras.optimizers.get("adam"), ds)
            data[name] = ds
        stage3: list[str] = []  # the stage-3 configurations' names
        for suffix, policy in POLICIES.items():
            if suffix:
                models[f"mirrored{suffix}"] = build_under_policy(
                    policy, mirrored, lambda: DenseGradAdam(1e-3), ds
                )
                data[f"mirrored{suffix}"] = ds3
            for tier in STAGE3_TIERS:
                name = f"stage3_{tier}{suffix}"
                strategy = zero_runtime.ZeroInfinityStrategy(
                    stage3_config(tier, os.path.join(nvme, name))
                )
                strategies[name] = strategy
                models[name] = build_under_policy(
                    policy, strategy, lambda: keras.optimizers.get("adam"), ds
                )
                data[name] = ds3
                stage3.append(name)
        names = list(models)
        times: dict[str, list[float]] = {n: [] for n in names}
        records: dict[str, list] = {n: [] for n in stage3}
        mirrored_halves: list[list[float]] = [[], []]
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else reversed(names):
                runtime = strategies[name].runtime if name in stage3 else None
                t, recs = timed_fit(models[name], data[name], runtime)
                times[name] += t
                if name in stage3:
                    records[name] += recs
                if name == "mirrored":
                    mirrored_halves[2 * r // args.rounds] += t
        # After the timed rounds, so no median step is a profiled one.
        ds_profile = make_data(args.profile_steps, args.batch)
        profiled = {
            n: profiled_records(strategies[n].runtime, models[n], ds_profile) for n in stage3
        }
        for strategy in strategies.values():
            strategy.close()
        fio.append(bp.disk_rates(nvme, args.fio_size, depth))
        memcpy.append(memcpy_rate())
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["mirrored"]
    ratios = {k: medians[k] / base for k in CONFIGS}
    rates = {
        "memcpy": statistics.median(memcpy),
        "fio": {k: statistics.median([f[k] for f in fio]) for k in ("read", "write")},
    }
    result = {
        **run_header(load_before),
        "replicas": len(DEVICES.devices),
        "devices": list(DEVICES.devices),
        "model_params": build_model().count_params(),
        "global_batch": args.batch,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "stage3_steps_per_round": args.stage3_steps,
        "timed_steps_per_config": {n: len(t) for n, t in times.items()},
        "median_step_seconds": medians,
        "mirrored_baseline_seconds": base,
        # Noise estimate: Mirrored's median over the first and the second half of rounds.
        "mirrored_half_medians": [statistics.median(h) for h in mirrored_halves if h],
        "ratios_vs_mirrored": ratios,
        "goals": GOALS,
        "goals_met": {k: ratios[k] <= g for k, g in GOALS.items()},
        "overlap_not_slower": {f"{a}<={b}": medians[a] <= medians[b] for a, b in OVERLAP_PAIRS},
        "bandwidths": {
            "memcpy_bytes_per_second": {"before_after": memcpy, "used": rates["memcpy"]},
            "fio_bytes_per_second": {"before_after": fio, "used": rates["fio"]},
            "pool_io_depth": depth,
        },
        "stage3": _stage3_results(medians, records, profiled, rates),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
