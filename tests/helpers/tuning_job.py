"""A small real training job for the live-tuning end-to-end test (tests/test_tuning_e2e.py).

A Keras MLP trained with ``fit`` under :class:`zero_runtime.ZeroInfinityStrategy` (ZeRO
stage 1, partitioned Adam on the host, 2 CPU replicas), writing the Memory Hierarchy
summaries to ``LOGDIR/RUN``. It runs until ``--stop-file`` exists (checked after every
step) or ``--max-steps`` steps, sleeping ``--step-sleep`` seconds per step so that a
person (or a browser test) has time to change its settings from the tab while it runs::

    python tests/helpers/tuning_job.py --logdir D --run job --stop-file D/stop

Prints ``tuning_job: step N`` every 10 steps and ``tuning_job: done: N steps`` at the end.
Exit status 0 on success.
"""
# isort: skip_file  (zero_runtime selects the CPU allocator before TensorFlow loads)

from __future__ import annotations

import argparse
import os
import sys
import time

import zero_runtime

VOCAB, SEQ = 40_000, 16  # the stage-3 job's table and ids per sample


def main(argv: list[str] | None = None) -> int:
    """Train until the stop file appears; returns the exit status."""
    p = argparse.ArgumentParser(prog="tuning_job")
    p.add_argument("--logdir", required=True, help="TensorBoard log directory")
    p.add_argument("--run", default="job", help="run name (a subdirectory of logdir)")
    p.add_argument("--stop-file", required=True, help="stop after the step that sees it")
    p.add_argument("--max-steps", type=int, default=5000, help="steps at most")
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds slept per step")
    p.add_argument(
        "--stage3",
        action="store_true",
        help="ZeRO stage 3: a row-paged 40 000 x 16 embedding table (40 row pages of "
        "64 KiB) and a Dense head, parameters on the device, a 4 MiB device budget that "
        "caches every row page; a lower budget pages rows in and out",
    )
    args = p.parse_args(argv)

    if args.stage3:
        config = zero_runtime.ZeroConfig(
            stage=3,
            offload_param="none",
            offload_optimizer="cpu",
            page_size_bytes=65536,
            embedding_row_paging_threshold=100_000,
            collective_timeout_seconds=30,
            # Every row page a step touches (about 40) stays cached on the device tier:
            # nothing moves; the tab's 1 MiB leaves room for about 11 (the budget the tab
            # tunes is the pool's row cache: zero_runtime/stage3/device_plan.py).
            device_budget_bytes=4 << 20,
        )
    else:
        config = zero_runtime.ZeroConfig(stage=1, offload_optimizer="cpu")
    strategy = zero_runtime.ZeroInfinityStrategy(
        config, logdir=os.path.join(args.logdir, args.run), num_cpu_replicas=2
    )
    import keras
    import numpy as np
    import tensorflow as tf

    features = 32
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, features)).astype("float32")  # [N, features]
    if args.stage3:  # token ids, uniform over the table: each step touches ~every page
        x = rng.integers(0, VOCAB, size=(256, SEQ)).astype("int32")  # [N, SEQ]
    y = rng.integers(0, 10, size=(256,)).astype("int32")  # [N]
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True).repeat()

    class StopWhenAsked(keras.callbacks.Callback):
        """Sleep per step; stop training once the stop file exists."""

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if batch % 10 == 0:
                print(f"tuning_job: step {batch}", flush=True)
            time.sleep(args.step_sleep)
            if os.path.exists(args.stop_file):
                self.model.stop_training = True

    with strategy.scope():
        if args.stage3:
            model = strategy.shard_model(
                keras.Sequential(
                    [
                        keras.Input((SEQ,), dtype="int32"),
                        keras.layers.Embedding(VOCAB, 16),
                        keras.layers.Flatten(),
                        keras.layers.Dense(10),
                    ]
                )
            )
        else:
            model = keras.Sequential(
                [
                    keras.Input((features,)),
                    keras.layers.Dense(64, activation="relu"),
                    keras.layers.Dense(10),
                ]
            )
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    history = model.fit(
        data, steps_per_epoch=args.max_steps, epochs=1, verbose=0, callbacks=[StopWhenAsked()]
    )
    if args.stage3:
        model.close()  # the stage-3 engine's paged pool
    strategy.close()
    print(
        f"tuning_job: done: {strategy.runtime.steps_recorded} steps recorded, "
        f"final loss {history.history['loss'][-1]:.3f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
