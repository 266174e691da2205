"""One stage-3 training step's device (allocator) peak of a deep GPT, with or without
activation checkpointing, in a fresh process, for tests/test_stage3_checkpointing.py::

    python tests/helpers/ckpt_peak_job.py OUT.json CHECKPOINTING

``CHECKPOINTING`` 1 or 0. The model: ``demo.model.build_gpt`` with 16 blocks of width 128
(vocab 64, 32 tokens, 3.2M parameters), parameters and Adam states on the host (the
update during backward: no gradient shard waits on the device), batch 8. Trains one step
(tracing), resets the BFC allocator's peak, trains one more and writes ``{"peak": the
step's bytes above the in-use bytes before it, "loss": the second step's loss, "blocks":
the checkpointed blocks}``. The runtime's in-step peak reset is disabled
(bench/bench_max_model.py explains why).
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

CFG = GPTConfig(vocab_size=64, seq_len=32, d_model=128, n_heads=2, n_layers=16, d_ff=512)
BATCH = 8


def main(out_path: str, checkpointing: bool) -> None:
    """Measure and write the record (see the module docstring)."""
    local_devices(2)
    TelemetryCollector.reset_peak_each_step = False  # peaks over whole steps
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 3,
            "offload_param": "cpu",
            "offload_optimizer": "cpu",
            "page_size_bytes": 65536,
            "activation_checkpointing": checkpointing,
        }
    )
    with strategy.scope():
        model = build_gpt(CFG, seed=0)
        model.compile(
            optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    x = np.random.RandomState(0).randint(0, CFG.vocab_size, (2 * BATCH, CFG.seq_len + 1))
    x = x.astype("int32")
    model.fit(x[:BATCH, :-1], x[:BATCH, 1:], batch_size=BATCH, verbose=0)
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    hist = model.fit(x[BATCH:, :-1], x[BATCH:, 1:], batch_size=BATCH, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - start
    engine = strategy.runtime.accounting.stage3_engines[0]
    record = {
        "peak": int(peak),
        "loss": float(hist.history["loss"][-1]),
        "blocks": len(engine.units.blocks),
    }
    strategy.close()
    with open(out_path, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], bool(int(sys.argv[2])))
