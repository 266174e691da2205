"""Tiny training jobs for the checkpoint tests (in-process helpers and a subprocess CLI).

In-process: :func:`build` makes a compiled model under a ZeroInfinityStrategy (a
``ShardedModel`` at stage 3), :func:`train` fits it one global batch at a time and
returns each step's loss (``train_on_batch``).

As a process (a fresh TensorFlow that configures its own logical CPUs)::

    python tests/helpers/checkpoint_job.py restore OUT.json --spec 2:nvme:CKPT [--spec ...] \
        --replicas 1,4 --first-step 3 --steps 3 [--nvme DIR]

restores each ``CKPT`` on each replica count in turn, trains ``--steps`` steps and writes
``{"STAGE:OFFLOAD:REPLICAS": {"losses": [...], ...}}``.
With ``multiworker`` instead of ``restore`` (under ``zero_runtime.launch``), trains
``--first-step`` steps, saves (``step A``), writes the weights, trains one more step and
saves again (``B``; rank ``--kill-rank`` SIGKILLs itself after its first shard file).
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


def data():
    """Deterministic regression data: ``TOTAL_STEPS`` global batches of 8 x 6 -> 4."""
    import numpy as np

    rng = np.random.RandomState(11)
    x = rng.randn(TOTAL_STEPS * GLOBAL_BATCH, FEATURES).astype("float32")
    y = np.tanh(x @ rng.randn(FEATURES, CLASSES)).astype("float32")
    return x, y


def build(strategy, seed: int = 0):
    """The compiled tiny model under ``strategy`` (stage 3: the ShardedModel)."""
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
        model.compile(optimizer=keras.optimizers.get("adam"), loss="mse")
    return model


def train(model, first: int, steps: int) -> list[float]:
    """Train on global batches ``first .. first + steps - 1``; each step's loss
    (``train_on_batch`` resets the metrics, so its loss is that batch's)."""
    x, y = data()
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


def _multiworker_main(args) -> int:
    import zero_runtime
    from zero_runtime.checkpoint import CheckpointManager

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
    args = p.parse_args()
    return _restore_main(args) if args.mode == "restore" else _multiworker_main(args)


if __name__ == "__main__":
    sys.exit(main())
