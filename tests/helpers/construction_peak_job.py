"""Construction-peak measurement for tests/test_stage3_init.py, run in a fresh process.

The BFC allocator's statistics are process-wide: inside the test session, tensors
that earlier tests' background threads allocate during the measured window inflated
both peaks by ~350 KB in CI (1.16 MB instead of 0.79 MB for the partitioned build).
A fresh process measures only the construction::

    python tests/helpers/construction_peak_job.py OUT.json NVME_DIR

writes ``{"peak", "ref_peak", "largest", "total", "deferred", "deferred_paths",
"deferred_bytes", "initialized_paths", "all_sharded", "max_weight_diff",
"num_weights"}`` (bytes for the peaks and sizes; ``max_weight_diff`` is the largest
absolute difference between the zero_init build's weights and the replicated build's).
"""

# isort: skip_file  (the environment must be set before TensorFlow is imported)
from __future__ import annotations

import json
import math
import os
import sys

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import gc  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import zero_runtime  # noqa: E402
from demo.model import GPTConfig, build_gpt  # noqa: E402
from zero_runtime.devices import local_devices  # noqa: E402
from zero_runtime.sharded_variable import ShardedVariable  # noqa: E402
from zero_runtime.stage3 import construction  # noqa: E402

# 863k parameters (3.45 MB); the largest variable, an MLP kernel 128 x 512, is 256 KiB.
WIDE = GPTConfig(vocab_size=256, seq_len=32, d_model=128, n_heads=2, n_layers=4, d_ff=512)


def _config(nvme: str) -> dict:
    return {
        "stage": 3,
        "offload_param": "cpu",
        "offload_optimizer": "cpu",
        "nvme_path": nvme,
        "page_size_bytes": 65536,
        "collective_timeout_seconds": 20,
        "persistence_threshold": 100,
    }


def _peak_of(fn):
    """(result, bytes above the allocator's in-use bytes at the start that fn peaked at)."""
    gc.collect()
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    out = fn()
    return out, tf.config.experimental.get_memory_info("CPU:0")["peak"] - start


def main(out_path: str, nvme: str) -> None:
    """Measure both builds and write the JSON record to ``out_path``."""
    local_devices(2)
    strategy = zero_runtime.ZeroInfinityStrategy(_config(nvme))

    def partitioned():
        with strategy.zero_init() as zi:
            model = build_gpt(WIDE, seed=0)
        deferred = [construction.is_deferred(v) for v in model.trainable_weights]
        return model, zi, deferred, strategy.shard_model(model)

    (model, zi, deferred, sharded), peak = _peak_of(partitioned)
    sizes = [4 * math.prod(v.shape) for v in model.trainable_weights]
    weights = model.get_weights()
    all_sharded = all(isinstance(v, ShardedVariable) for v in model.trainable_weights)
    sharded.close()
    strategy.close()

    replicated_strategy = zero_runtime.ZeroInfinityStrategy(_config(nvme))

    def replicated():
        with replicated_strategy.scope():
            ref = build_gpt(WIDE, seed=0)
            return ref, replicated_strategy.shard_model(ref)

    (ref, ref_sharded), ref_peak = _peak_of(replicated)
    ref_weights = ref.get_weights()
    ref_sharded.close()
    replicated_strategy.close()
    diff = max(
        float(np.max(np.abs(w - r))) if w.shape == r.shape else float("inf")
        for w, r in zip(weights, ref_weights)
    )
    record = {
        "peak": int(peak),
        "ref_peak": int(ref_peak),
        "largest": max(sizes),
        "total": sum(sizes),
        "deferred": deferred,
        "deferred_paths": len(zi.deferred_paths),
        "deferred_bytes": zi.deferred_bytes,
        "initialized_paths": list(zi.initialized_paths),
        "all_sharded": all_sharded,
        "max_weight_diff": diff,
        "num_weights": [len(weights), len(ref_weights)],
    }
    with open(out_path, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
