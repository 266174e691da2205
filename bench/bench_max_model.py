"""Largest GPT-family model that trains one step: ZeRO stage 3 + NVMe offload vs Mirrored.

One run searches, for each side, the largest member of a fixed model family that trains
one step under the same device budget (``--device-mib``, default 256 MiB, for the 2 local
replicas together), then measures, on one model both can train, the device bytes of model
states per replica. Writes ``bench/results/max_model.json`` (the figures, the settings and
every trial). Goals: stage 3's model-state device bytes per replica <= 0.02 of Mirrored's
(``model_states_device_ratio``) and the largest stage-3 run's step <= 2x its I/O lower
bound (``largest_stage3_io``).

Family (``family_config(k)``, k >= 1): ``demo.model.build_gpt`` with ``d_model = 64 k``,
``n_layers = 2 k``, ``n_heads = k``, ``d_ff = 4 d_model``, ``vocab_size = 256``,
``seq_len = 32``; parameters ~ 98304 k^3 (k=4: 6.5M, k=8: 51M, k=16: 404M, k=22: 1.05B).
Each step trains on a global batch of ``--batch`` sequences of 32 tokens with Adam.

Sides:

- ``stage3``: ``ZeroInfinityStrategy({"stage": 3, "offload_param": "nvme",
  "offload_optimizer": "cpu", ...})`` (``--offload-optimizer nvme``: states on NVMe);
  the model is built inside ``strategy.zero_init()``
  (partitioned construction: variables deferred, never replicated) and
  ``strategy.shard_model`` initializes each one straight into its NVMe shards, one
  variable at a time (``zero_runtime/stage3/construction.py``). ``offload_optimizer``
  is 'cpu' (host Adam; the host budget holds its states). Parameter shards are pages of
  the runtime's pool on NVMe (a file under ``--nvme-path``); ``device_budget_bytes`` =
  ``--pool-device-fraction`` (default 1/4) of the device budget (see below): the engine
  refuses a model whose step's device plan (gathered units, shards, row caches:
  zero_runtime/stage3/device_plan.py) exceeds it; ``host_budget_bytes`` = the host budget
  (default 4 GiB) minus the host optimizer states, 1 MiB pages. The GPT runs by units
  (zero_runtime/stage3/units_path.py) with memory-centric tiling (``tile_size`` = that
  device budget // 128 elements, what ``'auto'`` derives) and ``activation_checkpointing``
  (each transformer block keeps its input only and is recomputed in backward), each
  unit's gradient shard, tiled kernels included, handed to the host optimizer during
  backward. Smaller tiles lower the device peak
  but add tiled kernels to the traced graph, and with them host memory: at k = 22
  (1,048,315,392 parameters, d_model 1408, 44 blocks), tiles of 1M elements
  (``--pool-device-fraction 0.5``) took the process past 24 GB RSS, so the large runs use
  ``--pool-device-fraction 1.0`` (tiles of 2M elements). At this scale a stage-3 trial
  that fails has timed out (``--trial-timeout``): the host's work per step (the NVMe
  optimizer's sub-group updates, the pool's per-page bookkeeping) limits the search, not
  the device peak (bench_units_peak: 0.58 bytes per parameter at k = 10 with tiles and
  checkpointing).
- ``mirrored``: plain ``tf.distribute.MirroredStrategy`` over the same 2 logical CPU
  devices, Keras's Adam (dense gradients, as the parity references).

How the device bytes are measured and capped (the device tier is a CPU stand-in here):
every trial runs in a fresh subprocess with TensorFlow's BFC CPU allocator
(``TF_CPU_ALLOCATOR_USE_BFC=true``), which serves every tensor of both logical CPU
devices (variables, optimizer slots, gradients, activations, collective buffers, and the
runtime pool's device-tier pages, which are ``tf.Tensor`` on /CPU:0). *Device bytes* of
a step = the allocator's peak in-use bytes during the trained steps
(``tf.config.experimental.get_memory_info("CPU:0")["peak"]`` after
``reset_memory_stats``). The same rule decides fit for both sides: the steps finish and
the step peak and the construction peak are <= the budget. Mirrored is also capped hard,
from model construction on, by the allocator itself: ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` = the
budget, so anything past it raises ResourceExhaustedError (an OOM: does not fit).
Stage 3's construction needs no more: partitioned construction peaks at about 3 x the
largest single variable (the initializer's output and temporaries; measured 2.1 MB at
k=3, 6.3 MB at k=5), not the replicated model (8 bytes/parameter, 560 MB at k=11). But
stage 3 is not capped by default (``--cap-stage3`` caps it): under the cap a stage-3 step
raised OOM at k=6 (in an all-gather, allocating 7 MB) although its measured in-use peak
uncapped is 46 MB. Suspected, not proven: the cap limits the BFC allocator's *reserved
regions*, and stage 3 interleaves hundreds of long-lived 64 KiB page tensors (the pool's
device tier) with multi-MB transients, so fragmentation exhausts the regions long before
the in-use bytes reach the budget.

Stage-3 device budget vs the allocator budget: the engine's device plan counts the
gathered units (two at once) and the device-tier pages, but a step also allocates
TensorFlow tensors it does not plan: a unit's full parameter gradient and its all-reduce
(the CPU reduce-scatter path), the views' copies, activations. So the engine gets a
fraction of the budget (``--pool-device-fraction``, default 0.25) and the rest is
headroom for those tensors; the allocator's measured peak is what the fit rule judges.

Host budget (stage 3): with ``offload_optimizer='cpu'`` (default) the host optimizer
states (``optimizer.zero_state.store.nbytes``, numpy buffers outside the pool, 8
bytes/parameter for Adam) are subtracted from the host budget and the rest is the pool's
``host_budget_bytes`` (parameter pages beyond it live only on NVMe). With
``--offload-optimizer nvme`` the pool gets half the host budget and the NVMe store the
other half for its streamed window and step journal (``optimizer_host_budget_bytes``); the
store's figure is ``store.peak_nbytes``, the peak over the steps, which counts the step's
undo journal (freed by the next commit, so ``nbytes`` read after the steps misses it). The
measured pool host-tier peak plus the optimizer's host bytes plus the peak of the gradient
copies queued for the update in backward (``queued_gradient_peak_bytes``, bounded by
``backward_update.MAX_QUEUED_BYTES`` per replica) must be <= the host budget; the process
peak RSS is reported too. A trial that times out (``--trial-timeout``), is killed (host
OOM) or raises does not fit.

Host memory beyond the budgets: each trial also records the process's RSS after
construction and after each step (``rss_bytes``, psutil) and its peak (``max_rss_bytes``).
The host rule above counts only what the runtime budgets (its pool and optimizer store);
the rest of the RSS (TensorFlow and Keras, the traced step's graphs, the host update's
temporaries) is reported, not judged: at k = 22 it is several times the budgeted 4 GiB.
On the units engine (NVMe parameters and optimizer, batch 2): k = 6 (21.5M) RSS 0.70 GB
after construction, 1.91 GB after the first (tracing) step, peak 2.35 GB, pool + store
0.44 GB; k = 8 (50.7M) 0.80 / 2.65 / 3.69 GB, pool + store 1.0 GB, the peak in the second
step while the NVMe store journals a sub-group.

Per step at k = 22 the disk reads the parameters three times (forward, recompute,
backward) and the Adam moments once, and writes the parameters and the moments once and
the moments' undo journal where it exceeds the store's host allowance
(``disk_bytes_per_step``).

I/O lower bound (``largest_stage3_io``): the largest stage-3 run's last step against the
time its disk bytes need at fio's bandwidth at the pool's queue depth and page size,
measured on the NVMe directory in the same run before and after the stage-3 search
(``disk_rates``, ``io_lower_bound``; bytes from ``/proc/self/io``, per step:
``disk_bytes_per_step``). The fio figures of this virtual disk vary about 2x between
runs (bench_paging at 4 MiB: 0.82 / 1.35 GB/s read / write at load 8-12, 1.75 / 2.36
GB/s idle), so the bound is only fair against fio of the same run. At k = 4 (6.5M,
parameters in the host window) a step moves only the Adam moments: 51.7 MB read and
51.7 MB written.

Search per side: k doubles the parameter count (next k with >= 2x parameters) until a
trial fails, then bisects k (parameters are monotone in k) between the last fit and the
first failure. Trials stop when the total time (``--total-minutes``) would be exceeded.

Usage: ``.venv/bin/python bench/bench_max_model.py [--total-minutes 15] [--trial-timeout 240]
[--stage3-start-k K]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "max_model.json"
MIB = 1 << 20
VOCAB, SEQ = 256, 32
PAGE = 64 * 1024
OPT_MARGIN = 64 * MIB
# Host bytes of gradient copies the update in backward may queue, both replicas
# (zero_runtime.optim.backward_update.MAX_QUEUED_BYTES each).
QUEUE_BYTES = 2 * 64 * MIB


def family_config(k: int) -> dict:
    """GPTConfig fields of family member ``k`` (>= 1): width 64 k, depth 2 k, 4x MLP."""
    return {
        "vocab_size": VOCAB,
        "seq_len": SEQ,
        "d_model": 64 * k,
        "n_heads": k,
        "n_layers": 2 * k,
        "d_ff": 256 * k,
    }


def gpt_params(cfg: dict) -> int:
    """Exact parameter count of ``build_gpt(GPTConfig(**cfg))`` (float32 elements).

    Embedding ``V C + T C``; per block: 2 layer norms ``4 C``, attention q/k/v/o kernels
    ``4 C^2`` + biases ``4 C``, MLP ``2 C F + F + C``; final norm ``2 C``; head ``C V + V``.
    """
    c, f, v, t, n = cfg["d_model"], cfg["d_ff"], cfg["vocab_size"], cfg["seq_len"], cfg["n_layers"]
    block = 4 * c + 4 * c * c + 4 * c + 2 * c * f + f + c
    return v * c + t * c + n * block + 2 * c + c * v + v


# -- one trial (runs in its own subprocess) --------------------------------------------------
def _rss() -> int:
    """This process's resident set size now, bytes (psutil)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def _disk_io() -> tuple[int, int]:
    """``(read_bytes, write_bytes)`` this process has made the storage layer fetch and
    send so far (psutil's ``io_counters``, ``/proc/self/io`` on Linux; the pools' O_DIRECT
    page I/O is all of it during a step)."""
    import psutil

    io = psutil.Process().io_counters()
    return int(io.read_bytes), int(io.write_bytes)


def disk_rates(directory: str, args) -> dict[str, float]:
    """fio's write and read bytes/s on ``directory`` at the stage-3 pool's queue depth and
    block size (its page, ``page_bytes(args)``), 256 MiB per job
    (``bench_paging.disk_rates``), with the depth and block recorded."""
    import bench_paging as bp

    depth, block = bp.pool_io_depth(), page_bytes(args)
    return {
        "depth": depth,
        "block_bytes": block,
        **bp.disk_rates(directory, 256 * MIB, depth, block),
    }


def io_lower_bound(rec: dict, fio: list[dict]) -> dict | None:
    """The largest stage-3 run's last step against the time its disk bytes need.

    Bytes: the step's ``/proc/self/io`` read and write deltas (``rec["disk_bytes_per_step"]``).
    Bandwidth: fio's (:func:`disk_rates`), measured in the same run before and after the
    stage-3 search, the mean of the two. Bound = read / read bandwidth + write / write
    bandwidth (one disk serves both; seconds). Returns None when the record has no bytes
    or no fio figures were taken."""
    disk = rec.get("disk_bytes_per_step")
    if not disk or not disk["read"] or not fio:
        return None
    used = {d: sum(f[d] for f in fio) / len(fio) for d in ("read", "write")}
    read, write = disk["read"][-1], disk["write"][-1]
    bound = read / used["read"] + write / used["write"]
    step = rec["step_seconds"][-1]
    return {
        "k": rec["k"],
        "params": rec["params"],
        "step_seconds": step,
        "disk_read_bytes": read,
        "disk_write_bytes": write,
        "fio_bytes_per_second": {"before_after": fio, "used": used},
        "bound_seconds": bound,
        "step_over_bound": step / bound if bound else None,
        "goal": 2.0,
        "goal_met": bool(bound) and step / bound <= 2.0,
    }


def run_trial(spec: dict, callbacks: tuple = ()) -> dict:
    """Train ``spec["steps"]`` steps of the model ``spec["cfg"]`` on side ``spec["side"]``
    (``callbacks``: more Keras callbacks for ``fit``, after the trial's own).

    Returns a dict of measurements (bytes, seconds). Raises whatever training raises.
    """
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from zero_runtime.devices import local_devices

    devices = local_devices(2)
    import keras
    import numpy as np
    import tensorflow as tf

    import zero_runtime
    from demo.model import GPTConfig, build_gpt
    from zero_runtime.memory import staging
    from zero_runtime.optim import backward_update

    cfg = GPTConfig(**spec["cfg"])
    side = spec["side"]
    batch, steps = spec["batch"], spec["steps"]
    rng = np.random.RandomState(0)
    x = rng.randint(0, VOCAB, size=(steps * batch, SEQ + 1)).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x[:, :-1], x[:, 1:])).batch(batch)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out: dict = {"side": side}
    t0 = time.perf_counter()
    if side == "mirrored":
        from helpers.reference_optimizers import DenseGradAdam

        strategy = tf.distribute.MirroredStrategy(list(devices.devices))
        with strategy.scope():
            model = build_gpt(cfg, seed=0)
            model.compile(optimizer=DenseGradAdam(learning_rate=1e-3), loss=loss)
        trained = model
    else:
        from zero_runtime.telemetry.collector import TelemetryCollector

        # The runtime resets the allocator's peak at each step boundary (its per-step
        # telemetry window), which falls inside the step, at the optimizer update; read
        # after fit, the peak would then cover only the last step's tail. The trial needs
        # the peak over whole steps, so the reset is disabled in this process.
        TelemetryCollector.reset_peak_each_step = False
        strategy = zero_runtime.ZeroInfinityStrategy(
            {
                "stage": 3,
                "offload_param": "nvme",
                "offload_optimizer": spec.get("offload_optimizer", "cpu"),
                "nvme_path": spec["nvme_path"],
                "page_size_bytes": spec.get("page_bytes", PAGE),
                "host_budget_bytes": spec["pool_host_bytes"],
                "persistence_threshold": 0,
                "max_reuse_distance": 0,
                "collective_timeout_seconds": spec["timeout"],
                # NVMe optimizer: the store's window and journal within the rest of the
                # host budget (None: a quarter of the available memory).
                "optimizer_host_budget_bytes": spec.get("optimizer_host_bytes"),
                **engine_keys(spec),
            }
        )
        with strategy.zero_init():  # partitioned construction: nothing replicated
            model = build_gpt(cfg, seed=0)
        with strategy.scope():
            sharded = strategy.shard_model(model)
            sharded.compile(optimizer="adam", loss=loss)
        trained = sharded
    out["params"] = int(sum(math.prod(w.shape) for w in model.trainable_weights))
    out["construct_seconds"] = time.perf_counter() - t0
    rss = out["rss_bytes"] = {"after_construction": _rss(), "after_step": []}
    disk: dict[str, list[int]] = {"read": [], "write": []}
    out["construct_peak_bytes"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    out["before_step_bytes"] = tf.config.experimental.get_memory_info("CPU:0")["current"]
    times: list[float] = []
    marks = {}
    cb = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda b, logs: (
            marks.__setitem__("io", _disk_io()),
            marks.__setitem__("t", time.perf_counter()),
        ),
        on_train_batch_end=lambda b, logs: (
            times.append(time.perf_counter() - marks["t"]),
            rss["after_step"].append(_rss()),
            [disk[d].append(n - m) for d, n, m in zip(disk, _disk_io(), marks["io"])],
        ),
    )
    hist = trained.fit(ds, epochs=1, verbose=0, callbacks=[cb, *callbacks])
    info = tf.config.experimental.get_memory_info("CPU:0")
    out["step_peak_bytes"] = int(info["peak"])
    out["after_step_bytes"] = int(info["current"])
    out["step_seconds"] = times
    out["disk_bytes_per_step"] = disk
    out["loss"] = float(hist.history["loss"][-1])
    out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if side == "mirrored":
        n = strategy.num_replicas_in_sync
        var_bytes = sum(4 * math.prod(v.shape) for v in model.weights) * n
        slot_bytes = sum(4 * math.prod(v.shape) for v in trained.optimizer.variables) * n
        out["replicas"] = n
        out["param_bytes_all_replicas"] = var_bytes
        out["optimizer_bytes_all_replicas"] = slot_bytes
    else:
        engine = sharded.engine
        usage = engine.pool.usage()
        n = engine.num_shards
        out["replicas"] = n
        out["pool_device_peak_bytes"] = max(engine.device_peaks)
        out["pool_host_peak_bytes"] = int(usage["host"].peak_bytes)
        out["pool_nvme_used_bytes"] = int(usage["nvme"].used_bytes)
        store = sharded.optimizer.zero_state.store
        # The NVMe store's peak over the steps counts its step journal (freed by the
        # next step's commit, so nbytes read now would miss it); the host store's
        # buffers are fixed (nbytes).
        out["optimizer_host_bytes"] = int(getattr(store, "peak_nbytes", store.nbytes))
        # The step transaction's parameter journal (NVMe states: old shard values kept
        # on the host until the step commits), outside the pools' budgets and not in the
        # host rule (judge): reported beside it.
        journals = sharded.optimizer.zero_state.journals
        out["param_journal_peak_bytes"] = journals.peak_host_bytes if journals else 0
        # The host calls' recycled staging buffers (memory/staging.py): the most handed
        # out at once (the queued gradient copies among them) and the free ones kept.
        out["staging_peak_live_bytes"] = staging.POOL.peak_live_bytes
        out["staging_idle_bytes"] = staging.POOL.idle_bytes
        # Gradient copies queued for the host update in backward (bounded per replica).
        out["queued_gradient_peak_bytes"] = backward_update.peak_queued_bytes(sharded.optimizer)
        out["max_block_elements"] = max_unit_gradient_elements(engine)
        out["units"] = len(engine.runner.units)
        out["tiled_layers"] = len(engine.tile_plans)
        out["checkpointed_blocks"] = len(engine.units.blocks)
        out["device_plan_bytes"] = engine.device_plan.total
        # The runtime's own per-step figures (both pools, parameters and optimizer
        # states, summed): page moves by direction, clean evictions, stalls, I/O time.
        out["runtime_steps"] = [
            {"step": r.step, "timing": dict(r.timing), "pages": dict(r.pages)}
            for r in strategy.runtime.recorder.last()
        ]
        # The whole run's page counters of each pool apart (page_totals): where the
        # bytes went, clean page-outs (writes avoided) and bytes read/written per kind.
        out["page_totals"] = page_totals(engine.pool, sharded.optimizer.zero_state.store)
        sharded.close()
        strategy.close()
    return out


def engine_keys(spec: dict) -> dict:
    """The stage-3 ZeroConfig keys of the device side: ``device_budget_bytes`` =
    ``spec["pool_device_bytes"]`` (the engine refuses a step whose device plan exceeds
    it), memory-centric tiling (``tile_size`` = that budget // 128, what ``'auto'``
    derives) and activation checkpointing."""
    return {
        "device_budget_bytes": spec["pool_device_bytes"],
        "tile_size": max(1, spec["pool_device_bytes"] // 128),
        "activation_checkpointing": True,
    }


def page_totals(param_pool, store) -> dict:
    """The page counters since creation (``zero_runtime.memory.PoolTotals.as_dict``) of
    the stage-3 parameter pool (``param_pool``: the engine's ``PagedBufferPool``) and of
    the optimizer store's pool (``NvmeOptimizerState.pool``), each apart:
    ``{"param_pool": {...}, "optimizer_store": {...} or None}``; None for a store without
    pages (``offload_optimizer='cpu'``: numpy buffers). Each has the summed PageCounters
    fields (page moves and bytes by direction, evictions, stalls, I/O seconds),
    ``clean_page_outs`` and ``writes_avoided_bytes`` (pages that left the host with no
    write, their NVMe copy current), and ``read_bytes_by_kind`` / ``written_bytes_by_kind``
    (bytes read from / written to NVMe per tensor kind). ``runtime_steps`` has the two
    pools' counters summed, per step."""
    store_pool = getattr(store, "pool", None)
    return {
        "param_pool": param_pool.totals().as_dict(),
        "optimizer_store": None if store_pool is None else store_pool.totals().as_dict(),
    }


def max_unit_gradient_elements(engine) -> int:
    """Units path: the most gradient elements one use holds on a replica (float32): an
    untiled unit's full gradient (before its reduce-scatter), or a tiled kernel's widest
    tile's full gradient plus the kernel's reduced shard the tiles fill."""
    most = 0
    for unit in engine.runner.units:
        if unit.tiles is not None:
            plan = unit.tiles.plan
            most = max(most, plan.tile_elements + plan.kernel.shard_elements)
        else:
            most = max(most, sum(math.prod(v.shape) for v in unit.variables))
    return most


def trial_spec(side: str, cfg: dict, args, nvme_dir: str, timeout: float) -> dict:
    """The spec :func:`run_trial` takes: side, model config, batch, steps, the budgets
    (bytes) derived from ``args`` (:func:`parser`), ``nvme_dir`` for the pools' files and
    the collectives' ``timeout`` (seconds)."""
    return {
        "side": side,
        "cfg": cfg,
        "batch": args.batch,
        "steps": args.steps,
        "nvme_path": nvme_dir,
        "device_bytes": args.device_mib * MIB,
        "page_bytes": page_bytes(args),
        "pool_device_bytes": int(args.device_mib * MIB * args.pool_device_fraction)
        // page_bytes(args)
        * page_bytes(args),
        "host_bytes": args.host_mib * MIB,
        "pool_host_bytes": pool_host_bytes(cfg, args),
        # The store's peak counts its tile scratch beside the allowance: OPT_MARGIN for it
        # (k=22 at batch 2 was 1 MiB over the host budget without); the update queues'
        # gradient copies take QUEUE_BYTES.
        "optimizer_host_bytes": (
            args.host_mib * MIB - pool_host_bytes(cfg, args) - OPT_MARGIN - QUEUE_BYTES
            if args.offload_optimizer == "nvme"
            else None
        ),
        "offload_optimizer": args.offload_optimizer,
        "timeout": timeout,
    }


# -- driver ------------------------------------------------------------------------------------
def trial(side: str, k: int | None, args, deadline: float, cfg: dict | None = None) -> dict:
    """Run one trial in a subprocess; return its record with ``fits`` and ``reason``.

    Its timeout is ``args.trial_timeout`` seconds, or less when ``deadline`` (a
    ``time.perf_counter()`` value) comes first; a timeout means "does not fit".
    """
    timeout = max(1.0, min(args.trial_timeout, deadline - time.perf_counter()))
    cfg = cfg or family_config(k)
    nvme_dir = tempfile.mkdtemp(prefix="max_model_", dir=args.nvme_path)
    spec = trial_spec(side, cfg, args, nvme_dir, timeout)
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    if side == "mirrored" or args.cap_stage3:  # stage 3: see the module docstring
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(args.device_mib)
    rec = {"side": side, "k": k, "cfg": cfg, "params": gpt_params(cfg)}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--trial", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        rec["wall_seconds"] = round(time.perf_counter() - t0, 1)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TRIAL ")]
        if proc.returncode == 0 and lines:
            rec.update(json.loads(lines[-1][6:]))
            rec["fits"], rec["reason"] = judge(rec, args)
        else:
            err = proc.stderr or ""
            tail = err.strip().splitlines()[-3:]
            oom = any(w in err for w in ("ResourceExhausted", "OutOfMemory", "OOM when"))
            rec["fits"] = False
            rec["reason"] = ("oom: " if oom else f"exit {proc.returncode}: ") + " | ".join(tail)
    except subprocess.TimeoutExpired:
        rec["wall_seconds"] = round(time.perf_counter() - t0, 1)
        rec["fits"], rec["reason"] = False, f"timeout after {timeout:.0f} s"
        rec["timeout_seconds"] = timeout
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    print(
        f"[{time.strftime('%H:%M:%S')}] {side:8s} k={k} params={rec['params']:,} "
        f"fits={rec['fits']} ({rec['reason'][:160]}) wall={rec.get('wall_seconds')} s",
        flush=True,
    )
    return rec


def pool_host_bytes(cfg: dict, args) -> int:
    """Host budget given to the stage-3 pool (the run's ``host_budget_bytes``).

    ``--offload-optimizer cpu``: the host budget minus the host optimizer states, which
    live outside the pool (Adam: 8 bytes/parameter, + ``OPT_MARGIN`` bytes for padding
    and tile scratch). ``nvme``: half the host budget; the other half is the NVMe
    optimizer store's allowance for its streamed window and step journal (ZeroConfig
    ``optimizer_host_budget_bytes``; its sub-groups shrink to fit). At least 64 pages."""
    page = page_bytes(args)
    if getattr(args, "offload_optimizer", "cpu") == "nvme":
        return max(64 * page, args.host_mib * MIB // 2 // page * page)
    rest = args.host_mib * MIB - 8 * gpt_params(cfg) - OPT_MARGIN
    return max(64 * page, rest // page * page)


def page_bytes(args) -> int:
    """The stage-3 pools' page size, bytes: ``--page-kib`` KiB, by default 1 MiB: at
    64 KiB the steps spend their time in per-page bookkeeping (trial k=6, NVMe parameters
    and optimizer: 6.7-7.0 s per step at 64 KiB, 2.5-3.2 s at 1 MiB, same loss and device
    peak)."""
    return (getattr(args, "page_kib", 0) or 1024) * 1024


def judge(rec: dict, args) -> tuple[bool, str]:
    """The fit rule: the steps finished (under the allocator cap), device step peak and
    construction peak <= budget; stage 3 also host (pool host peak + optimizer states)."""
    budget = args.device_mib * MIB
    peak = rec["step_peak_bytes"]
    if rec["construct_peak_bytes"] > budget:
        return False, f"device: construction peak {rec['construct_peak_bytes']} > budget"
    if peak > budget:
        return False, f"device: step peak {peak} > budget {budget} bytes"
    if rec["side"] == "stage3":
        host = (
            rec["pool_host_peak_bytes"]
            + rec["optimizer_host_bytes"]
            + rec.get("queued_gradient_peak_bytes", 0)
        )
        if host > args.host_mib * MIB:
            return False, (
                f"host: pool host peak + optimizer states + queued gradients {host} > budget"
            )
    return True, "ok"


def search(side: str, args, deadline: float, trials: list, k: int = 1) -> int | None:
    """Doubling then bisection over k from ``k``; returns the largest k that fit (None if
    none). Trials already in ``trials`` for (side, k) are reused, not rerun."""
    best, fail = None, None
    while fail is None:
        rec = next((t for t in trials if t["side"] == side and t["k"] == k), None)
        if rec is None:
            if time.perf_counter() + args.min_trial > deadline:
                return best
            rec = trial(side, k, args, deadline)
            trials.append(rec)
        if rec["fits"]:
            best = k
            p = gpt_params(family_config(k))
            k = next(j for j in range(k + 1, 10_000) if gpt_params(family_config(j)) >= 2 * p)
        else:
            fail = k
    lo = best or 0
    while fail - lo > 1 and time.perf_counter() + args.min_trial <= deadline:
        mid = (lo + fail) // 2
        rec = trial(side, mid, args, deadline)
        trials.append(rec)
        if rec["fits"]:
            lo = best = mid
        else:
            fail = mid
    return best


def machine() -> dict:
    """Date and machine figures (nproc, RAM, CPU model, disk under the NVMe path)."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "ram_bytes": mem,
        "cpu": cpu,
    }


def disk(path: str) -> dict:
    """Device and free space of the filesystem holding ``path``."""
    du = shutil.disk_usage(path)
    dev = subprocess.run(["df", "--output=source", path], capture_output=True, text=True)
    return {
        "path": path,
        "source": dev.stdout.split()[-1] if dev.stdout.split() else None,
        "total_bytes": du.total,
        "free_bytes": du.free,
    }


def states_ratio(s3: dict, mir: dict) -> dict:
    """Device bytes of model states per replica, stage 3 + offload over Mirrored.

    Mirrored (per replica): its parameters and Adam slots (measured: the variables' bytes,
    held on the device all step) + a full gradient (4 bytes/parameter: Keras holds each
    replica's full gradient before the update; transient). Stage 3 (per replica): the
    pool's measured device-tier peak (gathered parameter pages) / replicas + one block's
    full reduced gradient (4 bytes x the largest block: the CPU backward all-reduces a
    block and keeps its slice, docs/stages/stage3.md) + 0 optimizer bytes (host).
    """
    n = mir["replicas"]
    mir_params = mir["param_bytes_all_replicas"] / n
    mir_opt = mir["optimizer_bytes_all_replicas"] / n
    mir_grad = 4 * mir["params"]
    s3_params = s3["pool_device_peak_bytes"] / s3["replicas"]
    s3_grad = 4 * s3["max_block_elements"]
    mir_total = mir_params + mir_opt + mir_grad
    s3_total = s3_params + s3_grad
    return {
        "mirrored_per_replica": {"params": mir_params, "optimizer": mir_opt, "grads": mir_grad},
        "stage3_per_replica": {"params": s3_params, "optimizer": 0, "grads": s3_grad},
        "ratio_params_grads_optimizer": s3_total / mir_total,
        "ratio_persistent_only": s3_params / (mir_params + mir_opt),
        "ratio_step_peak_allocator": s3["step_peak_bytes"] / mir["step_peak_bytes"],
        "goal": 0.02,
        "goal_met": s3_total / mir_total <= 0.02,
    }


def parser() -> argparse.ArgumentParser:
    """The command line of :func:`main` (also read by ``bench/profile_step.py``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trial", help=argparse.SUPPRESS)
    ap.add_argument("--device-mib", type=int, default=256)
    ap.add_argument("--host-mib", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    ap.add_argument("--steps", type=int, default=2, help="steps per trial (1st traces)")
    ap.add_argument("--trial-timeout", type=float, default=240.0, help="seconds")
    ap.add_argument(
        "--min-trial", type=float, default=45.0, help="no trial starts with less time left"
    )
    ap.add_argument("--total-minutes", type=float, default=15.0)
    ap.add_argument("--mirrored-minutes", type=float, default=5.0)
    ap.add_argument("--nvme-path", default="/tmp/zero_max_model_nvme")
    ap.add_argument("--start-k", type=int, default=2, help="first family member tried")
    ap.add_argument("--ratio-k", type=int, default=0, help="family k for the ratio model")
    ap.add_argument(
        "--stage3-start-k", type=int, default=0, help="first stage-3 k searched (0: ratio k)"
    )
    ap.add_argument(
        "--cap-stage3",
        action="store_true",
        help="also cap the stage-3 allocator at the budget (OOMs early: module docstring)",
    )
    ap.add_argument(
        "--offload-optimizer",
        choices=("cpu", "nvme"),
        default="cpu",
        help="stage 3's optimizer states: host Adam ('cpu') or NVMe, streamed ('nvme')",
    )
    ap.add_argument(
        "--page-kib",
        type=int,
        default=0,
        help="stage-3 page size in KiB (0: 1024; page_bytes)",
    )
    ap.add_argument(
        "--pool-device-fraction",
        type=float,
        default=0.25,
        help="share of the device budget given to the stage-3 engine (its device_budget_bytes"
        "); the rest is headroom for the step's tensors it does not plan (module docstring)",
    )
    return ap


def main() -> None:
    """Search both sides, measure the states ratio, write the results file."""
    args = parser().parse_args()
    if args.trial:
        print("TRIAL " + json.dumps(run_trial(json.loads(args.trial))), flush=True)
        return
    os.makedirs(args.nvme_path, exist_ok=True)
    start = time.perf_counter()
    end = start + 60 * args.total_minutes
    trials: list[dict] = []
    k_mir = search(
        "mirrored", args, min(end, start + 60 * args.mirrored_minutes), trials, args.start_k
    )
    # The states ratio on one model both train: the deepest-narrow member Mirrored fits.
    ratio = None
    k_ratio = args.ratio_k or k_mir
    if k_ratio:
        s3_rec = trial("stage3", k_ratio, args, end)
        trials.append(s3_rec)
        mir_rec = next((t for t in trials if t["side"] == "mirrored" and t["k"] == k_ratio), None)
        if mir_rec is None:
            mir_rec = trial("mirrored", k_ratio, args, end)
            trials.append(mir_rec)
        if s3_rec["fits"] and mir_rec["fits"]:
            ratio = {"k": k_ratio, "params": s3_rec["params"], **states_ratio(s3_rec, mir_rec)}
    fio = [disk_rates(args.nvme_path, args)]
    k_s3 = search("stage3", args, end, trials, args.stage3_start_k or k_ratio or args.start_k)
    fio.append(disk_rates(args.nvme_path, args))
    best = {
        side: max((t for t in trials if t["side"] == side and t["fits"]), key=lambda t: t["k"])
        if any(t["side"] == side and t["fits"] for t in trials)
        else None
        for side in ("mirrored", "stage3")
    }
    p_mir = best["mirrored"]["params"] if best["mirrored"] else 0
    p_s3 = best["stage3"]["params"] if best["stage3"] else 0
    first_fail = {
        side: min(
            (t for t in trials if t["side"] == side and not t["fits"]),
            key=lambda t: t["k"],
            default=None,
        )
        for side in ("mirrored", "stage3")
    }
    result = {
        **machine(),
        "disk": disk(args.nvme_path),
        "device_budget_bytes": args.device_mib * MIB,
        "host_budget_bytes": args.host_mib * MIB,
        "replicas": 2,
        "family": "demo.model.build_gpt: d_model=64k, n_layers=2k, n_heads=k, d_ff=4*d_model, "
        f"vocab={VOCAB}, seq_len={SEQ}; Adam",
        "global_batch": args.batch,
        "steps_per_trial": args.steps,
        "trial_timeout_seconds": args.trial_timeout,
        "stage3_config": "stage 3, offload_param=nvme, "
        f"offload_optimizer={args.offload_optimizer}, built inside "
        f"strategy.zero_init() (partitioned construction), {page_bytes(args) // 1024} KiB pages, "
        "max_reuse_distance=0, "
        f"persistence_threshold=0, by units: device_budget_bytes = "
        f"{args.pool_device_fraction} x the device budget, tile_size = that // 128 "
        "elements, activation_checkpointing=True",
        "device_measure": "BFC CPU allocator peak in-use bytes during the trained steps "
        "(both logical CPU replicas; includes the pool's device-tier pages). Cap on "
        f"{'both sides' if args.cap_stage3 else 'mirrored'} from construction on: "
        "TF_CPU_BFC_MEM_LIMIT_IN_MB=budget (OOM = no fit); "
        "fit iff the steps finish and the construction and step peaks are <= budget",
        "max_params": {"mirrored": p_mir, "stage3_nvme": p_s3},
        "max_k": {"mirrored": k_mir, "stage3_nvme": k_s3},
        "ratio_stage3_over_mirrored_params": p_s3 / p_mir if p_mir else None,
        "first_failure": {
            s: ({"k": t["k"], "params": t["params"], "reason": t["reason"]} if t else None)
            for s, t in first_fail.items()
        },
        "model_states_device_ratio": ratio,
        "largest_stage3_io": io_lower_bound(best["stage3"], fio) if best["stage3"] else None,
        "total_seconds": round(time.perf_counter() - start, 1),
        "trials": trials,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "trials"}, indent=2))


if __name__ == "__main__":
    main()
