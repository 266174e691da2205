"""Live tuning has a real effect at stage 3.

- ``PagedBufferPool.set_device_budget``: shrinking the device tier moves the excess pages
  down (least recently used first, counted as d2h moves and evictions), refuses when
  pinned pages cannot move, and growing makes room again.
- A running stage-3 job (2 CPU replicas, parameter shards on the host, a row-paged
  embedding table whose touched row pages the device tier caches):
  ``device_budget_bytes`` lowered by a control request at one step and raised at a later
  one. The event files show the requests applied at the expected steps, the device
  capacity following them, and the page moves per step (h2d + d2h) rising while the
  budget is low (the row cache no longer holds the touched pages) and falling back after.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

import zero_runtime
from tb_plugin import metadata
from zero_runtime import control
from zero_runtime.memory import PagedBufferPool, PoolOutOfMemoryError

PAGE = 65536  # bytes per page


def test_pool_set_device_budget_moves_lru_pages_down_and_refuses_pinned(tmp_path):
    with PagedBufferPool(
        host_budget_bytes=16 * PAGE, page_size_bytes=PAGE, device_budget_bytes=8 * PAGE
    ) as pool:
        data = {}
        for i in range(6):  # one page each, allocated (and last used) in order t0..t5
            tid = f"t{i}"
            pool.allocate(tid, (PAGE // 4,), np.float32, "param", "device")
            data[tid] = np.full(PAGE // 4, i, np.float32)
            pool.write(tid, data[tid])
        pool.step_boundary(0)
        assert pool.set_device_budget(3 * PAGE) == 3
        usage = pool.usage()
        assert usage["device"].capacity_bytes == 3 * PAGE
        assert usage["device"].used_bytes == 3 * PAGE and usage["host"].used_bytes == 3 * PAGE
        tiers = {tid: pool.describe(tid).pages[0].tier for tid in data}
        assert tiers == {
            "t0": "host",
            "t1": "host",
            "t2": "host",
            "t3": "device",
            "t4": "device",
            "t5": "device",
        }
        counters = pool.step_boundary(1)
        assert (counters.d2h_pages, counters.d2h_bytes, counters.evictions) == (3, 3 * PAGE, 3)
        for tid, expected in data.items():  # contents survive the move
            np.testing.assert_array_equal(pool.read(tid), expected)
        # Pinned pages cannot move: shrinking below them is refused, nothing changes.
        for tid in ("t3", "t4", "t5"):
            pool.pin(tid)
        with pytest.raises(PoolOutOfMemoryError, match="cannot shrink the device tier"):
            pool.set_device_budget(2 * PAGE)
        assert pool.usage()["device"].capacity_bytes == 3 * PAGE
        with pytest.raises(ValueError):
            pool.set_device_budget(PAGE - 1)
        # Growing: a tensor that did not fit now fits beside the pinned ones.
        with pytest.raises(PoolOutOfMemoryError):
            pool.allocate("big", (PAGE,), np.float32, "param", "device")  # 4 pages
        assert pool.set_device_budget(7 * PAGE) == 0
        pool.allocate("big", (PAGE,), np.float32, "param", "device")
        assert pool.usage()["device"].used_bytes == 7 * PAGE
        assert "7 pages" not in pool.device_tier.description
        assert str(7 * PAGE) in pool.device_tier.description


STEPS = 14
BATCH = 16
LOWER_AT_BATCH, RAISE_AT_BATCH = 3, 8  # requests written after these steps end ...
LOW_FROM, HIGH_FROM = 5, 10  # ... are polled at the next boundary, in effect from these
LOW, HIGH = 16 * PAGE, 64 * PAGE  # a step touches about 20 row pages (10 per replica)
VOCAB, SEQ = 20_000, 8  # table 20 000 x 16: 10 row pages of 1024 rows per replica


def _model() -> keras.Model:
    """Embedding(20 000, 16) (row-paged) -> Flatten -> Dense(10), float32."""
    keras.utils.set_random_seed(2)
    return keras.Sequential(
        [
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 16),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )


def test_lowering_device_budget_moves_more_pages_and_raising_it_back_fewer(tmp_path):
    run = str(tmp_path / "run")
    config = {
        "stage": 3,
        "offload_param": "cpu",
        "offload_optimizer": "cpu",
        "page_size_bytes": PAGE,
        "embedding_row_paging_threshold": 100_000,
        "collective_timeout_seconds": 30,
        "device_budget_bytes": HIGH,  # holds every touched row page: nothing moves
    }
    strategy = zero_runtime.ZeroInfinityStrategy(config, logdir=run)
    with strategy.scope():
        sharded = strategy.shard_model(_model())
        sharded.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    engine = sharded.engine
    assert len(engine.row_paged) == 1 and engine.device_plan.total < LOW

    class RequestAtBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == LOWER_AT_BATCH:
                control.write_request(run, {"device_budget_bytes": LOW})
            elif batch == RAISE_AT_BATCH:
                control.write_request(run, {"device_budget_bytes": HIGH})

    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(STEPS * BATCH, SEQ)).astype("int32")  # [N, SEQ]
    y = rng.integers(0, 10, size=(STEPS * BATCH,)).astype("int32")  # [N]
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    sharded.fit(ds, epochs=1, verbose=0, shuffle=False, callbacks=[RequestAtBatch()])
    final_capacity = engine.pool.usage()["device"].capacity_bytes
    outside = engine.device_plan.outside_pool
    sharded.close()
    strategy.close()
    assert final_capacity == (HIGH - outside) // PAGE * PAGE

    acc = EventAccumulator(run, size_guidance={"tensors": 0})
    acc.Reload()
    events = [
        (e.step, json.loads(tensor_util.make_ndarray(e.tensor_proto).item()))
        for e in acc.Tensors(metadata.TAG_CONFIG_EVENT)
    ]
    assert [(s, ev["status"], ev["version"]) for s, ev in events] == [
        (LOW_FROM, "applied", 1),
        (HIGH_FROM, "applied", 2),
    ]
    assert events[0][1]["changes"] == {"device_budget_bytes": {"old": HIGH, "new": LOW}}
    assert events[1][1]["changes"] == {"device_budget_bytes": {"old": LOW, "new": HIGH}}

    pcol = {c: i for i, c in enumerate(metadata.PAGE_COLUMNS)}
    tcol = {c: i for i, c in enumerate(metadata.TIER_COLUMNS)}
    pages = {
        e.step: tensor_util.make_ndarray(e.tensor_proto) for e in acc.Tensors(metadata.TAG_PAGES)
    }
    tiers = {
        e.step: tensor_util.make_ndarray(e.tensor_proto)[0] for e in acc.Tensors(metadata.TAG_TIERS)
    }
    assert sorted(pages) == list(range(STEPS))
    moves = [float(pages[s][pcol["h2d_pages"]] + pages[s][pcol["d2h_pages"]]) for s in range(STEPS)]
    capacity = [float(tiers[s][tcol["capacity_bytes"]]) for s in range(STEPS)]
    peak = [
        float(tiers[s][tcol["peak_bytes"]] - tiers[s][tcol["grad_bytes"]]) for s in range(STEPS)
    ]
    print(f"h2d + d2h pages per step: {moves}\ndevice capacity: {capacity}\npool peaks: {peak}")
    before, low, after = moves[:LOW_FROM], moves[LOW_FROM:HIGH_FROM], moves[HIGH_FROM:]
    assert capacity[LOW_FROM:HIGH_FROM] == [LOW] * len(low)
    assert capacity[HIGH_FROM:] == [HIGH] * len(after)
    # (The step the budget shrinks in still peaks at the cache it had before.)
    assert max(peak[LOW_FROM + 1 : HIGH_FROM]) <= LOW < max(peak[:LOW_FROM])
    # The first steps page the touched rows in; then the cache holds them: nothing moves.
    assert before[0] > 0 and sum(before[2:]) == 0
    assert min(low) > 0  # every low-budget step moves row pages in and out
    assert sum(after[2:]) == 0 and max(after[2:]) < min(low)  # warm again, nothing moves
