"""Every ZeRO stage and offload mode across workers: one process runs several configs.

Multi-worker when ``TF_CONFIG`` names a cluster (``zero_runtime.launch`` sets it), else
single-process over ``--replicas`` local CPU replicas. For each config name (see
:data:`CONFIGS`) the process builds a fresh strategy, trains, closes it, and writes
``<out>/<name>_rank<R>.json``: per-step losses (Keras's, averaged over all replicas), the
final weights (gathered across workers) and the replica counts. Running several configs
in one process pays TensorFlow's start-up (~5 s per process) once.

    python tests/helpers/mw_stage3_job.py OUT --configs s3_param_cpu,s1_opt_none

Stage-3 configs train :func:`stage3_record`'s small GPT (``demo.model``), except
``s3_embedding`` (:func:`embedding_record`: a row-paged Embedding -> Flatten -> Dense with
SGD, default budgets); stage-1/2 configs train ``mw_job.fit_record``'s two-Dense model.
"""

# isort: skip_file  (the environment must be set before TensorFlow is imported)
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STEPS = 5
GLOBAL_BATCH = 8
PAGE = 65536  # page_size_bytes of the stage-3 configs
TUNE_AT = 2  # 's2_tuning': the batch before which rank 0 writes the control request
TUNED = {"prefetch_bucket_size": 12345, "telemetry_every_n_steps": 2}
# 's3_embedding': a 20_000 x 16 table (1024 rows per 64 KiB page: 10 row pages per shard of
# 10_000 rows), 4 ids per example, ids 3/4 from 600 hot rows at the start of both shards.
EMB_VOCAB, EMB_WIDTH, EMB_SEQ, EMB_LR = 20_000, 16, 4, 0.5

#: Config name -> ZeroConfig keys (besides the timeout). 's3_*' are stage 3 (GPT model).
CONFIGS: dict[str, dict] = {
    "s3_param_none": {"stage": 3, "offload_param": "none", "offload_optimizer": "cpu"},
    "s3_param_cpu": {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"},
    "s3_param_nvme": {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme"},
    "s3_opt_none": {"stage": 3, "offload_param": "cpu", "offload_optimizer": "none"},
    "s3_all_device": {"stage": 3, "offload_param": "none", "offload_optimizer": "none"},
    # the GPT nested in a functional DAG (a residual logit branch): run by units
    "s3_units": {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"},
    # the same on the device tier: shard variables, no host call in the step
    "s3_units_device": {"stage": 3, "offload_param": "none", "offload_optimizer": "none"},
    # accumulation on gradient shards (zero_runtime/stage3/accumulation.py), host states
    "s3_accum": {
        "stage": 3,
        "offload_param": "cpu",
        "offload_optimizer": "cpu",
        "gradient_accumulation_steps": 2,
    },
    # a row-paged table (threshold below its 320_000 elements), SGD, no budgets given
    "s3_embedding": {
        "stage": 3,
        "offload_param": "cpu",
        "offload_optimizer": "cpu",
        "embedding_row_paging_threshold": 100_000,
    },
    "s1_opt_none": {"stage": 1, "offload_optimizer": "none", "reduce_bucket_size": 200},
    "s2_opt_none": {"stage": 2, "offload_optimizer": "none", "reduce_bucket_size": 200},
    "s1_accum": {
        "stage": 1,
        "offload_optimizer": "cpu",
        "gradient_accumulation_steps": 2,
        "reduce_bucket_size": 200,
    },
    # live tuning: rank 0 (the chief) writes a request into its run before step TUNE_AT
    "s2_tuning": {"stage": 2, "offload_optimizer": "cpu", "reduce_bucket_size": 200},
    "s2_accum_opt_none": {
        "stage": 2,
        "offload_optimizer": "none",
        "gradient_accumulation_steps": 2,
        "reduce_bucket_size": 200,
    },
}


def make_config(name: str, nvme_dir: str, timeout: float) -> dict:
    """The full config dict of ``name`` (NVMe files under ``nvme_dir``)."""
    config = dict(CONFIGS[name], collective_timeout_seconds=timeout)
    if config["stage"] == 3:
        config.update(page_size_bytes=PAGE, persistence_threshold=100)
    if "nvme" in (config.get("offload_param"), config.get("offload_optimizer")):
        config["nvme_path"] = nvme_dir
    return config


def _common_record(strategy, running: list[float], weights: list) -> dict:
    """The fields every config's record has: replica counts, strategy class, per-step
    losses (from Keras's running means) and the weights as nested lists."""
    return {
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "local_replicas": len(strategy.device_info.devices),
        "strategy": type(strategy).__name__,
        "losses": _step_losses(running),
        "weights": [w.tolist() for w in weights],
    }


def _step_losses(running: list[float]) -> list[float]:
    """Each step's loss from Keras's running epoch mean."""
    return [running[0]] + [
        (i + 1) * running[i] - i * running[i - 1] for i in range(1, len(running))
    ]


def stage3_record(strategy, steps: int = STEPS, dag: bool = False) -> dict:
    """Fit the small GPT under a stage-3 ``strategy`` for ``steps`` global batches of 8.

    With ``dag`` the GPT is nested in a functional model that adds a residual logit
    branch (``Embedding -> Dense`` on the same tokens): not a chain, so stage 3 runs it by
    units (zero_runtime/stage3/gather.py).

    Returns ``{"losses": [...], "weights": [...], "num_replicas_in_sync", "local_replicas",
    "strategy"}``; the weights are ``model.get_weights()`` (gathered across workers).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    from demo.model import GPTConfig, build_gpt

    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=32)
    rng = np.random.RandomState(5)
    tokens = np.zeros((steps * GLOBAL_BATCH, cfg.seq_len + 1), np.int64)
    tokens[:, 0] = rng.randint(0, cfg.vocab_size, size=steps * GLOBAL_BATCH)
    for i in range(cfg.seq_len):
        tokens[:, i + 1] = (5 * tokens[:, i] + 3) % cfg.vocab_size
    x, y = tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with strategy.scope():
        model = build_gpt(cfg, seed=3)
        if dag:
            keras.utils.set_random_seed(4)  # the side branch's weights: the same per process
            tokens_in = keras.Input((cfg.seq_len,), dtype="int32")
            side = keras.layers.Embedding(cfg.vocab_size, 8, name="side_emb")(tokens_in)
            side = keras.layers.Dense(cfg.vocab_size, name="side_head")(side)
            model = keras.Model(tokens_in, keras.layers.Add()([model(tokens_in), side]))
        sharded = strategy.shard_model(model)
        sharded.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    running: list[float] = []
    cb = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: running.append(float(logs["loss"]))
    )
    sharded.fit(ds, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    weights = model.get_weights()
    record = {
        **_common_record(strategy, running, weights),
        "shard_tiers": sorted({v.tier for v in sharded.engine.variables}),
        "optimizer_tier": sharded.optimizer.zero_state.store.tier,
        "local_replica_ids": list(sharded.engine.local_replicas),
        "variables": len(sharded.engine.variables),
        # pool tensors of parameter shards ("p/<var>/r<replica>", or the flat space's
        # chunks "p/params#<id>/c<k>/r<replica>" on host/NVMe): this process's only
        "shard_tensors": sorted(
            int(t.rsplit("/r", 1)[1])
            for t in sharded.engine.pool.tensor_ids()
            if t.startswith("p/")
        ),
        # per replica: one tensor per variable, or the flat space's chunks
        "shard_tensors_per_replica": (
            sharded.engine.space.allocated_chunks
            if sharded.engine.space is not None
            else len(sharded.engine.variables)
        ),
    }
    sharded.close()
    return record


def embedding_data(steps: int = STEPS) -> tuple:
    """``(ids int32 (steps * 8, EMB_SEQ), y float32 (steps * 8, 1), initial weights)``."""
    import numpy as np

    rng = np.random.RandomState(11)
    n = steps * GLOBAL_BATCH
    hot = np.concatenate([np.arange(0, 300), np.arange(10_000, 10_300)])
    ids = np.where(
        rng.rand(n, EMB_SEQ) < 0.75,
        rng.choice(hot, (n, EMB_SEQ)),
        rng.randint(0, EMB_VOCAB, (n, EMB_SEQ)),
    ).astype(np.int32)
    ids[0, :2] = 7  # a duplicate id within one replica's batch
    ids[GLOBAL_BATCH // 2, 0] = 7  # ... and the same id in the other replica's batch
    y = rng.normal(size=(n, 1)).astype(np.float32)
    initial = [
        rng.uniform(-0.05, 0.05, (EMB_VOCAB, EMB_WIDTH)).astype(np.float32),
        rng.uniform(-0.2, 0.2, (EMB_SEQ * EMB_WIDTH, 1)).astype(np.float32),
        np.zeros(1, np.float32),
    ]
    return ids, y, initial


def embedding_record(strategy, steps: int = STEPS) -> dict:
    """Fit a row-paged ``Embedding -> Flatten -> Dense(1)`` with SGD (mse) under a stage-3
    ``strategy`` with the engine's default budgets; returns losses, the gathered weights,
    this process's row pages (replica ids and count per tier) and the pool's page moves."""
    import keras
    import numpy as np
    import tensorflow as tf

    from zero_runtime.optim import SGD

    ids, y, initial = embedding_data(steps)
    ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(GLOBAL_BATCH)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((EMB_SEQ,), dtype="int32"),
                keras.layers.Embedding(EMB_VOCAB, EMB_WIDTH),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
        model.set_weights(initial)
        sharded = strategy.shard_model(model)
        sharded.compile(optimizer=SGD(learning_rate=EMB_LR), loss="mse")
    running: list[float] = []
    h2d: list[int] = []
    cb = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: (
            running.append(float(logs["loss"])),
            h2d.append(sharded.engine.last_step.counters.h2d_pages),
        )
    )
    sharded.fit(ds, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    weights = model.get_weights()  # the table gathered across workers
    engine = sharded.engine
    (emb,) = engine.row_paged.values()
    (row,) = [r for r in engine.placement_rows("host") if r.get("row_paged")]
    record = {
        **_common_record(strategy, running, weights),
        "touched": np.unique(ids).tolist(),
        "initial_table": initial[0].tolist(),
        "local_replica_ids": list(engine.local_replicas),
        # row pages of this process's pool ("e/<table>/r<replica>/p<k>"): replica ids
        "row_page_replicas": sorted(
            {int(t.split("/")[2][1:]) for t in engine.pool.tensor_ids() if t[:2] == "e/"}
        ),
        "row_pages": sum(1 for t in engine.pool.tensor_ids() if t[:2] == "e/"),
        "pages_per_shard": emb.table.pages_per_shard,
        "device_capacity": engine.pool.usage()["device"].capacity_bytes,
        "h2d_pages": h2d,
        "placement_row": row,
    }
    sharded.close()
    return record


def tuning_record(strategy, logdir: str) -> dict:
    """Fit ``mw_job``'s model; before batch TUNE_AT the chief's run gets a control request
    (``control.write_request``, what the view's tuning panel calls). Returns the losses,
    every worker's control decisions and the tuned keys' final values."""
    import keras

    from zero_runtime import control

    rank = getattr(getattr(strategy, "cluster", None), "rank", 0)
    run_dir = os.path.join(logdir, "worker_0") if hasattr(strategy, "cluster") else logdir

    class Request(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == TUNE_AT and rank == 0:
                control.write_request(run_dir, TUNED)

    from helpers import mw_job

    record = mw_job.fit_record(strategy, mw_job.STEPS, logdir, callbacks=[Request()])
    record["decisions"] = [o.to_dict() for o in strategy.runtime.control.history]
    record["tuned"] = {k: getattr(strategy.config, k) for k in TUNED}
    return record


def run(name: str, out: str, replicas: int, timeout: float) -> dict:
    """Train config ``name`` under a fresh strategy; return its record (also written)."""
    import zero_runtime
    from helpers import mw_job

    nvme_dir = os.path.join(out, "nvme")
    os.makedirs(nvme_dir, exist_ok=True)
    config = make_config(name, nvme_dir, timeout)
    logdir = os.path.join(out, f"logs_{name}") if name.endswith("tuning") else None
    strategy = zero_runtime.ZeroInfinityStrategy(config, num_cpu_replicas=replicas, logdir=logdir)
    if name == "s3_embedding":
        record = embedding_record(strategy)
    elif config["stage"] == 3:
        record = stage3_record(strategy, dag=name.startswith("s3_units"))
    elif logdir is not None:
        record = tuning_record(strategy, logdir)
    else:
        record = mw_job.fit_record(strategy, mw_job.STEPS, out)
    record["fallback_mirrored"] = strategy.runtime.fallback_mirrored
    strategy.close()
    rank = getattr(getattr(strategy, "cluster", None), "rank", 0)
    record.update(rank=rank, config=name)
    with open(os.path.join(out, f"{name}_rank{rank}.json"), "w") as f:
        json.dump(record, f)
    return record


def _wait_for(paths: list[str], deadline_s: float) -> None:
    """Block until every path exists; RuntimeError naming the missing ones after
    ``deadline_s`` seconds."""
    end = time.monotonic() + deadline_s
    while True:
        missing = [p for p in paths if not os.path.exists(p)]
        if not missing:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"peers did not finish within {deadline_s:g} s: {missing}")
        time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--configs", required=True, help="comma-separated names of CONFIGS")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args()
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [tests_dir, os.path.dirname(tests_dir)]  # helpers, and demo from the repo
    world = int(os.environ.get("ZERO_RUNTIME_WORLD_SIZE", "1"))
    previous = None
    for name in args.configs.split(","):
        if previous is not None:
            # Barrier: every worker has closed the previous config's strategy before any
            # creates the next one. Without it a fast chief re-enabled collective ops and
            # broadcast the next model's first variable while its peer was still closing
            # the previous strategy; both then waited forever on a matching broadcast
            # (same group/instance keys; seen under heavy load in CI).
            _wait_for(
                [os.path.join(args.out, f"{previous}_rank{r}.json") for r in range(world)],
                deadline_s=max(120.0, 4 * args.timeout),
            )
        record = run(name, args.out, args.replicas, args.timeout)
        previous = name
        print(f"rank {record['rank']} {name} done: losses {record['losses']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
