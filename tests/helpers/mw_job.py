"""A small Keras fit under ZeroInfinityStrategy, run as a process (one per worker).

Multi-worker when ``TF_CONFIG`` names a cluster (``zero_runtime.launch`` sets it), else
single-process over ``--replicas`` local CPU replicas (the parity reference). Each process
writes ``<out>/rank<R>.json``: per-step losses (Keras's, averaged over all replicas), the
final weights, the replica counts and the process's rank.

    python tests/helpers/mw_job.py OUT --stage 2 [--replicas 2] [--steps 6] [--die-at K]

``--die-at K``: rank 1 kills itself (SIGKILL) at the start of step K (mid-job), or, with
``--stall``, stops taking part (sleeps) instead, to test failure handling. ``--die-at -2``
with ``--stall``: rank 1 sleeps before it creates the model's first variable (whose
initial value rank 0 broadcasts), recorded as step -2.
"""

# isort: skip_file  (the environment must be set before TensorFlow is imported)
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STEPS = 6
GLOBAL_BATCH = 8


def fit_record(
    strategy,
    steps: int,
    out: str,
    die_at: int = -1,
    stall: bool = False,
    uneven: bool = False,
    callbacks: list | None = None,
) -> dict:
    """Fit the small model for ``steps`` steps of GLOBAL_BATCH under ``strategy``.

    ``callbacks``: more Keras callbacks for ``fit`` (e.g. a control request mid-job).

    Returns the record written to ``rank<R>.json`` (see the module docstring).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    rank = getattr(getattr(strategy, "cluster", None), "rank", 0)
    rng = np.random.RandomState(3)
    x = rng.randn(steps * GLOBAL_BATCH, 5).astype("float32")
    y = (x @ rng.randn(5, 3)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    if uneven:  # each worker reads its own data; rank 1 has 2 batches fewer
        local = GLOBAL_BATCH // strategy.num_replicas_in_sync
        n = (steps - 2 * rank) * local
        ds = tf.data.Dataset.from_tensor_slices((x[:n], y[:n])).batch(local)
        opts = tf.data.Options()
        opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        ds = ds.with_options(opts)
    if rank == 1 and die_at == -2 and stall:  # before the first variable's broadcast
        with open(os.path.join(out, "left.json"), "w") as f:
            json.dump({"rank": rank, "step": die_at, "time": time.time()}, f)
        print("rank 1 leaves before its first variable", flush=True)
        time.sleep(600)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
        )
        model.compile(optimizer="adam", loss="mse")

    losses: list[float] = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if rank == 1 and batch == die_at:
                with open(os.path.join(out, "left.json"), "w") as f:
                    json.dump({"rank": rank, "step": batch, "time": time.time()}, f)
                print(f"rank 1 leaves at step {batch}", flush=True)
                if stall:
                    time.sleep(600)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch, logs=None):
            losses.append(float(logs["loss"]))

    model.fit(ds, epochs=1, shuffle=False, verbose=0, callbacks=[Record(), *(callbacks or [])])
    # Keras's logged loss is a running mean over the epoch: recover each step's loss.
    step_losses = [losses[0]] + [
        (i + 1) * losses[i] - i * losses[i - 1] for i in range(1, len(losses))
    ]
    record = {
        "rank": rank,
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "local_replicas": len(strategy.device_info.devices),
        "strategy": type(strategy).__name__,
        "optimizer": type(model.optimizer).__module__,
        "losses": step_losses,
        "weights": [w.tolist() for w in model.get_weights()],
        "steps_recorded": strategy.runtime.steps_recorded,
    }
    return record


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--offload", default="cpu")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--stall", action="store_true")
    p.add_argument("--uneven", action="store_true")
    p.add_argument("--logdir", default=None)
    args = p.parse_args()

    import zero_runtime

    config = {
        "stage": args.stage,
        "offload_optimizer": args.offload,
        "collective_timeout_seconds": args.timeout,
        "reduce_bucket_size": 200,  # several buckets
    }
    strategy = zero_runtime.ZeroInfinityStrategy(
        config, logdir=args.logdir, num_cpu_replicas=args.replicas
    )
    record = fit_record(strategy, args.steps, args.out, args.die_at, args.stall, args.uneven)
    strategy.close()
    with open(os.path.join(args.out, f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)
    print(f"rank {record['rank']} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
