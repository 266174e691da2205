"""What the step-time benches share: the environment, the devices, the model, its data, the
step timer and the results header. ``bench_step_time``, ``bench_stage3_units``,
``bench_stage3_nvme`` and ``bench_partial_offload`` import it; it imports no bench, so the
benches' imports form a tree.

Importing it sets ``TF_CPU_ALLOCATOR_USE_BFC=true`` and ``ZERO_RUNTIME_PROFILE_EVERY=0``
(unless already set) before TensorFlow is imported, puts this checkout first on
``sys.path`` (``_checkout``) and ``tests/`` after it (``helpers.reference_optimizers``),
and creates ``DEVICES``: 2 logical CPU devices (``zero_runtime.devices.local_devices``).
"""

from __future__ import annotations

# isort: skip_file  (the environment must be set before TensorFlow is imported)
import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# No sampled profiler traces: a trace a runtime starts at one of its step ends stays on
# until its next step ends, i.e. over the other configurations' interleaved steps (the
# sampled step itself, 1 in 50 by default, is outside the medians anyway).
os.environ.setdefault("ZERO_RUNTIME_PROFILE_EVERY", "0")

import argparse  # noqa: E402
import datetime  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import _checkout  # noqa: E402, F401  (this checkout's zero_runtime, not the editable install's)

from zero_runtime.devices import local_devices  # noqa: E402

DEVICES = local_devices(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

#: The bench model's vocabulary and sequence length (tokens per example).
VOCAB, SEQ = 2000, 16

INTERLEAVED_NOTE = (
    "configurations measured interleaved in one process; a load average above ~1 means "
    "other processes shared the 2 cores during the run"
)


def build_model(width: int = 768) -> keras.Model:
    """Embedding (2000 x 64) + 4 dense layers (3 of ``width``): about 2.1M float32
    parameters at the default width 768, 10.6M at 2048. Input ``(B, 16)`` int32 token
    ids, output ``(B, 10)`` logits. Seeds Keras's RNG with 0 first."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 64),  # (B, 16, 64)
            keras.layers.Flatten(),  # (B, 1024)
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


class StepTimer(keras.callbacks.Callback):
    """Per step: wall seconds (``times``) and this process's CPU seconds, all threads
    (``cpu_times``)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._t = self._c = 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self._c = time.process_time()
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._t)
        self.cpu_times.append(time.process_time() - self._c)


def make_data(steps: int, batch: int) -> tf.data.Dataset:
    """``steps`` batches of ``batch`` examples for :func:`build_model`: token ids
    ``(batch, 16)`` int32 uniform in [0, 2000) (seed 0) and labels ``(batch,)`` int32, the
    ids' sum mod 10."""
    rng = np.random.RandomState(0)
    x = rng.randint(0, VOCAB, size=(steps * batch, SEQ)).astype("int32")
    y = (x.sum(axis=1) % 10).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).prefetch(2)


def build_trained(
    strategy,
    make_optimizer: Callable[[], keras.optimizers.Optimizer],
    ds: tf.data.Dataset,
    width: int = 768,
    build: Callable[[], keras.Model] | None = None,
) -> keras.Model:
    """A model (``build()``, default ``build_model(width)``) built and compiled under
    ``strategy`` (sparse categorical cross-entropy on logits) and warmed up (traced) on
    3 steps of ``ds``."""
    with strategy.scope():
        model = build() if build is not None else build_model(width)
        model.compile(
            optimizer=make_optimizer(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(ds.take(3), verbose=0)  # trace + warm up
    return model


def time_steps(model: keras.Model, ds: tf.data.Dataset) -> list[float]:
    """Per-step seconds of one fit over ``ds``, without its first step (it starts the
    iterator)."""
    timer = StepTimer()
    model.fit(ds, verbose=0, callbacks=[timer])
    return timer.times[1:]


def interleaved_parser(description: str, rounds: int, steps: int, batch: int):
    """The argument parser of a bench that times configurations interleaved: ``--rounds``
    (default ``rounds``), ``--steps`` per configuration per round (``steps``) and the
    global ``--batch`` (``batch``); a bench adds its own arguments to it."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--steps", type=int, default=steps, help="steps per configuration per round")
    ap.add_argument("--batch", type=int, default=batch)
    return ap


def run_header(load_before: tuple[float, ...], note: str = INTERLEAVED_NOTE) -> dict:
    """The first keys of every results file: UTC ``date``, ``nproc``, the 1/5/15-minute
    load averages before the run (``load_before``, from ``os.getloadavg()``) and now,
    and ``note``."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "note": note,
    }
