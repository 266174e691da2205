"""Sharded checkpoints (zero_runtime.checkpoint): round trips at stages 1-3 on every
optimizer tier, re-partitioning onto 1 and 4 replicas in a fresh process, consolidated
export loaded without zero_runtime, ZeroBackupAndRestore resume, errors, retention and
no growth over repeated saves/restores (NVMe files, pool tiers, heap), stage-3 row-paged
embedding tables with their lazy (touched pages only) optimizer states, 2 -> 1 replicas,
and the ``memory_hierarchy/checkpoint`` (save) and ``checkpoint_restore`` summaries.

The pytest process has 2 logical CPUs (root conftest.py); 1 and 4 replicas run in one
subprocess (tests/helpers/checkpoint_job.py) that configures 4 logical CPUs. The 2-worker
crash-mid-save test is in test_checkpoint_multiworker.py.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import checkpoint_job as job
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

import zero_runtime
from tb_plugin import metadata
from zero_runtime import cli
from zero_runtime.checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ZeroBackupAndRestore,
    read_index,
)

JOB = os.path.join(os.path.dirname(__file__), "helpers", "checkpoint_job.py")
SAVED_AT = 3  # steps trained before the checkpoint
NEXT = 3  # steps compared after it
#: (stage, offload_optimizer) of the round trips; stage 3 keeps parameters on the host.
CASES = [(1, "cpu"), (1, "none"), (2, "nvme"), (3, "cpu")]


_strategy = job.strategy_for
_close = job.close


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per case: a model trained SAVED_AT steps on 2 replicas, checkpointed, then NEXT more
    steps (the uninterrupted run's losses). {case: dict(root, losses, nvme, weights)}."""
    out = {}
    for stage, offload in CASES:
        base = tmp_path_factory.mktemp(f"s{stage}{offload}")
        nvme = str(base / "nvme")
        os.makedirs(nvme)
        strategy = _strategy(stage, offload, nvme)
        model = job.build(strategy)
        job.train(model, 0, SAVED_AT)
        saved_weights = [w.copy() for w in model.get_weights()]
        result = CheckpointManager(str(base / "ckpt"), model, strategy).save()
        losses = job.train(model, SAVED_AT, NEXT)
        out[(stage, offload)] = {
            "root": str(base / "ckpt"),
            "result": result,
            "losses": losses,
            "nvme": nvme,
            "weights": saved_weights,
            "model": model,
            "strategy": strategy,
        }
    yield out
    for rec in out.values():
        _close(rec["strategy"], rec["model"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_restore_on_two_replicas_continues_bitwise(case, saved):
    rec = saved[case]
    stage, offload = case
    strategy = _strategy(stage, offload, rec["nvme"])
    model = job.build(strategy, seed=99)  # a different init: everything must come from disk
    info = CheckpointManager(rec["root"], model, strategy).restore()
    assert (info.tag, info.step, info.saved_replicas, info.replicas) == (
        f"step{SAVED_AT:08d}",
        SAVED_AT,
        2,
        2,
    )
    for got, want in zip(model.get_weights(), rec["weights"], strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(model.optimizer.iterations.numpy()) == SAVED_AT
    losses = job.train(model, SAVED_AT, NEXT)
    assert losses == rec["losses"]  # same replicas: bitwise
    _close(strategy, model)


def test_index_records_partition_files_and_checksums(saved):
    rec = saved[(2, "nvme")]
    index = read_index(rec["result"].path)
    assert index.step == SAVED_AT and index.world["num_replicas"] == 2
    assert index.world["stage"] == 2 and index.optimizer["tier"] == "nvme"
    assert index.optimizer["slots"] == ["momentum", "velocity"]
    part = index.partition
    assert part["kind"] == "flat" and part["num_shards"] == 2 and len(part["buckets"]) > 1
    # 3 Dense layers: 6*12+12 + 12*12+12 + 12*4+4 parameters, padded per bucket to 2 shards
    total = 6 * 12 + 12 + 12 * 12 + 12 + 12 * 4 + 4
    assert sum(b["size"] for b in part["buckets"]) == total
    assert part["shard_size"] * 2 == total + sum(part["padding"])
    names = sorted(index.files)
    assert names == ["replica_00000.bin", "replica_00001.bin", "replicated.bin"]
    # each replica file: the parameter shard + 2 slot shards, float32
    assert index.files["replica_00000.bin"].bytes == 3 * 4 * part["shard_size"]
    assert all(len(f.sha256) == 64 for f in index.files.values())
    kernel = index.tensor("param/0")
    assert kernel.shape == (6, 12) and kernel.dtype == "float32"
    assert sum(s.count for s in kernel.segments) == 72
    assert {s.file for s in kernel.segments} <= {"replica_00000.bin", "replica_00001.bin"}
    assert [t.name for t in index.group("optimizer_var")][:1] == ["optimizer_var/0"]
    stage3 = read_index(saved[(3, "cpu")]["result"].path)
    assert stage3.partition["kind"] == "rows" and stage3.world["offload_param"] == "cpu"
    # the index is the only description: the reader rebuilds each tensor from segments
    assert rec["result"].bytes_written == sum(f.bytes for f in index.files.values())


def test_reshard_from_two_replicas_to_one_and_four(saved, tmp_path):
    """Saved at 2 replicas, restored at 1 and at 4: the next steps'
    losses equal the uninterrupted run's within 1e-6 relative (stages 1, 2 and 3)."""
    specs = [(1, "cpu"), (2, "nvme"), (3, "cpu")]
    out = tmp_path / "reshard.json"
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    args = [sys.executable, JOB, "restore", str(out), "--replicas", "1,4", "--nvme", str(nvme)]
    args += ["--first-step", str(SAVED_AT), "--steps", str(NEXT)]
    for stage, offload in specs:
        args += ["--spec", f"{stage}:{offload}:{saved[(stage, offload)]['root']}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    for stage, offload in specs:
        want = saved[(stage, offload)]["losses"]
        for n in (1, 4):
            got = results[f"{stage}:{offload}:{n}"]
            assert (got["replicas"], got["saved_replicas"], got["step"]) == (n, 2, SAVED_AT)
            assert got["iterations"] == SAVED_AT + NEXT
            np.testing.assert_allclose(got["losses"], want, rtol=1e-6, atol=0)


def test_export_keras_and_savedmodel_predict_like_the_trained_model(saved, tmp_path):
    rec = saved[(1, "cpu")]
    strategy = _strategy(1, "cpu", rec["nvme"])
    model = job.build(strategy, seed=99)
    CheckpointManager(rec["root"], model, strategy).restore()
    x = job.data()[0][:16]
    want = model.predict(x, verbose=0)
    _close(strategy, model)
    keras_file = str(tmp_path / "model.keras")
    saved_model = str(tmp_path / "savedmodel")
    assert cli.main(["export", rec["root"], "--out", keras_file]) == 0  # model from the index
    assert cli.main(["export", rec["root"], "--out", saved_model]) == 0
    with zipfile.ZipFile(keras_file) as z:
        assert "zero_runtime" not in z.read("config.json").decode()
    # Loaded where zero_runtime cannot be imported.
    code = (
        "import sys, json, numpy as np; sys.modules['zero_runtime'] = None\n"
        "import keras, tensorflow as tf\n"
        f"x = np.load({str(tmp_path / 'x.npy')!r})\n"
        f"a = keras.models.load_model({keras_file!r}).predict(x, verbose=0)\n"
        f"served = tf.saved_model.load({saved_model!r})\n"
        "b = served.serve(tf.constant(x)).numpy()\n"
        f"np.save({str(tmp_path / 'a.npy')!r}, a); np.save({str(tmp_path / 'b.npy')!r}, b)\n"
    )
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "a.npy"), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.load(tmp_path / "b.npy"), want, rtol=0, atol=1e-6)


def test_export_cli_errors_name_the_bad_path(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert cli.main(["export", missing, "--out", str(tmp_path / "m.keras")]) == 2
    assert missing in capsys.readouterr().err


def _fit_epochs(model, epochs, callbacks=()):
    x, y = job.data()
    return model.fit(
        x[: 4 * job.GLOBAL_BATCH],  # 4 steps per epoch
        y[: 4 * job.GLOBAL_BATCH],
        batch_size=job.GLOBAL_BATCH,
        epochs=epochs,
        verbose=0,
        shuffle=False,
        callbacks=list(callbacks),
    )


def test_backup_and_restore_resumes_an_interrupted_fit(tmp_path):
    strategy = _strategy(2, "cpu", str(tmp_path))
    reference = job.build(strategy)
    _fit_epochs(reference, 4)
    want = reference.get_weights()

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted at epoch 2")

    backup = str(tmp_path / "backup")
    model = job.build(strategy)
    with pytest.raises(RuntimeError, match="interrupted at epoch 2"):
        _fit_epochs(model, 4, [ZeroBackupAndRestore(backup), Interrupt()])
    assert sorted(os.listdir(backup)) == ["latest", "step00000008"]  # epochs 0-1 done
    resumed = job.build(strategy, seed=99)  # a new model: the state comes from the backup
    callback = ZeroBackupAndRestore(backup)
    history = _fit_epochs(resumed, 4, [callback])
    assert callback.restored_epoch == 2 and len(history.history["loss"]) == 2
    for got, w in zip(resumed.get_weights(), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-7)
    assert not os.path.exists(backup)  # deleted after a completed fit
    _close(strategy, reference)


def test_errors_name_the_bad_value(saved, tmp_path):
    rec = saved[(1, "cpu")]
    strategy = _strategy(1, "cpu", rec["nvme"])
    model = job.build(strategy, seed=99)
    before = [w.copy() for w in model.get_weights()]
    missing = str(tmp_path / "does_not_exist")
    with pytest.raises(CheckpointNotFoundError, match="does_not_exist"):
        CheckpointManager(missing, model, strategy).restore()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError, match="latest"):
        CheckpointManager(str(empty), model, strategy).restore()
    with pytest.raises(CheckpointNotFoundError, match="'step99'"):
        CheckpointManager(rec["root"], model, strategy).restore("step99")
    # A flipped byte in one shard file: checksum mismatch naming the file; nothing assigned.
    bad = tmp_path / "bad"
    shutil.copytree(rec["root"], bad)
    shard = bad / rec["result"].tag / "replica_00001.bin"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch.*replica_00001.bin"):
        CheckpointManager(str(bad), model, strategy).restore()
    shard.unlink()
    with pytest.raises(CheckpointCorruptError, match="replica_00001.bin' is missing"):
        CheckpointManager(str(bad), model, strategy).restore()
    for got, want in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(got, want)
    _close(strategy, model)
    # A model of another shape: the message names the variable and both shapes.
    strategy = _strategy(1, "cpu", rec["nvme"])
    with strategy.scope():
        other = keras.Sequential(
            [keras.Input((job.FEATURES,)), keras.layers.Dense(13), keras.layers.Dense(13)]
            + [keras.layers.Dense(job.CLASSES)]
        )
        other.compile(optimizer="adam", loss="mse")
    with pytest.raises(CheckpointMismatchError, match=r"kernel.*\(6, 13\).*\(6, 12\)"):
        CheckpointManager(rec["root"], other, strategy).restore()
    strategy.close()


def _disk(path) -> tuple[int, int, int]:
    """(files, bytes by size, bytes allocated on disk) under ``path``."""
    files = size = blocks = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            st = os.stat(os.path.join(dirpath, name))
            files, size, blocks = files + 1, size + st.st_size, blocks + 512 * st.st_blocks
    return files, size, blocks


def test_repeated_saves_keep_max_to_keep_and_do_not_grow(tmp_path):
    """20 saves and 20 restores with NVMe optimizer states: the NVMe directory (files,
    bytes), the pool's tiers and the Python heap end where they started."""
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    strategy = _strategy(2, "nvme", str(nvme))
    model = job.build(strategy)
    job.train(model, 0, 1)
    store = model.optimizer.zero_state.store
    root = tmp_path / "ckpt"
    manager = CheckpointManager(str(root), model, strategy, max_to_keep=3)
    for i in range(3):
        manager.save(tag=f"warm{i}")
    manager.restore()
    disk, usage = _disk(nvme), store.usage()
    assert disk[0] == 1 and disk[1] > 0  # the pool's slab file
    assert usage["nvme"][0] > 0  # the states are on NVMe
    momentum = store.slot_values("momentum")
    tracemalloc.start()
    gc.collect()  # count objects kept alive, not garbage awaiting the cycle collector
    first = tracemalloc.get_traced_memory()[0]
    for i in range(20):
        manager.save(tag=f"t{i:02d}")
        manager.restore()
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - first
    tracemalloc.stop()
    assert _disk(nvme) == disk and store.usage() == usage
    np.testing.assert_array_equal(store.slot_values("momentum"), momentum)
    assert sorted(os.listdir(root)) == ["latest", "t17", "t18", "t19"]
    assert manager.latest == "t19" and manager.checkpoints() == ["t17", "t18", "t19"]
    assert manager.last_restore.tag == "t19"
    assert grown < 256 * 1024, grown  # bytes of Python objects kept over 20 saves + restores
    assert manager.last_save.bytes_written > 0 and manager.last_save.seconds > 0
    # a save that died before publishing is ignored by readers and removed by the next save
    (root / ".tmp-t20-deadbeef").mkdir()
    assert manager.checkpoints() == ["t17", "t18", "t19"]
    manager.save(tag="t20")
    assert sorted(os.listdir(root)) == ["latest", "t18", "t19", "t20"]
    # the same tag again replaces it
    manager.save(tag="t20")
    assert manager.checkpoints() == ["t18", "t19", "t20"]
    _close(strategy, model)
    assert tf.config.list_logical_devices("CPU")  # the session's devices are untouched


@pytest.fixture(scope="module")
def embedding_saved(tmp_path_factory):
    """A stage-3 model with a row-paged table (lazy Adam) trained SAVED_AT steps on 2
    replicas, saved, then NEXT more steps. {root, result, losses, weights, states}."""
    base = tmp_path_factory.mktemp("emb")
    strategy = zero_runtime.ZeroInfinityStrategy(job.embedding_config("cpu"))
    model = job.build_embedding(strategy)
    job.train(model, 0, SAVED_AT, job.embedding_data)
    (embedding,) = model.engine.row_paged.values()
    rec = {
        "root": str(base / "ckpt"),
        "weights": [w.copy() for w in model.get_weights()],
        "states": {s: embedding.state_rows(s) for s in ("momentum", "velocity")},
        "pages": [embedding.state_pages(r) for r in (0, 1)],
    }
    rec["result"] = CheckpointManager(rec["root"], model, strategy).save()
    rec["losses"] = job.train(model, SAVED_AT, NEXT, job.embedding_data)
    _close(strategy, model)
    return rec


def test_row_paged_embedding_index_records_the_pages_with_states(embedding_saved):
    rec = embedding_saved
    # ids in rows [0, 1500) and [4000, 4500): replica 0's pages 0-1, replica 1's page 0
    assert rec["pages"] == [[0, 1], [0]]
    index = read_index(rec["result"].path)
    (table,) = index.partition["row_paged"]
    assert table == {
        "param": 0,
        "shape": [job.VOCAB, job.WIDTH],
        "rows_per_shard": 4000,
        "rows_per_page": 1024,
        "pages_per_shard": 4,
        "state_pages": {"0": [0, 1], "1": [0]},
        "state_rows": [[0, 2048], [4000, 5024]],
    }
    with open(os.path.join(rec["result"].path, "index.json")) as f:
        assert json.load(f)["version"] == 3  # > 1: a reader without sparse tensors refuses it
    param, momentum = index.tensor("param/0"), index.tensor("slot/momentum/0")
    assert param.shape == momentum.shape == (job.VOCAB, job.WIDTH) and not param.sparse
    assert sum(s.count for s in param.segments) == job.VOCAB * job.WIDTH
    assert momentum.sparse and sum(s.count for s in momentum.segments) == 3 * 1024 * job.WIDTH
    # the dense part (Dense kernel and bias) keeps the flat layout of the optimizer
    assert [t.shape for t in index.group("param")] == [(8000, 16), (64, 1), (1,)]
    # replica files: dense shard groups + the table's 4000 rows + 2 slots x its state pages
    shard = index.partition["shard_size"]
    assert index.files["replica_00000.bin"].bytes == 4 * (3 * shard + 16 * (4000 + 2 * 2048))
    assert index.files["replica_00001.bin"].bytes == 4 * (3 * shard + 16 * (4000 + 2 * 1024))
    saved = rec["states"]["velocity"]
    assert np.count_nonzero(saved[2048:4000]) == 0 and np.count_nonzero(saved[5024:]) == 0


@pytest.mark.parametrize("replicas", [2, 1])
def test_row_paged_embedding_restores_rows_and_lazy_states(embedding_saved, replicas):
    """Restore on 2 replicas (bitwise) and on 1 (re-paged: 8 pages of one shard): the
    table, the touched pages' states (untouched rows zero) and the next steps' losses."""
    rec = embedding_saved
    strategy = zero_runtime.ZeroInfinityStrategy(
        job.embedding_config("cpu"), num_cpu_replicas=replicas
    )
    model = job.build_embedding(strategy, seed=99)
    (embedding,) = model.engine.row_paged.values()
    x = np.full((job.GLOBAL_BATCH, job.SEQ), 7900, np.int32)  # a page the checkpoint lacks
    model.train_on_batch(x, np.zeros((job.GLOBAL_BATCH, 1), np.float32))
    assert embedding.state_pages(replicas - 1) != []  # states that the restore must drop
    info = CheckpointManager(rec["root"], model, strategy).restore()
    assert (info.saved_replicas, info.replicas, info.step) == (2, replicas, SAVED_AT)
    want_pages = [[0, 1], [0]] if replicas == 2 else [[0, 1, 3, 4]]  # rows 0-2047, 4000-5023
    assert [embedding.state_pages(r) for r in range(replicas)] == want_pages
    for slot, want in rec["states"].items():
        np.testing.assert_array_equal(embedding.state_rows(slot), want)
    for got, want in zip(model.get_weights(), rec["weights"], strict=True):
        np.testing.assert_array_equal(got, want)
    losses = job.train(model, SAVED_AT, NEXT, job.embedding_data)
    if replicas == 2:
        assert losses == rec["losses"]
    np.testing.assert_allclose(losses, rec["losses"], rtol=1e-6, atol=0)
    _close(strategy, model)


def test_strategy_methods_delegate_and_record_checkpoint_summaries(tmp_path):
    """save/load through the strategy; each writes a summary (bytes, seconds) into the run's
    event file: the save ``memory_hierarchy/checkpoint``, the restore
    ``memory_hierarchy/checkpoint_restore``."""
    logdir = tmp_path / "run"
    cfg = job.config(1, "cpu", str(tmp_path))
    strategy = zero_runtime.ZeroInfinityStrategy(cfg, logdir=str(logdir))
    model = job.build(strategy)
    job.train(model, 0, 2)
    result = strategy.save_checkpoint(str(tmp_path / "c"), model, client_state={"epoch": 7})
    want = model.get_weights()
    fresh = job.build(strategy, seed=99)
    info = strategy.load_checkpoint(str(tmp_path / "c"), fresh)
    assert info.tag == result.tag == "step00000002" and info.client_state == {"epoch": 7}
    for got, w in zip(fresh.get_weights(), want, strict=True):
        np.testing.assert_array_equal(got, w)
    _close(strategy, model)
    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    events = [
        (e.step, json.loads(tensor_util.make_ndarray(e.tensor_proto).item()))
        for tag in (metadata.TAG_CHECKPOINT, metadata.TAG_CHECKPOINT_RESTORE)  # save, restore
        for e in acc.Tensors(tag)
    ]
    assert [(step, ev["op"], ev["tag"]) for step, ev in events] == [
        (2, "save", "step00000002"),
        (2, "restore", "step00000002"),
    ]
    saved, restored = events[0][1], events[1][1]
    assert saved["bytes"] == result.bytes_written > 0 and saved["seconds"] == result.seconds
    assert restored["bytes"] == read_index(result.path).total_bytes() == info.bytes_read
    assert restored["seconds"] == info.seconds > 0
    assert (saved["replicas"], saved["rank"], restored["saved_replicas"]) == (2, 0, 2)


def test_damaged_latest_is_reported_not_taken_for_an_empty_directory(saved, tmp_path):
    """``manager.latest`` is None only when nothing was published: a truncated ``latest``
    or a deleted ``index.json`` is not None (read as None, a resuming job, the demo or
    ``ZeroBackupAndRestore``, would start over and replace the checkpoints). The tag comes
    back as written and ``restore`` raises naming it and listing the loadable tags; the
    other checkpoints still load."""
    rec = saved[(1, "cpu")]
    strategy = _strategy(1, "cpu", rec["nvme"])
    model = job.build(strategy, seed=99)
    root = tmp_path / "ckpt"
    shutil.copytree(rec["root"], root)
    tag = rec["result"].tag
    manager = CheckpointManager(str(root), model, strategy)
    assert CheckpointManager(str(tmp_path / "none"), model, strategy).latest is None
    for content, message in [
        ("", r"checkpoint tag '' \(named by .*latest'\) is not a tag"),
        ("step000", r"checkpoint 'step000' \(named by .*latest'\) not found: .* does not exist"),
        ("../other/" + tag, r"'\.\./other/step00000003' .* is not a tag"),
    ]:
        (root / "latest").write_text(content)
        assert manager.latest == content
        with pytest.raises(CheckpointNotFoundError, match=message) as err:
            manager.restore()
        assert f"published tags under {str(root)!r}: [{tag!r}]" in str(err.value)
    (root / "latest").write_text(tag + "\n")
    shutil.copytree(root / tag, root / "older")
    (root / tag / "index.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"has no index.json .*\['older'\]"):
        manager.restore()
    assert manager.restore("older").tag == tag  # the copy's index names the original tag
    (root / "latest").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"\['older'\] but no 'latest'"):
        manager.latest  # noqa: B018
    with pytest.raises(CheckpointNotFoundError, match="is a file, not a directory"):
        CheckpointManager(str(root / tag / "replica_00000.bin"), model, strategy).restore()
    _close(strategy, model)


def test_restore_into_an_uncompiled_model_loads_parameters_only(saved):
    """An uncompiled model (no optimizer: inference) loads its parameters (no
    AttributeError 'Sequential' object has no attribute 'optimizer')."""
    rec = saved[(2, "nvme")]
    strategy = _strategy(1, "cpu", rec["nvme"])
    with strategy.scope():
        keras.utils.set_random_seed(99)
        bare = keras.Sequential(
            [keras.Input((job.FEATURES,)), keras.layers.Dense(job.HIDDEN, activation="tanh")]
            + [keras.layers.Dense(job.HIDDEN, activation="tanh"), keras.layers.Dense(4)]
        )
    info = CheckpointManager(rec["root"], bare, strategy).restore()
    assert info.step == SAVED_AT
    for got, want in zip(bare.get_weights(), rec["weights"], strict=True):
        np.testing.assert_array_equal(got, want)
    strategy.close()


def test_bad_client_state_fails_before_any_file_is_written(saved, tmp_path):
    rec = saved[(1, "cpu")]
    manager = CheckpointManager(str(tmp_path / "c"), rec["model"], rec["strategy"])
    with pytest.raises(TypeError, match="client_state must be JSON-serialisable.*set"):
        manager.save(client_state={"seen": {1, 2}})
    with pytest.raises(TypeError, match="client_state must be a dict, got list"):
        manager.save(client_state=[1])
    assert not os.path.exists(tmp_path / "c") or os.listdir(tmp_path / "c") == []


def test_backup_and_restore_does_not_leave_the_initial_epoch_set(tmp_path):
    """After a resumed fit, a later ``fit`` of the same model runs all its epochs (the
    restored ``_initial_epoch`` does not stay set: ``fit(epochs=1)`` would run none)."""
    strategy = _strategy(2, "cpu", str(tmp_path))
    model = job.build(strategy)
    backup = str(tmp_path / "backup")
    _fit_epochs(model, 1, [ZeroBackupAndRestore(backup, delete_checkpoint=False)])
    callback = ZeroBackupAndRestore(backup)
    assert len(_fit_epochs(model, 2, [callback]).history["loss"]) == 1  # epoch 1 only
    assert callback.restored_epoch == 1 and model._initial_epoch is None
    assert len(_fit_epochs(model, 1).history["loss"]) == 1
    _close(strategy, model)


def test_interrupted_same_tag_save_keeps_the_old_copy(saved, tmp_path):
    """Saving an existing tag moves the old directory aside, renames the new one in, then
    deletes the old: a save killed between the two renames leaves ``latest`` naming a
    missing tag and the only copy in ``.tmp-old-<tag>-<nonce>``; the next save's pruning
    keeps that copy and the error says where it is."""
    rec = saved[(1, "cpu")]
    root = tmp_path / "ckpt"
    shutil.copytree(rec["root"], root)
    tag = rec["result"].tag
    aside = root / f".tmp-old-{tag}-0123456789ab"
    os.rename(root / tag, aside)  # the state between the two renames
    manager = CheckpointManager(str(root), rec["model"], rec["strategy"])
    with pytest.raises(CheckpointNotFoundError, match=r"earlier copy is '.*\.tmp-old-step"):
        manager.restore()
    manager.save(tag="other")  # prunes leftovers: not the sole copy of a tag
    assert aside.is_dir() and sorted(os.listdir(root)) == [aside.name, "latest", "other"]
    os.rename(aside, root / tag)
    assert manager.restore(tag).step == SAVED_AT


@pytest.mark.parametrize("src, dst", [((2, "nvme"), (3, "cpu")), ((3, "cpu"), (1, "cpu"))])
def test_restore_across_stages(saved, src, dst):
    """A stage-2 checkpoint restores into a stage-3 ShardedModel and a stage-3 one into a
    stage-1 model (the canonical tensors do not depend on the stage): same weights, and the
    next losses follow the saving run's."""
    rec = saved[src]
    strategy = _strategy(*dst, rec["nvme"])
    model = job.build(strategy, seed=99)
    info = CheckpointManager(rec["root"], model, strategy).restore()
    assert info.step == SAVED_AT and int(model.optimizer.iterations.numpy()) == SAVED_AT
    for got, want in zip(model.get_weights(), rec["weights"], strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(job.train(model, SAVED_AT, NEXT), rec["losses"], rtol=1e-5)
    _close(strategy, model)


def test_export_of_a_model_with_custom_layers_names_the_module_to_import(tmp_path, capsys):
    """The demo GPT's custom layers must be registered to rebuild it from the index's
    config. ``zero-runtime export`` of a demo checkpoint without them is an error naming
    the classes and modules (not Keras's TypeError traceback), and ``--import
    demo.model`` (``import_modules``) exports it."""
    from demo import model as demo_model

    strategy = _strategy(1, "cpu", str(tmp_path))
    with strategy.scope():
        gpt = demo_model.build_gpt(
            demo_model.GPTConfig(seq_len=8, d_model=8, n_heads=2, n_layers=1, d_ff=16), seed=0
        )
        gpt.compile(optimizer="adam", loss=demo_model.make_loss())
    root = str(tmp_path / "ckpt")
    strategy.save_checkpoint(root, gpt)
    x = np.arange(16, dtype=np.int32).reshape(2, 8)
    want = gpt.predict(x, verbose=0)
    registry = keras.saving.get_custom_objects()
    demo_keys = [k for k in registry if k.startswith("zero_infinity_demo>")]
    assert len(demo_keys) == 2
    saved_entries = {k: registry.pop(k) for k in demo_keys}  # as in a fresh process
    try:
        out = str(tmp_path / "gpt.keras")
        assert cli.main(["export", root, "--out", out]) == 2
        err = capsys.readouterr().err
        assert "demo.model.TokenAndPositionEmbedding, demo.model.TransformerBlock" in err, err
        assert "['demo.model']" in err and "--import MODULE" in err
        assert not os.path.exists(out)
        assert cli.main(["export", root, "--out", out, "--import", "no_such_module"]) == 2
        assert "--import: No module named 'no_such_module'" in capsys.readouterr().err
    finally:
        registry.update(saved_entries)
    assert cli.main(["export", root, "--out", out, "--import", "demo.model"]) == 0
    got = keras.models.load_model(out).predict(x, verbose=0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    strategy.close()
