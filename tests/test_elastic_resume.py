"""A job resized between backups continues at the same example with the same global batch
(one process: the world size is the number of CPU replicas; across processes under
``zero-runtime launch --min-nproc``: tests/test_elastic_launch.py).

2 replicas x batch 8 -> 1 replica x batch 4 x 2 accumulation steps -> 2 replicas again
(:func:`zero_runtime.elastic.batch_plan`), ``fit`` with ``ZeroBackupAndRestore`` crashed
after each part: the backup's batch position is converted (``ZeroBackupAndRestore``), the
optimizer's micro-step counter rescaled at restore (``reader.rescaled_iterations``), and
the final weights equal the uninterrupted 2-replica run's bitwise at stages 1-3 (the
accumulated mean ``(g0 + g1) / 2`` equals the two replicas' summed ``g0 / 2 + g1 / 2``
exactly: halving is exact in binary floating point).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import checkpoint_job as job
from test_checkpoint_resume import Crash  # raises after N batches (micro-steps)

import zero_runtime
from zero_runtime import elastic
from zero_runtime.checkpoint import CheckpointManager, CheckpointMismatchError, ZeroBackupAndRestore

PER_EPOCH, EPOCHS = 6, 2  # global batches of 8 per epoch: 12 optimizer steps
SAVE_EVERY = 2  # optimizer steps


def _strategy(stage: int, world: int):
    plan = elastic.batch_plan(job.GLOBAL_BATCH, world_size=world, max_world_size=2)
    cfg = job.config(stage, "cpu", gradient_accumulation_steps=plan.gradient_accumulation_steps)
    if stage == 3:
        cfg["offload_param"] = "cpu"
    return zero_runtime.ZeroInfinityStrategy(cfg, num_cpu_replicas=world), plan


def _fit(model, plan, callbacks):
    """``fit`` the first ``PER_EPOCH`` global batches for ``EPOCHS`` epochs in micro-steps
    of ``plan.batch_size``."""
    x, y = job.data()
    n = PER_EPOCH * job.GLOBAL_BATCH
    options = {"epochs": EPOCHS, "shuffle": False, "verbose": 0}
    model.fit(x[:n], y[:n], batch_size=plan.batch_size, callbacks=callbacks, **options)


def test_batch_plan_keeps_the_global_batch():
    full = elastic.batch_plan(64, world_size=4, max_world_size=4)
    half = elastic.batch_plan(64, world_size=2, max_world_size=4)
    one = elastic.batch_plan(64, 2, world_size=1, max_world_size=4)
    assert (full.batch_size, full.gradient_accumulation_steps) == (64, 1)
    assert (half.batch_size, half.gradient_accumulation_steps) == (32, 2)
    assert (one.batch_size, one.gradient_accumulation_steps, one.micro_batch_per_worker) == (
        8,
        8,
        8,
    )
    for plan in (full, half, one):
        assert plan.batch_size * plan.gradient_accumulation_steps == 64
    with pytest.raises(ValueError, match="does not divide the full size 4"):
        elastic.batch_plan(64, world_size=3, max_world_size=4)
    with pytest.raises(ValueError, match="not a multiple of 4 workers"):
        elastic.batch_plan(6, world_size=2, max_world_size=4)
    assert elastic.world_sizes(8, 3) == [8, 4]
    assert elastic.world_sizes(6, 1) == [6, 3, 2, 1]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fit_resized_2_1_2_ends_with_the_uninterrupted_weights(stage, tmp_path):
    strategy, plan = _strategy(stage, 2)  # 2 replicas first: configures the logical CPUs
    reference = job.build(strategy)
    _fit(reference, plan, [])
    want = reference.get_weights()
    job.close(strategy, reference)

    backup = str(tmp_path / "backup")
    parts = [(2, 5), (1, 9), (2, None)]  # (world size, batches before the crash)
    restored = []
    for part, (world, crash) in enumerate(parts):
        strategy, plan = _strategy(stage, world)
        model = job.build(strategy, seed=99 if part else 0)  # resumed: the backup's state
        callback = ZeroBackupAndRestore(backup, save_freq=SAVE_EVERY)
        callbacks = [callback] + ([Crash(crash)] if crash else [])
        if crash:
            with pytest.raises(RuntimeError, match="crashed after step"):
                _fit(model, plan, callbacks)
        else:
            _fit(model, plan, callbacks)
        restored.append((callback.restored_epoch, callback.restored_batch))
        if crash is None:
            got = model.get_weights()
            iterations = int(model.optimizer.iterations.numpy())
        job.close(strategy, model)
    # part 1 backed up at optimizer step 4 (batch 4 of 6), which part 2 resumed at batch 8
    # of its 12 of 4 examples; it ran 9 batches (4.5 optimizer steps) and backed up at
    # optimizer step 8 (epoch 1, batch 4 of 12), which part 3 resumed at batch 2 of 6
    assert restored == [(0, 0), (0, 8), (1, 2)]
    assert iterations == PER_EPOCH * EPOCHS
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_a_checkpoint_saved_inside_an_accumulation_is_refused_at_another(tmp_path):
    """The partial gradient sum is not in a checkpoint: restoring one saved mid-way at
    another accumulation is refused before any variable changes."""
    strategy, plan = _strategy(2, 1)  # accumulation 2
    model = job.build(strategy)
    job.train(model, 0, 3)  # 3 micro-steps: 1.5 optimizer steps
    CheckpointManager(str(tmp_path / "c"), model, strategy).save(tag="mid")
    job.close(strategy, model)
    strategy, _ = _strategy(2, 2)  # accumulation 1
    model = job.build(strategy, seed=99)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(CheckpointMismatchError, match="in the middle of an accumulation"):
        CheckpointManager(str(tmp_path / "c"), model, strategy).restore("mid")
    for b, w in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(b, w)
    job.close(strategy, model)
