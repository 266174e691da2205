"""A custom training loop that heals itself (tests/test_heal_loop.py), one process with 2
CPU replicas, under ``zero-runtime launch --nproc 1``.

    python tests/helpers/heal_loop_job.py OUT [--save-every 3] [--step-seconds 0.2]
        [--slow-attempt A --slow-seconds S]

A ``tf.GradientTape`` loop (stage 2, host optimizer states, the tiny model of
:mod:`checkpoint_job`) over its :data:`checkpoint_job.TOTAL_STEPS` global batches, resumed
and checkpointed with ``CheckpointManager(ZERO_RUNTIME_CHECKPOINT_DIR, save_every=...)``:
``restore_or_initialize()`` before the loop, ``after_step(step)`` after each step. Prints
``pid P attempt A resumed at step S``, then ``pid P attempt A step S`` after each step
(then sleeps ``--step-seconds``; ``--slow-seconds`` in attempt ``--slow-attempt``), and
``done``; writes the final weights to ``OUT/final.npz``. :func:`train` is the loop, also
run in the test's own process for the uninterrupted reference.
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

from helpers import checkpoint_job as job  # noqa: E402


def train(strategy, model, start: int, after_step=None) -> None:
    """The tutorial's loop from global batch ``start`` to the last; ``after_step(n)``
    after each step (``n`` steps done)."""
    import tensorflow as tf

    x, y = job.data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(job.GLOBAL_BATCH)
    batches = iter(strategy.experimental_distribute_dataset(data.skip(start)))
    optimizer = model.optimizer

    def replica_step(inputs):
        bx, by = inputs
        with tf.GradientTape() as tape:
            err = tf.reduce_sum(tf.square(model(bx, training=True) - by)) / job.GLOBAL_BATCH
        grads = tape.gradient(err, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def step_fn(inputs):
        strategy.run(replica_step, args=(inputs,))

    for step in range(start, job.TOTAL_STEPS):
        step_fn(next(batches))
        if after_step is not None:
            after_step(step + 1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--step-seconds", type=float, default=0.2)
    p.add_argument("--slow-attempt", type=int, default=-1)
    p.add_argument("--slow-seconds", type=float, default=3.0)
    args = p.parse_args()
    attempt = int(os.environ.get("ZERO_RUNTIME_RESTART_COUNT", "0"))
    pause = args.slow_seconds if attempt == args.slow_attempt else args.step_seconds

    import numpy as np

    from zero_runtime.checkpoint import CheckpointManager

    strategy = job.strategy_for(2, "cpu")
    model = job.build(strategy)
    manager = CheckpointManager(
        os.environ["ZERO_RUNTIME_CHECKPOINT_DIR"], model, strategy, save_every=args.save_every
    )
    start = manager.restore_or_initialize()
    pid = os.getpid()
    print(f"pid {pid} attempt {attempt} resumed at step {start}", flush=True)

    def after_step(n: int) -> None:
        print(f"pid {pid} attempt {attempt} step {n}", flush=True)
        time.sleep(pause)
        manager.after_step(n)

    train(strategy, model, start, after_step)
    np.savez(os.path.join(args.out, "final.npz"), *model.get_weights())
    job.close(strategy, model)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
