"""A tiny multi-worker training job for the cluster lifecycle tests (one process per rank).

    python tests/helpers/cluster_job.py [--steps N] [--linger S]

Creates ``ZeroInfinityStrategy`` (stage 2, ``collective_timeout_seconds=10``; the cluster
comes from ``TF_CONFIG``), prints ``rank R pid P training``, fits a small model for
``--steps`` steps, then rank 0 works ``--linger`` seconds more (as a chief saving a final
checkpoint would) before ``rank R done``. Exits 0 on success.
"""

# isort: skip_file  (the environment must be set before TensorFlow is imported)
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # keep TF's E/W lines: tests read them

TIMEOUT_S = 10.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--linger", type=float, default=0.0)
    args = p.parse_args()

    import keras
    import numpy as np
    import tensorflow as tf

    import zero_runtime

    print(f"pid {os.getpid()} creating the strategy", flush=True)
    strategy = zero_runtime.ZeroInfinityStrategy(
        {"stage": 2, "collective_timeout_seconds": TIMEOUT_S}, num_cpu_replicas=1
    )
    rank = strategy.cluster.rank
    print(f"rank {rank} pid {os.getpid()} training", flush=True)
    x = np.random.RandomState(0).randn(8 * args.steps, 4).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, :2])).batch(8)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss="mse")
    model.fit(ds, epochs=1, verbose=0)
    strategy.close()
    if rank == 0:
        time.sleep(args.linger)
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
