"""One stage-3 step's device (allocator) peak with a wide ``Dense``, tiled or not, in a
fresh process, for tests/test_stage3_tiling.py (the device-peak test)::

    python tests/helpers/tile_peak_job.py OUT.json TILE_SIZE

``TILE_SIZE`` elements (0: untiled, ``tile_size`` None). The model (:func:`build`, a
DAG, so it runs by units): ``x (B, T, D_IN) -> wide Dense D_IN -> D_OUT -> head Dense
-> + skip(x)``; the wide kernel is 8 MiB. Trains one step (tracing), resets the BFC
allocator's peak, trains one more, then predicts, and writes ``{"peak": the training
step's bytes above the in-use bytes before it, "predict_peak": the same for predict,
"output_sum", "kernel_elements", "tile_elements": the widest tile's kernel elements (0
untiled), "tiles": count, "loss": the second step's loss}``. The runtime's in-step peak
reset is disabled (bench/bench_max_model.py explains why).
"""

# isort: skip_file  (the environment must be set before TensorFlow is imported)
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import zero_runtime  # noqa: E402
from zero_runtime.devices import local_devices  # noqa: E402
from zero_runtime.telemetry.collector import TelemetryCollector  # noqa: E402

D_IN, D_OUT, BATCH, T = 512, 4096, 4, 4  # wide kernel: 2M elements, 8 MiB


def build() -> keras.Model:
    """The measured model (seeded)."""
    keras.utils.set_random_seed(0)
    i = keras.Input((T, D_IN))
    h = keras.layers.Dense(D_OUT, activation="relu", name="wide")(i)  # (B, T, D_OUT)
    y = keras.layers.Dense(8, name="head")(h)
    return keras.Model(i, keras.layers.Add()([y, keras.layers.Dense(8, name="skip")(i)]))


def main(out_path: str, tile_size: int) -> None:
    """Measure and write the record (see the module docstring)."""
    local_devices(2)
    TelemetryCollector.reset_peak_each_step = False  # peaks over whole steps
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 3,
            "offload_param": "cpu",
            "offload_optimizer": "cpu",
            "page_size_bytes": 65536,
            "tile_size": tile_size or None,
        }
    )
    with strategy.scope():
        model = build()
        model.compile(optimizer=zero_runtime.optim.SGD(0.01), loss="mse")
    rng = np.random.RandomState(0)
    x = rng.standard_normal((4 * BATCH, T, D_IN)).astype("float32")
    y = rng.standard_normal((4 * BATCH, T, 8)).astype("float32")
    model.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=2 * BATCH, verbose=0)
    model.predict(x[:BATCH], batch_size=2 * BATCH, verbose=0)  # traced
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    hist = model.fit(x[2 * BATCH :], y[2 * BATCH :], batch_size=2 * BATCH, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - start
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    out = model.predict(x[2 * BATCH :], batch_size=2 * BATCH, verbose=0)
    predict_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - start
    engines = strategy.runtime.accounting.stage3_engines
    plans = [p for e in engines for p in e.tile_plans.values()]
    record = {
        "peak": int(peak),
        "predict_peak": int(predict_peak),
        "output_sum": float(np.sum(out, dtype=np.float64)),
        "kernel_elements": D_IN * D_OUT,
        "tile_elements": max((p.tile_elements for p in plans), default=0),
        "tiles": sum(len(p.bounds) for p in plans),
        "loss": float(hist.history["loss"][-1]),
    }
    strategy.close()
    with open(out_path, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
