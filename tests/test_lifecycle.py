"""Repeated use does not leak: strategies created and closed many times in one process.

TensorFlow and Keras themselves keep a little per model built (traced functions, name
registries), so host memory is compared against the same loop with plain
``MirroredStrategy``: the runtime may add no growth of its own. The NVMe directory must
be left as it was found, and no runtime thread may outlive its strategy.
"""

from __future__ import annotations

import gc
import os
import threading

import keras
import numpy as np
import psutil
from helpers.mirrored import Mirrored

import zero_runtime

CYCLES = 6
MIB = 1 << 20


def _train_once(strategy) -> None:
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((32,)), keras.layers.Dense(256), keras.layers.Dense(8)]
        )
        model.compile(optimizer="adam", loss="mse")
    x = np.ones((64, 32), "float32")
    model.fit(x, x[:, :8], batch_size=16, epochs=1, verbose=0)


def _growth_per_cycle(make_strategy) -> float:
    """Bytes of RSS growth per create-train-close cycle (after one warm-up cycle)."""
    rss = []
    for i in range(CYCLES + 1):
        strategy = make_strategy(i)
        _train_once(strategy)
        if isinstance(strategy, zero_runtime.ZeroInfinityStrategy):
            strategy.close()
        del strategy
        gc.collect()
        rss.append(psutil.Process().memory_info().rss)
    return (rss[-1] - rss[0]) / CYCLES


def test_create_train_close_many_times_leaks_nothing(tmp_path, cpu_devices):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    threads_before = {t.ident for t in threading.enumerate()}

    def zero(i: int):
        config = zero_runtime.ZeroConfig(
            stage=2, offload_optimizer="nvme" if i % 2 else "cpu", nvme_path=str(nvme)
        )
        return zero_runtime.ZeroInfinityStrategy(config, logdir=str(tmp_path / f"run{i}"))

    ours = _growth_per_cycle(zero)
    assert os.listdir(nvme) == []  # every pool removed its files on close
    # TensorFlow's own executor threads show up as threading._DummyThread once they have run
    # a host update (tf.numpy_function); they belong to TensorFlow's pools, not to us.
    left = [
        t.name
        for t in threading.enumerate()
        if t.ident not in threads_before and not isinstance(t, threading._DummyThread)
    ]
    assert left == []  # no writer, emitter or I/O thread outlives its strategy
    reference = _growth_per_cycle(lambda i: Mirrored(cpu_devices))
    # Our cycles may not grow the process more than plain data parallelism does (+1 MiB slack
    # for allocator noise).
    assert ours <= reference + 1 * MIB, (ours / MIB, reference / MIB)
