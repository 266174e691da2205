"""Tiny training jobs for the checkpoint tests (in-process helpers and a subprocess CLI).

In-process: :func:`build` makes a compiled model under a ZeroInfinityStrategy (a
``ShardedModel`` at stage 3), :func:`train` fits it one global batch at a time and
returns each step's loss (``train_on_batch``).

As a process (a fresh TensorFlow that configures its own logical CPUs)::

    python tests/helpers/checkpoint_job.py restore OUT.json --spec 2:nvme:CKPT [--spec ...] \
        --replicas 1,4 --first-step 3 --steps 3 [--nvme DIR]

restores each ``CKPT`` on each replica count in turn, trains ``--steps`` steps and writes
``{"STAGE:OFFLOAD:REPLICAS": {"losses": [...], ...}}``.
With ``multiworker`` instead of ``restore`` (under ``zero_runtime.launch``), optionally
first a stage-3 save / continue / restore phase (``--stage3-root``, :func:`_stage3_phase`)
and a row-paged embedding save / continue phase (``--embedding-root``), then (stage
``--stage``) trains ``--first-step`` steps, saves (``step A``), writes the weights,
trains one more step and saves again (``B``; rank ``--kill-rank`` SIGKILLs itself after
its first shard file).
"""

# isort: skip_file  (the environment must be set before TensorFlow is imported)
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GLOBAL_BATCH = 8
FEATURES, HIDDEN, CLASSES = 6, 12, 4
TOTAL_STEPS = 12


def config(stage: int, offload: str, nvme: str | None = None, **extra) -> dict:
    """A ZeroConfig mapping for the tiny model (several buckets at stages 1-2)."""
    cfg = {
        "stage": stage,
        "offload_optimizer": offload,
        "collective_timeout_seconds": 30.0,
        "page_size_bytes": 65536,
    }
    if stage < 3:
        cfg["reduce_bucket_size"] = 50
    else:
        cfg["persistence_threshold"] = 10  # biases persistent, kernels not
    if offload == "nvme":
        cfg["nvme_path"] = nvme
        cfg["sub_group_size"] = 40
    cfg.update(extra)
    return cfg


def strategy_for(stage: int, offload: str, nvme: str | None = None, **extra):
    """A ZeroInfinityStrategy of :func:`config` (stage 3: parameters on the host)."""
    import zero_runtime

    cfg = config(stage, offload, nvme, **extra)
    if stage == 3:
        cfg.setdefault("offload_param", "cpu")
    return zero_runtime.ZeroInfinityStrategy(cfg)


def close(strategy, model) -> None:
    """Close the model (stage 3's ShardedModel holds a pool) and the strategy."""
    if hasattr(model, "close"):
        model.close()
    strategy.close()


def data():
    """Deterministic regression data: ``TOTAL_STEPS`` global batches of 8 x 6 -> 4."""
    import numpy as np

    rng = np.random.RandomState(11)
    x = rng.randn(TOTAL_STEPS * GLOBAL_BATCH, FEATURES).astype("float32")
    y = np.tanh(x @ rng.randn(FEATURES, CLASSES)).astype("float32")
    return x, y


def build(strategy, seed: int = 0, metrics=None):
    """The compiled tiny model under ``strategy`` (stage 3: the ShardedModel), with
    ``metrics`` (a list for ``compile``, or None)."""
    import keras

    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(HIDDEN, activation="tanh"),
                keras.layers.Dense(HIDDEN, activation="tanh"),
                keras.layers.Dense(CLASSES),
            ]
        )
        if strategy.config.stage == 3:
            model = strategy.shard_model(model)
        model.compile(optimizer=keras.optimizers.get("adam"), loss="mse", metrics=metrics)
    return model


#: Row-paged embedding model (stage 3): a (VOCAB, WIDTH) table above the threshold, 64 KiB
#: pages of 1024 rows; at 2 replicas a shard is rows [0, 4000) / [4000, 8000), 4 pages.
VOCAB, WIDTH, SEQ = 8000, 16, 4
ROW_PAGING_THRESHOLD = 100_000  # elements; the table has 128_000
#: The ids the embedding data uses: row pages 0-1 of replica 0's shard and page 0 of
#: replica 1's (at 1 replica: pages 0, 1, 3 and 4 of 8); the other pages stay untouched.
EMBEDDING_IDS = (0, 1500, 4000, 4500)


def embedding_config(offload: str, nvme: str | None = None, **extra) -> dict:
    """A stage-3 ZeroConfig with row paging for :func:`build_embedding`'s table."""
    cfg = config(3, offload, nvme, offload_param="cpu", **extra)
    cfg["embedding_row_paging_threshold"] = ROW_PAGING_THRESHOLD
    return cfg


def build_embedding(strategy, seed: int = 0):
    """The compiled ShardedModel: Embedding(VOCAB, WIDTH) -> Flatten -> Dense(1), Adam
    (lazy on the table's rows)."""
    import keras

    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential(
            [
                keras.Input((SEQ,), dtype="int32"),
                keras.layers.Embedding(VOCAB, WIDTH),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
        model = strategy.shard_model(model)
        model.compile(optimizer=keras.optimizers.get("adam"), loss="mse")
    return model


def embedding_data():
    """``TOTAL_STEPS`` global batches of 8 x SEQ ids from :data:`EMBEDDING_IDS`' two
    ranges, and float32 targets (8, 1)."""
    import numpy as np

    rng = np.random.RandomState(12)
    n = TOTAL_STEPS * GLOBAL_BATCH
    a, b, c, d = EMBEDDING_IDS
    ids = np.where(rng.rand(n, SEQ) < 0.5, rng.randint(a, b, (n, SEQ)), rng.randint(c, d, (n, SEQ)))
    return ids.astype("int32"), rng.randn(n, 1).astype("float32")


def train(model, first: int, steps: int, dataset=None) -> list[float]:
    """Train on global batches ``first .. first + steps - 1`` of ``dataset()`` (default
    :func:`data`); each step's loss (``train_on_batch`` resets the metrics, so its loss is
    that batch's)."""
    x, y = (dataset or data)()
    losses = []
    for s in range(first, first + steps):
        sl = slice(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)
        losses.append(float(model.train_on_batch(x[sl], y[sl])))
    return losses


def _restore_main(args) -> int:
    import zero_runtime
    from zero_runtime.checkpoint import CheckpointManager

    out = {}
    replicas = sorted((int(r) for r in args.replicas.split(",")), reverse=True)
    for spec in args.spec:  # STAGE:OFFLOAD:CKPT
        stage, offload, ckpt = spec.split(":", 2)
        for n in replicas:  # the largest first configures the logical devices
            strategy = zero_runtime.ZeroInfinityStrategy(
                config(int(stage), offload, args.nvme), num_cpu_replicas=n
            )
            model = build(strategy, seed=99)  # another init: restore must overwrite it
            info = CheckpointManager(ckpt, model, strategy).restore()
            losses = train(model, args.first_step, args.steps)
            out[f"{stage}:{offload}:{n}"] = {
                "losses": losses,
                "replicas": strategy.num_replicas_in_sync,
                "step": info.step,
                "saved_replicas": info.saved_replicas,
                "iterations": int(model.optimizer.iterations.numpy()),
            }
            if hasattr(model, "close"):
                model.close()
            strategy.close()
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


def _stage3_phase(args) -> None:
    """Stage 3 across the workers (``--stage3-root``): train ``--first-step`` steps, save
    ``S3``, train ``--steps`` more (the uninterrupted run), then restore ``S3`` into a
    fresh model under a fresh strategy and train the same steps again. Writes
    ``<out>/rank<R>_stage3.json``. Parameters and optimizer states are on NVMe."""
    import zero_runtime
    from zero_runtime.checkpoint import CheckpointManager

    cfg = config(3, "nvme", args.nvme, offload_param="nvme")
    strategy = zero_runtime.ZeroInfinityStrategy(cfg, num_cpu_replicas=1)
    rank = strategy.cluster.rank
    model = build(strategy)
    train(model, 0, args.first_step)
    saved = CheckpointManager(args.stage3_root, model, strategy).save(tag="S3")
    weights = model.get_weights()  # all-gathers the shards: every worker calls it
    uninterrupted = train(model, args.first_step, args.steps)
    record = {
        "rank": rank,
        "bytes_written": saved.bytes_written,
        "weights": [w.tolist() for w in weights],
        "uninterrupted": uninterrupted,
        "local_replicas": list(strategy.local_replica_ids),
    }
    model.close()
    strategy.close()
    strategy = zero_runtime.ZeroInfinityStrategy(cfg, num_cpu_replicas=1)
    model = build(strategy, seed=99)  # another init: everything must come from the files
    info = CheckpointManager(args.stage3_root, model, strategy).restore()
    record["restored_weights"] = [w.tolist() for w in model.get_weights()]
    record["restored"] = train(model, args.first_step, args.steps)
    record.update(step=info.step, saved_replicas=info.saved_replicas, replicas=info.replicas)
    record["iterations"] = int(model.optimizer.iterations.numpy())
    model.close()
    strategy.close()
    with open(os.path.join(args.out, f"rank{rank}_stage3.json"), "w") as f:
        json.dump(record, f)


def _embedding_phase(args) -> None:
    """A row-paged table across the workers (``--embedding-root``): train
    ``--first-step`` steps, save ``E`` (each worker its own replica's rows and touched
    state pages), train ``--steps`` more. Writes ``<out>/rank<R>_embedding.json`` (the
    losses, this worker's pages with states) and ``rank<R>_embedding_<slot>.npy`` (the
    slot over the table: this worker's rows, zeros elsewhere)."""
    import numpy as np

    import zero_runtime
    from zero_runtime.checkpoint import CheckpointManager

    strategy = zero_runtime.ZeroInfinityStrategy(embedding_config("cpu"), num_cpu_replicas=1)
    rank = strategy.cluster.rank
    model = build_embedding(strategy)
    train(model, 0, args.first_step, embedding_data)
    (embedding,) = model.engine.row_paged.values()
    CheckpointManager(args.embedding_root, model, strategy).save(tag="E")
    for slot in ("momentum", "velocity"):
        np.save(
            os.path.join(args.out, f"rank{rank}_embedding_{slot}.npy"), embedding.state_rows(slot)
        )
    record = {
        "rank": rank,
        "pages": {str(r): embedding.state_pages(r) for r in embedding.table.local_replicas},
        "uninterrupted": train(model, args.first_step, args.steps, embedding_data),
    }
    model.close()
    strategy.close()
    with open(os.path.join(args.out, f"rank{rank}_embedding.json"), "w") as f:
        json.dump(record, f)


def _multiworker_main(args) -> int:
    import zero_runtime
    from zero_runtime.checkpoint import CheckpointManager

    if args.stage3_root:
        _stage3_phase(args)
    if args.embedding_root:
        _embedding_phase(args)
    strategy = zero_runtime.ZeroInfinityStrategy(
        config(args.stage, args.offload, args.nvme), num_cpu_replicas=1
    )
    rank = strategy.cluster.rank
    model = build(strategy)
    manager = CheckpointManager(args.ckpt, model, strategy)
    train(model, 0, args.first_step)
    manager.save(tag="A")
    with open(os.path.join(args.out, f"rank{rank}_A.json"), "w") as f:
        json.dump({"weights": [w.tolist() for w in model.get_weights()]}, f)
    train(model, args.first_step, 1)
    if rank == args.kill_rank:
        os.environ["ZERO_RUNTIME_CKPT_KILL_AFTER_FILES"] = "1"
    manager.save(tag="B")
    with open(os.path.join(args.out, f"rank{rank}_B.json"), "w") as f:
        json.dump({"weights": [w.tolist() for w in model.get_weights()]}, f)
    strategy.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["restore", "multiworker"])
    p.add_argument("out", help="restore: the result JSON; multiworker: a directory")
    p.add_argument("ckpt", nargs="?", default=None, help="multiworker: the checkpoint root")
    p.add_argument("--spec", action="append", default=[], help="restore: STAGE:OFFLOAD:CKPT")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--offload", default="cpu")
    p.add_argument("--nvme", default=None)
    p.add_argument("--replicas", default="1,4")
    p.add_argument("--first-step", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--kill-rank", type=int, default=-1, help="this rank dies saving B")
    p.add_argument("--stage3-root", default=None, help="multiworker: first a stage-3 phase")
    p.add_argument("--embedding-root", default=None, help="multiworker: a row-paged phase")
    args = p.parse_args()
    return _restore_main(args) if args.mode == "restore" else _multiworker_main(args)


if __name__ == "__main__":
    sys.exit(main())
