"""Stage-3 telemetry comes from the stage-3 engine's paged pool (zero_runtime.stage3.telemetry).

A short stage-3 ``fit`` (2 CPU replicas, an MLP of four Dense units, parameter shards on
the host, a device budget of 32 pages) with a logdir; the event files are read back with
TensorBoard's EventAccumulator and compared with what the pool and the engine's device
plan (the gathered units, TensorFlow tensors outside the pool) reported at each step
boundary.
"""

from __future__ import annotations

import json
import math

import keras
import numpy as np
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

import zero_runtime
from tb_plugin import metadata

PAGE = 65536  # bytes per page
STEPS = 6
BATCH = 16  # global batch per step
DEVICE_PAGES = 32  # device budget (pages): above 2 units x 2 replicas (16.1 pages)


def _model() -> keras.Model:
    """Four Dense blocks: kernels (64,256) (256,256) (256,256) (256,10), float32."""
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _dataset(steps: int) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * BATCH, 64)).astype("float32")  # [N, 64]
    y = rng.integers(0, 10, size=(steps * BATCH,)).astype("int32")  # [N]
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def _read(run: str) -> EventAccumulator:
    acc = EventAccumulator(run, size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def _rows(acc: EventAccumulator, tag: str) -> dict[int, np.ndarray]:
    return {e.step: tensor_util.make_ndarray(e.tensor_proto) for e in acc.Tensors(tag)}


def test_stage3_tiers_pages_and_placement_come_from_the_pool(tmp_path):
    run = str(tmp_path / "run")
    config = {
        "stage": 3,
        "offload_param": "cpu",
        "offload_optimizer": "cpu",
        "page_size_bytes": PAGE,
        "device_budget_bytes": DEVICE_PAGES * PAGE,
        "collective_timeout_seconds": 30,
    }
    strategy = zero_runtime.ZeroInfinityStrategy(config, logdir=run)
    with strategy.scope():
        model = _model()
        sharded = strategy.shard_model(model)
        sharded.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    engine = sharded.engine
    reported = []  # the pool's record of each step, as the runtime saw it

    class PoolRecord(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            reported.append(engine.last_step)

    sharded.fit(_dataset(STEPS), epochs=1, verbose=0, shuffle=False, callbacks=[PoolRecord()])
    strategy.runtime.flush()
    num_params = sum(math.prod(v.shape) for v in engine.variables)
    n = engine.num_shards
    # The update runs in backward (host Adam): one unit's gradient shard at a time.
    assert sharded.update_in_backward is True
    shard_elements = engine.max_block_shard_elements
    assert shard_elements < sum(v.shard_elements for v in engine.variables)
    plan = engine.device_plan
    # UNITS_LIVE x the largest unit (Dense 256 x 256 + bias, 2 shards) x 2 replicas.
    assert plan.gathered == 2 * 4 * 2 * (128 * 256 + 128) * 2 and plan.total == plan.gathered
    sharded.close()
    strategy.close()

    acc = _read(run)
    tiers = _rows(acc, metadata.TAG_TIERS)
    pages = _rows(acc, metadata.TAG_PAGES)
    assert sorted(tiers) == list(range(STEPS)) == [r.step for r in reported]
    col = {c: i for i, c in enumerate(metadata.TIER_COLUMNS)}
    row = {t: i for i, t in enumerate(metadata.TIERS)}
    pcol = {c: i for i, c in enumerate(metadata.PAGE_COLUMNS)}
    grad = 4.0 * shard_elements * n  # the largest unit's gradient shard per replica
    replicated = 4.0 * num_params * n  # what the runtime counted before (wrong at stage 3)
    moved = []
    for rec in reported:
        t = tiers[rec.step]
        dev, host = t[row["device"]], t[row["host"]]
        usage = rec.usage
        # Device: the pool's pages at the boundary; the step's peak adds the gathered
        # units (the device plan's bound) and the gradient shard; the capacity is the
        # budget: the pool's share and what it keeps for the gathered units.
        assert dev[col["param_bytes"]] == usage["device"].bytes_by_kind.get("param", 0)
        assert dev[col["param_bytes"]] != replicated
        assert dev[col["grad_bytes"]] == grad
        assert rec.gathered_bytes == plan.gathered
        pool_capacity = (DEVICE_PAGES * PAGE - plan.gathered) // PAGE * PAGE
        assert usage["device"].capacity_bytes == pool_capacity
        assert dev[col["capacity_bytes"]] == DEVICE_PAGES * PAGE
        assert dev[col["peak_bytes"]] == usage["device"].peak_bytes + plan.gathered + grad
        assert usage["device"].peak_bytes + plan.gathered <= DEVICE_PAGES * PAGE
        assert dev[col["used_bytes"]] == usage["device"].used_bytes + grad
        # Host: the shards (one page at least per variable and replica) are host pages.
        assert host[col["param_bytes"]] == usage["host"].bytes_by_kind["param"]
        assert host[col["param_bytes"]] >= 4 * shard_elements * n
        assert host[col["optimizer_bytes"]] > 0  # Adam's m, v on the host
        p = pages[rec.step]
        assert p[pcol["d2h_pages"]] == rec.counters.d2h_pages
        assert p[pcol["h2d_pages"]] == rec.counters.h2d_pages
        moved.append(p[pcol["d2h_pages"]] + p[pcol["h2d_pages"]])
    # Host shards are read by the units' host calls: no page moves to the device.
    print(f"pages moved per step (d2h + h2d): {moved}; device peaks {engine.device_peaks}")
    assert moved == [0] * STEPS

    placements = [
        json.loads(tensor_util.make_ndarray(e.tensor_proto).item())
        for e in acc.Tensors(metadata.TAG_PLACEMENT)
    ]
    rows = placements[-1]["variables"]
    assert len(rows) == 8  # 4 kernels + 4 biases, each once (no stage-1/2 rows)
    for r in rows:
        assert r["partitioning"].startswith(f"sharded 1/{n} along dim 0 (ZeRO-3)")
        assert r["param_tier"] == "host" and r["grad_tier"] == "device -> host (in backward)"
        assert r["optimizer_tier"] == "host"
        assert r["bytes"] == 4 * math.prod(r["shape"])
        assert r["shard_bytes_per_replica"] == 4 * math.ceil(r["shape"][0] / n) * math.prod(
            r["shape"][1:]
        )
    assert not any("persistent" in r["partitioning"] for r in rows)  # gathered per use
