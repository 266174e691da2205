"""One stage-3 training step's device (allocator) peak on the units path, in a fresh
process, for tests/test_stage3_device_peak.py::

    python tests/helpers/units_peak_job.py OUT.json KIND DEPTH OFFLOAD

``KIND`` ``chain`` (a ``Sequential`` of ``DEPTH`` ``Dense(WIDTH, relu)`` layers and a
``Dense(8)`` head) or ``residual`` (the same layers, functional, each hidden one as
``h + Dense(h)``: a DAG); ``OFFLOAD`` the tier of the parameter shards and optimizer
states (``cpu`` or ``none``). Global batch ``BATCH`` over 2 replicas, Adam. Trains two
steps (tracing, then the first update's slot variables), resets the BFC allocator's peak,
trains one more and writes ``{"peak": the step's bytes above the in-use bytes before it
(bytes, both replicas), "start": the in-use bytes before it, "unit_bytes": the float32
bytes of the largest unit's gathered parameters (kernel and bias, one replica),
"units": the units, "params": elements, "path": the stage-3 path, "loss": the step's
loss}``. The runtime's in-step peak reset is disabled (bench/bench_max_model.py explains
why).
"""

# isort: skip_file  (the environment must be set before TensorFlow is imported)
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["ZERO_RUNTIME_PROFILE_EVERY"] = "0"  # this job runs the profiler itself

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import zero_runtime  # noqa: E402
from zero_runtime.devices import local_devices  # noqa: E402
from zero_runtime.telemetry.alloc_trace import allocation_peaks  # noqa: E402
from zero_runtime.telemetry.collector import TelemetryCollector  # noqa: E402

WIDTH, BATCH, OUT = 512, 8, 8


def build(kind: str, depth: int) -> keras.Model:
    """The measured model (seeded): ``depth`` hidden ``Dense(WIDTH)`` layers, a chain or
    residual (see the module docstring); input ``(B, WIDTH)`` float32."""
    keras.utils.set_random_seed(0)
    if kind == "chain":
        layers = [keras.layers.Dense(WIDTH, activation="relu") for _ in range(depth)]
        return keras.Sequential([keras.Input((WIDTH,)), *layers, keras.layers.Dense(OUT)])
    x = h = keras.Input((WIDTH,))
    for _ in range(depth):
        h = h + keras.layers.Dense(WIDTH, activation="relu")(h)
    return keras.Model(x, keras.layers.Dense(OUT)(h))


def main(out_path: str, kind: str, depth: int, offload: str) -> None:
    """Measure and write the record (see the module docstring)."""
    local_devices(2)
    TelemetryCollector.reset_peak_each_step = False  # peaks over whole steps
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 3,
            "offload_param": offload,
            "offload_optimizer": offload,
            "page_size_bytes": 65536,
        }
    )
    with strategy.scope():
        model = build(kind, depth)
        model.compile(optimizer="adam", loss="mse")
    rng = np.random.RandomState(0)
    x = rng.rand(3 * BATCH, WIDTH).astype("float32")
    y = rng.rand(3 * BATCH, OUT).astype("float32")
    model.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, verbose=0, shuffle=False)
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    trace_dir = tempfile.mkdtemp(prefix="units_peak_trace_")
    tf.profiler.experimental.start(trace_dir)
    try:
        hist = model.fit(x[2 * BATCH :], y[2 * BATCH :], batch_size=BATCH, verbose=0)
    finally:
        tf.profiler.experimental.stop()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - start
    traced = allocation_peaks(trace_dir)
    shutil.rmtree(trace_dir, ignore_errors=True)
    cpu = max(traced.values(), key=lambda p: p.requested_peak_bytes)
    engine = strategy.runtime.accounting.stage3_engines[0]
    record = {
        "peak": int(peak),
        "requested_peak": cpu.requested_peak_bytes,
        "traced_allocated_peak": cpu.allocated_peak_bytes,
        "live_at_peak": [dataclasses.asdict(t) for t in cpu.live_at_peak[:8]],
        "start": int(start),
        "unit_bytes": 4 * (WIDTH * WIDTH + WIDTH),
        "units": len(engine.units.runner.units),
        "params": int(model.count_params()),
        "loss": float(hist.history["loss"][-1]),
    }
    strategy.close()
    with open(out_path, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
