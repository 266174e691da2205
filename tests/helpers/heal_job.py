"""A training job that heals itself, for tests/test_heal_multiworker.py and
bench/bench_restart.py (one process per rank, under ``zero-runtime launch``).

    python tests/helpers/heal_job.py OUT NVME [--stage 3] [--epochs 3] [--per-epoch 6]
        [--save-every 2] [--step-seconds 0.1] [--elastic]

The backup directory is the launcher's ``--checkpoint-dir`` (``ZERO_RUNTIME_CHECKPOINT_DIR``).
Stage 3 with parameters and optimizer states on NVMe (``NVME``; stage 2: states on NVMe),
the tiny model of :mod:`checkpoint_job`, ``fit`` on ``--per-epoch`` global batches of 8 for
``--epochs`` epochs with ``ZeroBackupAndRestore(save_freq=--save-every)``. With
``--elastic`` the global batch of 8 is kept at any world size the launcher runs
(``zero_runtime.elastic.batch_plan``: ``fit``'s batch 8 x w / N and N / w accumulation
steps). Prints ``rank R pid P attempt A start world W`` when the strategy exists, ``rank R
resumed at step S`` (optimizer steps) after a restore, ``rank R pid P attempt A step S
loss L accum N`` after every batch (``S`` batches of this run, ``L`` that batch's mean
squared error over every worker, ``N`` the accumulation; then sleeps ``--step-seconds``,
so a test can aim a signal at a step), and at the end ``rank R done``; rank 0 writes the
final weights to ``OUT/final.npz``.
"""

# isort: skip_file  (the environment must be set before TensorFlow is imported)
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _batch_loss_metric():
    """A Keras metric whose value is the last batch's mean squared error over every
    worker's examples: a ``Mean`` (summed across replicas when read, as fit's loss
    tracker) emptied before each batch."""
    import keras

    class BatchLoss(keras.metrics.Mean):
        def update_state(self, y_true, y_pred, sample_weight=None):
            self.reset_state()
            return super().update_state(keras.ops.square(y_true - y_pred))

    return BatchLoss


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("nvme")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--per-epoch", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--step-seconds", type=float, default=0.1)
    p.add_argument("--elastic", action="store_true", help="keep the global batch (batch_plan)")
    args = p.parse_args()
    attempt = os.environ.get("ZERO_RUNTIME_RESTART_COUNT", "0")
    backup_dir = os.environ["ZERO_RUNTIME_CHECKPOINT_DIR"]

    import keras
    import numpy as np

    import zero_runtime
    from helpers import checkpoint_job as job
    from zero_runtime import elastic
    from zero_runtime.checkpoint import ZeroBackupAndRestore

    plan = elastic.batch_plan(job.GLOBAL_BATCH) if args.elastic else None
    extra = {"collective_timeout_seconds": 10.0}
    if args.stage == 3:
        extra["offload_param"] = "nvme"
    if plan is not None:
        extra["gradient_accumulation_steps"] = plan.gradient_accumulation_steps
    accum = extra.get("gradient_accumulation_steps", 1)
    cfg = job.config(args.stage, "nvme", args.nvme, **extra)
    strategy = zero_runtime.ZeroInfinityStrategy(cfg, num_cpu_replicas=1)
    rank = strategy.cluster.rank if hasattr(strategy, "cluster") else 0
    world = strategy.cluster.num_workers if hasattr(strategy, "cluster") else 1
    pid = os.getpid()
    print(f"rank {rank} pid {pid} attempt {attempt} start world {world}", flush=True)
    model = job.build(strategy, metrics=[_batch_loss_metric()(name="batch_loss")])
    backup = ZeroBackupAndRestore(backup_dir, save_freq=args.save_every)

    class Progress(keras.callbacks.Callback):
        """Before the backup in the list: a step's line is printed before the backup's
        preemption save can exit at that step."""

        steps = None  # batches of this run done (the restored count at the first batch)

        def on_train_batch_begin(self, batch, logs=None):
            if self.steps is None:
                self.steps = backup.steps  # backup.on_train_begin restored it
                if self.steps:
                    print(f"rank {rank} resumed at step {self.steps // accum}", flush=True)

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            print(
                f"rank {rank} pid {pid} attempt {attempt} step {self.steps} "
                f"loss {float(logs['batch_loss']):.9g} accum {accum}",
                flush=True,
            )
            time.sleep(args.step_seconds)

    x, y = job.data()
    n = args.per_epoch * job.GLOBAL_BATCH
    model.fit(
        np.tile(x, (2, 1))[:n],
        np.tile(y, (2, 1))[:n],
        batch_size=job.GLOBAL_BATCH if plan is None else plan.batch_size,
        epochs=args.epochs,
        shuffle=False,
        verbose=0,
        callbacks=[Progress(), backup],
    )
    weights = model.get_weights()  # every worker: a gather across workers at stage 3
    if rank == 0:
        np.savez(os.path.join(args.out, "final.npz"), *weights)
    job.close(strategy, model)
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
