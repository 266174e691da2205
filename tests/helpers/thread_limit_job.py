"""Fit a tiny model for many steps at stages 2 and 3 under a process limit; print the
thread counts as JSON (one process for both stages: TensorFlow is imported once).

    python tests/helpers/thread_limit_job.py --steps 500 --nproc 256

Each stage's model is built and fitted for ``WARM_STEPS`` first (tracing, thread pools);
then ``RLIMIT_NPROC`` is set to ``--nproc`` and, when running as root (for whom Linux does
not enforce ``RLIMIT_NPROC``), the process drops to user ``nobody``, which owns no other
process: every thread the process starts from then on counts against the limit, and one
that cannot start aborts TensorFlow (``std::system_error: Resource temporarily
unavailable``). Non-root: the limit is ``--nproc`` plus the threads the user already runs.
Then each stage fits ``--steps`` more steps, sampling the thread count every 50.

Last, one step where one replica stalls before a collective with a ``--stall-seconds``
deadline (:func:`stall_one_replica`).

Output (last line of stdout): ``{"dropped_to": uid, "nproc": limit, "stages": {"2":
{"warm": threads at the last warm-up step, "samples": [[step, threads], ...] (while
fitting, the last at step ``--steps``), "loss": [first, last]}, "3": {...}}, "stall":
{"error": type name or null, "message", "seconds"}}``.
"""

# isort: skip_file  (the environment must be set before TensorFlow is imported)
from __future__ import annotations

import argparse
import json
import os
import resource
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

WARM_STEPS = 20
NOBODY = 65534


def num_threads() -> int:
    """OS threads of this process (``Threads:`` in /proc/self/status)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def limit_processes(nproc: int) -> int:
    """Set RLIMIT_NPROC so that at most ``nproc`` more tasks can start; return the uid."""
    if os.getuid() == 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)  # nobody owns no other task: the limit counts only ours
        return NOBODY
    uid = os.getuid()
    running = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                running += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    resource.setrlimit(resource.RLIMIT_NPROC, (running + nproc, running + nproc))
    return uid


def sampler_class():
    """``Sampler(stage, every)``: a Keras callback keeping each step's loss and, every
    ``every`` steps, ``[step, threads]`` (also printed to stderr: how far a run got)."""
    import keras

    class Sampler(keras.callbacks.Callback):
        def __init__(self, stage: int, every: int) -> None:
            super().__init__()
            self.stage, self.every = stage, every
            self.samples: list[list[int]] = []
            self.losses: list[float] = []

        def on_train_batch_end(self, batch, logs=None):
            self.losses.append(float(logs["loss"]))
            if (batch + 1) % self.every == 0:
                self.samples.append([batch + 1, num_threads()])
                print(
                    f"stage {self.stage} step {batch + 1}: {num_threads()} threads",
                    file=sys.stderr,
                    flush=True,
                )

    return Sampler


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--nproc", type=int, default=256)
    p.add_argument("--stall-seconds", type=float, default=1.0)
    args = p.parse_args()

    import keras
    import numpy as np
    import tensorflow as tf

    import zero_runtime

    sampler_cls = sampler_class()
    rng = np.random.RandomState(0)
    x = rng.rand(64, 8).astype("float32")
    y = (x @ rng.rand(8, 2)).astype("float32")
    data = None  # made after the first strategy (it configures the 2 CPU devices)
    fits = {}
    for stage in (2, 3):
        config = {"stage": stage, "collective_timeout_seconds": 60.0}
        if stage == 3:
            config["offload_param"] = "cpu"
        strategy = zero_runtime.ZeroInfinityStrategy(config, num_cpu_replicas=2)
        if data is None:
            data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                [
                    keras.Input((8,)),
                    keras.layers.Dense(16, activation="relu"),
                    keras.layers.Dense(16, activation="relu"),
                    keras.layers.Dense(2),
                ]
            )
            if stage == 3:
                model = strategy.shard_model(model)
            model.compile(optimizer="adam", loss="mse")
        warm = sampler_cls(stage, every=WARM_STEPS)
        model.fit(data, steps_per_epoch=WARM_STEPS, epochs=1, verbose=0, callbacks=[warm])
        fits[stage] = (model, warm.samples[-1][1])  # while fitting (tf.data threads too)

    uid = limit_processes(args.nproc)
    record = {"dropped_to": uid, "nproc": args.nproc, "stages": {}}
    for stage, (model, warm) in fits.items():
        sampler = sampler_cls(stage, every=50)
        model.fit(data, steps_per_epoch=args.steps, epochs=1, verbose=0, callbacks=[sampler])
        record["stages"][str(stage)] = {
            "warm": warm,
            "samples": sampler.samples,
            "loss": [sampler.losses[0], sampler.losses[-1]],
        }
    record["stall"] = stall_one_replica(fits[2][0].distribute_strategy, args.stall_seconds)
    print(json.dumps(record), flush=True)
    return 0


def stall_one_replica(strategy, timeout: float) -> dict:
    """Last (it aborts the process's collectives): one step where replica 1's host callback
    sleeps ``4 * timeout`` before a raw all-to-all of a group with ``timeout`` seconds,
    while replica 0 waits in it. Returns the error's type and message and the seconds the
    step took (the callback still finishes its sleep before the step returns)."""
    import time

    import numpy as np
    import tensorflow as tf

    from zero_runtime import comm

    group = comm.CollectiveGroup.create(strategy.extended.worker_devices, timeout_seconds=timeout)

    def host(replica):
        if replica == 1:
            time.sleep(4 * timeout)
        return np.ones(4, np.float32)

    @tf.function
    def step():
        def replica_fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            flat = tf.numpy_function(host, [rid], tf.float32, stateful=True)
            return comm.reduce_scatter_sum_flat(tf.reshape(flat, [4]), group)

        return strategy.run(replica_fn)

    start = time.monotonic()
    try:
        step()
        error, message = None, ""
    except Exception as exc:  # noqa: BLE001 - the record says what it was
        error, message = type(exc).__name__, str(exc)
    return {"error": error, "message": message[:2000], "seconds": time.monotonic() - start}


if __name__ == "__main__":
    sys.exit(main())
