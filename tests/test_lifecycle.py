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
import weakref

import keras
import numpy as np
import psutil
import pytest
from helpers.mirrored import Mirrored

import zero_runtime

CYCLES = 6
MIB = 1 << 20
_WATCHDOG_THREAD = "zero_runtime-collective-watchdog"  # one per process, reused


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
    nvme.mkdir(exist_ok=True)
    threads_before = {t.ident for t in threading.enumerate()}

    def zero(i: int):
        config = zero_runtime.ZeroConfig(
            stage=2, offload_optimizer="nvme" if i % 2 else "cpu", nvme_path=str(nvme)
        )
        return zero_runtime.ZeroInfinityStrategy(config, logdir=str(tmp_path / f"run{i}"))

    ours = _growth_per_cycle(zero)
    assert os.listdir(nvme) == []  # every pool removed its files on close
    # TensorFlow's own executor threads show up as threading._DummyThread once they have run
    # a host update (tf.numpy_function); they belong to TensorFlow's pools, not to us. The
    # collective watchdog is one thread per process, started at the first step and reused
    # by every strategy after (zero_runtime/comm/watchdog.py).
    left = [
        t.name
        for t in threading.enumerate()
        if t.ident not in threads_before
        and not isinstance(t, threading._DummyThread)
        and t.name != _WATCHDOG_THREAD
    ]
    assert left == []  # no writer, emitter or I/O thread outlives its strategy
    reference = _growth_per_cycle(lambda i: Mirrored(cpu_devices))
    # Our cycles may not grow the process more than plain data parallelism does (+1 MiB slack
    # for allocator noise).
    assert ours <= reference + 1 * MIB, (ours / MIB, reference / MIB)


# -- create / fit / close with NVMe tiers -------------------------------------------------
# TensorFlow's collective executor threads ("collective_ops") come and go on TensorFlow's
# schedule (their growth per collective has its own test in tests/test_fault_threads.py);
# every other OS thread of the process is counted.
_TF_TIMEOUT_THREADS = "collective_ops"


def _census(nvme) -> dict:
    """What the process holds now: OS threads (by name), open descriptors, NVMe files."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended while we listed
            continue
    return {
        "threads": sum(1 for n in names if n != _TF_TIMEOUT_THREADS),
        "python_threads": sorted(
            t.name for t in threading.enumerate() if not isinstance(t, threading._DummyThread)
        ),
        "fds": len(os.listdir("/proc/self/fd")),
        "nvme_files": sorted(os.listdir(nvme)),
    }


def _runtime_threads() -> list[str]:
    """Names of the runtime's own threads alive now (I/O, prefetch, update, write-behind)."""
    prefixes = ("zr-", "zero3-update")
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(prefixes))


def _nvme_cycle(stage: int, nvme, logdir, close_model_first: bool = False):
    """Create a strategy with NVMe tiers, fit a tiny model, close (the stage-3 model
    first with ``close_model_first``); return weak references to the cycle's pools, its
    strategy and model, and the strategy, model and input."""
    config = zero_runtime.ZeroConfig(
        stage=stage,
        offload_optimizer="nvme",
        offload_param="nvme" if stage == 3 else "none",
        nvme_path=str(nvme),
        page_size_bytes=1 << 16,
        collective_timeout_seconds=30,
    )
    strategy = zero_runtime.ZeroInfinityStrategy(config, logdir=str(logdir))
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(64), keras.layers.Dense(16)]
        )
        if stage == 3:
            model = strategy.shard_model(model)
        model.compile(optimizer="adam", loss="mse")
    x = np.random.RandomState(0).rand(32, 16).astype("float32")
    model.fit(x, x, batch_size=8, epochs=1, verbose=0)
    pools = [model.optimizer.zero_state.store.pool]
    if stage == 3:
        pools.append(model.engine.pool)
        assert model.update_in_backward  # the update threads ran
    assert all(p.nvme_file and os.path.exists(p.nvme_file) for p in pools)
    if close_model_first:  # ShardedModel.close(): its update threads and its pool
        model.close()
        assert [t for t in _runtime_threads() if "update" in t] == []
        assert pools[1].closed and not os.path.exists(pools[1].nvme_file)
    strategy.close()
    assert _runtime_threads() == []
    refs = [weakref.ref(p) for p in pools] + [weakref.ref(strategy), weakref.ref(model)]
    return refs, strategy, model, x


@pytest.mark.parametrize(("stage", "cycles"), [(3, 5), (2, 2), (1, 2)])
def test_create_fit_close_releases_threads_descriptors_files_and_pools(stage, cycles, tmp_path):
    """Every cycle returns to the first cycle's threads and descriptors, leaves no NVMe
    file, and its pools, strategy and model are garbage once dropped."""
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    figures = []
    for i in range(cycles):
        close_model_first = stage == 3 and i % 2 == 1
        refs, strategy, model, x = _nvme_cycle(stage, nvme, tmp_path / f"run{i}", close_model_first)
        if i == cycles - 1:
            strategy.close()  # a second close is a no-op
            with pytest.raises(zero_runtime.StrategyClosedError, match="closed"):
                model.fit(x, x, batch_size=8, epochs=1, verbose=0)
        del strategy, model
        gc.collect()
        figures.append(_census(nvme))
        alive = [r() for r in refs if r() is not None]
        assert alive == [], f"cycle {i}: still alive after close: {alive}"
        assert figures[-1]["nvme_files"] == [], f"cycle {i}: {figures[-1]}"
    print(f"stage {stage}: per-cycle figures {figures}")
    first = figures[0]
    for i, now in enumerate(figures[1:], start=1):
        assert now["python_threads"] == first["python_threads"], (i, now, first)
        assert now["threads"] == first["threads"], (i, figures)
        assert now["fds"] == first["fds"], (i, figures)
