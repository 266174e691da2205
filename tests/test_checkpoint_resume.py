"""Resuming at the saved step with the batches that followed it (one process, 2 replicas).

``ZeroBackupAndRestore(save_freq=N)`` resumes a ``fit`` interrupted mid-epoch at the last
backup's batch (Keras's ``BackupAndRestore`` redoes the whole epoch), and the strategy's
next training iterator starts after the batches already trained, so the resumed run ends
with the uninterrupted run's weights, bitwise. Both of Keras's iterator regimes: a new
iterator per epoch (arrays, a finite dataset) and one across epochs (``steps_per_epoch``
with a repeated dataset). A custom loop resumes the same way through
``CheckpointManager.restore_or_initialize`` / ``after_step``. Preemption and restarts across
processes: tests/test_heal_multiworker.py, tests/test_heal_loop.py.
"""

from __future__ import annotations

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import checkpoint_job as job

from zero_runtime.checkpoint import CheckpointManager, ZeroBackupAndRestore

PER_EPOCH, EPOCHS = 5, 3  # batches per epoch, epochs: 15 steps
CRASH_AFTER, SAVE_EVERY = 8, 3  # steps; the backup at step 6 is epoch 1, batch 1


class Crash(keras.callbacks.Callback):
    """Raise after ``steps`` training steps (a worker dying mid-epoch)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps, self.seen = steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.steps:
            raise RuntimeError(f"crashed after step {self.steps}")


def _arrays():
    x, y = job.data()
    n = PER_EPOCH * job.GLOBAL_BATCH
    return x[:n], y[:n]


def _fit_arrays(model, callbacks):
    x, y = _arrays()
    return model.fit(
        x,
        y,
        batch_size=job.GLOBAL_BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )


def _repeated():
    x, y = job.data()  # 12 distinct batches, repeated: epochs of 4 take them in turn
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(job.GLOBAL_BATCH).repeat()


def _fit_repeated(model, callbacks):
    return model.fit(_repeated(), steps_per_epoch=4, epochs=EPOCHS, verbose=0, callbacks=callbacks)


def _reference_and_crash(strategy, fit, backup: str, save_every: int, crash_after: int):
    """The uninterrupted run's weights and steps; then a run backing up every
    ``save_every`` steps into ``backup`` that crashes after ``crash_after`` steps."""
    reference = job.build(strategy)
    fit(reference, [])
    want = reference.get_weights()
    steps = int(reference.optimizer.iterations.numpy())
    model = job.build(strategy)
    with pytest.raises(RuntimeError, match=f"crashed after step {crash_after}"):
        fit(model, [ZeroBackupAndRestore(backup, save_freq=save_every), Crash(crash_after)])
    return want, steps


@pytest.fixture(scope="module")
def strategy(tmp_path_factory):
    s = job.strategy_for(2, "cpu")
    yield s
    s.close()


@pytest.mark.parametrize("fit", [_fit_arrays, _fit_repeated], ids=["per_epoch", "repeated"])
def test_fit_resumes_mid_epoch_at_the_saved_batch_with_the_same_batches(strategy, tmp_path, fit):
    backup = str(tmp_path / "backup")
    want, steps = _reference_and_crash(strategy, fit, backup, SAVE_EVERY, CRASH_AFTER)
    resumed = job.build(strategy, seed=99)  # another init: the state is the backup's
    callback = ZeroBackupAndRestore(backup, save_freq=SAVE_EVERY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(resumed, [callback])
    per_epoch = 5 if fit is _fit_arrays else 4
    assert callback.restored_epoch == 6 // per_epoch
    assert callback.restored_batch == 6 % per_epoch
    assert callback.steps == steps  # the rest of the run, not the epoch again
    assert int(resumed.optimizer.iterations.numpy()) == steps
    for got, w in zip(resumed.get_weights(), want, strict=True):
        np.testing.assert_array_equal(got, w)
    assert not [w for w in caught if "ran out of data" in str(w.message)]
    assert not os.path.exists(backup)


@pytest.mark.parametrize("fit", [_fit_arrays, _fit_repeated], ids=["per_epoch", "repeated"])
def test_a_backup_at_an_epochs_last_batch_resumes_at_the_next_epochs_first(strategy, tmp_path, fit):
    """A backup taken at the last batch of an epoch (before Keras's next iterator):
    arrays resume with the next epoch's new iterator from its start (skipping the used-up
    iterator's batches there would leave it empty, and Keras would end ``fit`` early
    with "Your input ran out of data; interrupting training"), and the batches are
    counted from there for the next backup; a repeated dataset continues its one
    iterator."""
    per_epoch = 5 if fit is _fit_arrays else 4
    backup = str(tmp_path / "backup")
    want, steps = _reference_and_crash(strategy, fit, backup, per_epoch, per_epoch + 2)
    for crash in (per_epoch + 2, None):  # the second resume starts at the next backup
        resumed = job.build(strategy, seed=99)
        callbacks = [ZeroBackupAndRestore(backup, save_freq=per_epoch)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if crash is None:
                fit(resumed, callbacks)
            else:
                with pytest.raises(RuntimeError, match="crashed after step"):
                    fit(resumed, callbacks + [Crash(crash)])
        assert not [w for w in caught if "ran out of data" in str(w.message)]
    assert int(resumed.optimizer.iterations.numpy()) == steps
    for got, w in zip(resumed.get_weights(), want, strict=True):
        np.testing.assert_array_equal(got, w)


def test_a_backup_without_steps_per_epoch_on_a_dataset_of_unknown_length_is_refused(
    strategy, tmp_path
):
    """Keras learns an epoch's length from where its data ran out, which the resumed
    (shorter) epoch would change: refused with the fix, not continued wrongly."""
    x, y = _arrays()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(job.GLOBAL_BATCH)
    data = data.filter(lambda a, b: True)  # cardinality unknown
    backup = str(tmp_path / "backup")
    model = job.build(strategy)
    with pytest.raises(RuntimeError, match="crashed after step 7"):
        model.fit(data, epochs=2, verbose=0, callbacks=[ZeroBackupAndRestore(backup, 3), Crash(7)])
    resumed = job.build(strategy, seed=99)
    with pytest.raises(NotImplementedError, match="assert_cardinality"):
        resumed.fit(data, epochs=2, verbose=0, callbacks=[ZeroBackupAndRestore(backup, 3)])
    strategy.data_resume.clear()


def test_custom_loop_resumes_from_restore_or_initialize(strategy, tmp_path):
    reference = job.build(strategy)
    job.train(reference, 0, 8)
    want = reference.get_weights()

    root = str(tmp_path / "ckpt")
    model = job.build(strategy)
    manager = CheckpointManager(root, model, strategy, save_every=2)
    assert manager.restore_or_initialize() == 0
    for step in range(5):  # dies after step 5: the checkpoint at 4 survives
        job.train(model, step, 1)
        manager.after_step(step + 1)
    assert manager.checkpoints()[-1] == "step00000004"

    model = job.build(strategy, seed=99)
    manager = CheckpointManager(root, model, strategy, save_every=2)
    start = manager.restore_or_initialize()
    assert start == 4
    for step in range(start, 8):
        job.train(model, step, 1)
        manager.after_step(step + 1)
    for got, w in zip(model.get_weights(), want, strict=True):
        np.testing.assert_array_equal(got, w)


def test_data_distributed_before_fit_is_not_tracked_and_not_resumed_mid_epoch(strategy, tmp_path):
    """A ``DistributedDataset`` passed to ``fit`` bypasses the strategy's resumable one:
    the callback stops watching at the first batch (so the validation data, which the
    strategy distributes, is never taken for the training data), and resuming such a
    ``fit`` mid-epoch is refused naming the fix."""
    x, y = _arrays()

    def per_replica(ctx):
        batch = ctx.get_per_replica_batch_size(job.GLOBAL_BATCH)
        data = tf.data.Dataset.from_tensor_slices((x, y))
        return data.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(batch)

    def fit(model, callbacks):
        data = strategy.distribute_datasets_from_function(per_replica)
        return model.fit(
            data,
            epochs=EPOCHS,
            steps_per_epoch=PER_EPOCH,
            validation_data=(x, y),
            verbose=0,
            callbacks=callbacks,
        )

    backup = str(tmp_path / "backup")
    model = job.build(strategy)
    with pytest.raises(RuntimeError, match=f"crashed after step {CRASH_AFTER}"):
        fit(model, [ZeroBackupAndRestore(backup, save_freq=SAVE_EVERY), Crash(CRASH_AFTER)])
    assert strategy.data_resume.iterators == 0  # unbound: validation data never taken
    resumed = job.build(strategy, seed=99)
    with pytest.raises(NotImplementedError, match="distributed before fit"):
        fit(resumed, [ZeroBackupAndRestore(backup, save_freq=SAVE_EVERY)])
