"""One stage-3 step's device (allocator) peak, in a fresh process, for
tests/test_stage3_backward_update.py::test_gradient_shards_are_freed_during_backward::

    python tests/helpers/step_peak_job.py OUT.json MODE

``MODE`` 'backward' (the default Adam: shards updated during backward) or 'end' (Adam
with ``clipvalue=1e9``, which changes no value but takes the end-of-step path). Trains
one step (tracing), resets the BFC allocator's peak, trains 2 more and writes
``{"peak": bytes above the in-use bytes before them, "params": elements,
"update_in_backward": bool, "losses": [...]}``. The runtime's in-step peak reset is
disabled (bench/bench_max_model.py explains why).
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
from demo.model import GPTConfig, build_gpt  # noqa: E402
from zero_runtime.devices import local_devices  # noqa: E402
from zero_runtime.telemetry.collector import TelemetryCollector  # noqa: E402

# 2.45M parameters in 12 blocks: the gradient shards held to the step's end (4 bytes per
# parameter over both replicas) outweigh one block's transient buffers.
DEEP = GPTConfig(vocab_size=256, seq_len=32, d_model=128, n_heads=2, n_layers=12, d_ff=512)


def main(out_path: str, mode: str) -> None:
    """Measure and write the record (see the module docstring)."""
    if mode not in ("backward", "end"):
        raise ValueError(f"mode must be 'backward' or 'end', got {mode!r}")
    local_devices(2)
    TelemetryCollector.reset_peak_each_step = False  # peaks over whole steps
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 3,
            "offload_param": "cpu",
            "offload_optimizer": "cpu",
            "page_size_bytes": 65536,
        }
    )
    with strategy.zero_init():
        model = build_gpt(DEEP, seed=0)
    with strategy.scope():
        sharded = strategy.shard_model(model)
        extra = {"clipvalue": 1e9} if mode == "end" else {}
        sharded.compile(
            optimizer=zero_runtime.optim.Adam(1e-3, **extra),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    tokens = np.random.RandomState(0).randint(0, 256, size=(12, 33)).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((tokens[:, :-1], tokens[:, 1:])).batch(4)
    sharded.fit(ds.take(1), verbose=0)
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    hist = sharded.fit(ds.skip(1), verbose=0)
    record = {
        "peak": int(tf.config.experimental.get_memory_info("CPU:0")["peak"] - start),
        "params": int(sum(np.prod(w.shape) for w in model.trainable_weights)),
        "update_in_backward": bool(sharded.update_in_backward),
        "losses": [float(v) for v in hist.history["loss"]],
    }
    sharded.close()
    strategy.close()
    with open(out_path, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
