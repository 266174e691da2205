"""Faults of checkpoints and of the optimizer step, tried for real.

- A save on a full file system (a 1 MiB tmpfs, filled): a ``CheckpointWriteError`` (an
  ``OSError``, ``ENOSPC``) naming the file, the bytes needed and free; no ``.tmp-*``
  directory left however often it is retried; the previous checkpoint restores; the next
  save works once there is room.
- A non-UTF-8 byte in an ``index.json``: ``CheckpointCorruptError`` naming the file; later
  saves still work (a damaged old checkpoint never blocks a new save).
- The index's own checksum: one segment offset shifted is refused, nothing assigned.
- A step that fails with ENOSPC inside the NVMe optimizer update (the swap directory on a
  full tmpfs) leaves the weights, the optimizer states and ``iterations`` bitwise as
  before the step, at stages 1, 2 and 3; a checkpoint saved then restores exactly that.
- kill -9 at seeded random times of a training-and-saving child process: every resume
  from the last published checkpoint continues bitwise like an uninterrupted run.

Mounting needs root (CI's container runs as root); where ``mount`` is refused the tests
that need a full file system are skipped and say why.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from helpers import checkpoint_job as job
from helpers import faults

from zero_runtime.checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointWriteError,
)


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs under tmp_path (unmounted after the test)."""
    target = tmp_path / "small"
    yield faults.mount_tmpfs_or_skip(target, "size=1m")
    faults.unmount(target)


_strategy = job.strategy_for
_close = job.close


def _snapshot(model) -> dict:
    """Weights, optimizer states (every slot, flat) and ``iterations``, copied."""
    opt = model.optimizer
    store = opt.zero_state.store
    return {
        "weights": [np.array(w, copy=True) for w in model.get_weights()],
        "slots": {s: np.array(store.slot_values(s), copy=True) for s in store.slot_names},
        "iterations": int(opt.iterations.numpy()),
    }


def _assert_bitwise(got: dict, want: dict) -> None:
    assert got["iterations"] == want["iterations"]
    assert len(got["weights"]) == len(want["weights"])
    for i, (a, b) in enumerate(zip(got["weights"], want["weights"])):
        assert a.tobytes() == b.tobytes(), f"weight {i} differs"
    assert sorted(got["slots"]) == sorted(want["slots"])
    for s in want["slots"]:
        assert got["slots"][s].tobytes() == want["slots"][s].tobytes(), f"slot {s} differs"


# --- item 3: checkpoints ------------------------------------------------------------------
def test_save_on_a_full_disk_names_the_file_leaves_nothing_and_the_next_save_works(small_fs):
    strategy = _strategy(1, "cpu")
    model = job.build(strategy)
    job.train(model, 0, 2)
    root = small_fs / "ckpt"
    manager = CheckpointManager(str(root), model, strategy)
    manager.save()
    saved = _snapshot(model)
    job.train(model, 2, 1)
    filler = faults.fill(small_fs)
    for _ in range(3):  # no retry leaves another .tmp-step... directory
        with pytest.raises(CheckpointWriteError) as info:
            manager.save()
        err = info.value
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC
        assert err.path.startswith(str(root / ".tmp-step00000003-")), err.path
        assert f"writing {err.path}" in str(err) and "file system is full" in str(err)
        assert err.bytes_needed >= 3 * 4 * model.optimizer.flat_layout.shard_size
        assert f"needs at least {err.bytes_needed} bytes" in str(err)
        assert err.bytes_free is not None and f"{err.bytes_free} bytes are free" in str(err)
        assert sorted(os.listdir(root)) == ["latest", "step00000002"]
    assert (root / "latest").read_text() == "step00000002\n"
    manager.restore()  # the previous checkpoint is intact
    _assert_bitwise(_snapshot(model), saved)
    filler.unlink()
    job.train(model, 2, 1)
    result = manager.save()
    assert result.tag == "step00000003"
    assert sorted(os.listdir(root)) == ["latest", "step00000002", "step00000003"]
    _close(strategy, model)


def _damage_byte(path, marker: bytes, byte: bytes = b"\xff") -> None:
    """Replace the byte after ``marker``'s first occurrence in ``path`` with ``byte``."""
    data = path.read_bytes()
    i = data.index(marker) + len(marker)
    path.write_bytes(data[:i] + byte + data[i + 1 :])


def test_a_non_utf8_index_is_a_clear_error_and_never_blocks_a_save(tmp_path):
    strategy = _strategy(1, "cpu")
    model = job.build(strategy)
    root = tmp_path / "ckpt"
    manager = CheckpointManager(str(root), model, strategy, max_to_keep=2)
    for step in range(2):
        job.train(model, step, 1)
        manager.save()
    old = root / "step00000001" / "index.json"
    _damage_byte(old, b'"path": "')
    with pytest.raises(CheckpointCorruptError, match=rf"{old}: damaged index: byte \d+ is not"):
        manager.restore("step00000001")
    job.train(model, 2, 1)
    manager.save()  # pruning does not read the damaged index (no UnicodeDecodeError)
    assert manager.checkpoints() == ["step00000002", "step00000003"]  # the damaged one pruned
    # The newest one damaged: restoring it is refused by name, the next save works.
    newest = root / "step00000003" / "index.json"
    _damage_byte(newest, b'"tag": "')
    with pytest.raises(CheckpointCorruptError, match=str(newest)):
        manager.restore()
    snap = _snapshot(model)
    job.train(model, 3, 1)
    assert manager.save().tag == "step00000004"
    job.train(model, 4, 1)
    manager.restore()
    assert int(model.optimizer.iterations.numpy()) == 4
    assert snap["iterations"] == 3
    _close(strategy, model)


def test_a_shifted_segment_offset_is_refused_and_nothing_is_restored(tmp_path):
    strategy = _strategy(1, "cpu")
    model = job.build(strategy)
    job.train(model, 0, 1)
    manager = CheckpointManager(str(tmp_path / "ckpt"), model, strategy)
    path = os.path.join(manager.save().path, "index.json")
    with open(path) as f:
        obj = json.load(f)
    assert obj["version"] == 3 and len(obj["index_sha256"]) == 64
    obj["tensors"][0]["segments"][0]["offset"] += 4  # one float later: wrong weights
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    job.train(model, 1, 1)
    before = _snapshot(model)
    with pytest.raises(CheckpointCorruptError, match=rf"{path}: index checksum mismatch"):
        manager.restore()
    _assert_bitwise(_snapshot(model), before)
    _close(strategy, model)


CORRUPTIONS = {
    # name: (file, how) -> the error names that file
    "shard byte flipped": ("replica_00001.bin", lambda d: d[:5] + bytes([d[5] ^ 0xFF]) + d[6:]),
    "shard truncated": ("replica_00000.bin", lambda d: d[:-4]),
    "replicated truncated": ("replicated.bin", lambda d: d[:-1]),
    "index truncated": ("index.json", lambda d: d[: len(d) // 2]),
    "index value edited": ("index.json", lambda d: d.replace(b'"step": 2', b'"step": 3', 1)),
    "index not UTF-8": ("index.json", lambda d: d.replace(b'"tag": "', b'"tag": "\xfe', 1)),
}


def test_corrupt_shards_and_indexes_are_named_nothing_is_lost_and_the_next_save_works(tmp_path):
    """Each corruption of the newest checkpoint: restore raises ``CheckpointCorruptError``
    naming the file, no variable changes, the older checkpoint still restores and the next
    save publishes."""
    strategy = _strategy(2, "nvme", str(tmp_path / "nvme"))
    (tmp_path / "nvme").mkdir(exist_ok=True)
    model = job.build(strategy)
    job.train(model, 0, 1)
    found = {}
    for k, (name, (file, corrupt)) in enumerate(CORRUPTIONS.items()):
        root = tmp_path / f"ckpt{k}"
        manager = CheckpointManager(str(root), model, strategy, max_to_keep=5)
        manager.save(tag="older")
        older = _snapshot(model)
        job.train(model, 1, 1)
        manager.save(tag="newest")  # step 2
        path = root / "newest" / file
        path.write_bytes(corrupt(path.read_bytes()))
        current = _snapshot(model)
        with pytest.raises(CheckpointCorruptError) as info:
            manager.restore()
        found[name] = str(info.value)
        assert str(path) in str(info.value) or f"'{file}'" in str(info.value), (name, info.value)
        _assert_bitwise(_snapshot(model), current)  # nothing assigned
        manager.restore("older")
        _assert_bitwise(_snapshot(model), older)
        assert manager.save(tag="next").tag == "next"
        manager.restore()  # latest = next
        _assert_bitwise(_snapshot(model), older)
    print("corruption -> error:", found)
    _close(strategy, model)


# --- item 4: a failed step leaves nothing applied ------------------------------------------
def _freeze_last_layer(model, strategy, frozen: bool) -> None:
    """(Un)freeze the last Dense and recompile with the same (built) optimizer."""
    model.layers[-1].trainable = not frozen
    with strategy.scope():
        model.compile(optimizer=model.optimizer, loss="mse")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_failing_with_enospc_leaves_model_and_optimizer_exactly_as_before(
    stage, small_fs, tmp_path
):
    """The NVMe swap directory on a full tmpfs: the step raises (ENOSPC writing the
    optimizer states), and weights, every optimizer state and ``iterations`` are bitwise
    as before it; a checkpoint saved then restores exactly that, and once there is room
    the next step is the one an uninterrupted run takes.

    New NVMe space is needed only by states written for the first time (the pool reuses a
    page's slot). Stages 1-2: the last layer is frozen for 2 steps, then trained: its
    states' first write hits the full disk mid-training. Stage 3: the first step, with
    room for 8 pages, so the last blocks' updates in backward (parameter shards and
    states) are written before a later block fails.
    """
    strategy = _strategy(stage, "nvme", str(small_fs))
    model = job.build(strategy)
    opt = model.optimizer
    with strategy.scope():
        opt.build(model.trainable_variables)
    first = 0
    if stage < 3:
        _freeze_last_layer(model, strategy, True)
        job.train(model, 0, 2)
        _freeze_last_layer(model, strategy, False)
        first = 2
    before = _snapshot(model)
    filler = faults.fill(small_fs)
    if stage == 3:
        os.truncate(filler, os.path.getsize(filler) - 8 * 4096)
    with pytest.raises(tf.errors.ResourceExhaustedError, match="ENOSPC"):
        job.train(model, first, 1)
    _assert_bitwise(_snapshot(model), before)
    # A checkpoint taken now restores, into a fresh model, exactly the state before.
    root = tmp_path / "ckpt"
    CheckpointManager(str(root), model, strategy).save()
    nvme = tmp_path / "nvme2"
    nvme.mkdir(exist_ok=True)
    strategy2 = _strategy(stage, "nvme", str(nvme))
    restored = job.build(strategy2, seed=99)
    CheckpointManager(str(root), restored, strategy2).restore()
    _assert_bitwise(_snapshot(restored), before)
    # Room again: the failed step left no trace, the retry equals the restored model's.
    filler.unlink()
    job.train(model, first, 1)
    job.train(restored, first, 1)
    _assert_bitwise(_snapshot(model), _snapshot(restored))
    assert int(opt.iterations.numpy()) == before["iterations"] + 1
    _close(strategy2, restored)
    _close(strategy, model)


# --- kill -9 at random points of training and saving --------------------------------------
KILL_JOB = os.path.join(os.path.dirname(__file__), "helpers", "kill_job.py")
KILL_TRIALS = 5
KILL_STEPS = 12  # job.TOTAL_STEPS global batches


def _kill_children(trials: list[tuple], timeout: float = 300.0) -> list[str]:
    """Start one training/saving child per ``(root, nvme, mark, delay)`` at once (their
    start-up overlaps); SIGKILL each ``delay`` s after it printed the line ``mark``
    (``train s``: step s begins; ``save s``: the save after step s-1 begins). Returns the
    last line each printed before it died (where the kill landed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [
        subprocess.Popen(
            [sys.executable, KILL_JOB, str(root), str(nvme), str(KILL_STEPS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for root, nvme, _, _ in trials
    ]
    last = [""] * len(procs)

    def kill_later(k: int) -> None:
        proc = procs[k]
        for line in proc.stdout:
            last[k] = line.strip()
            if last[k] == trials[k][2]:
                break
        time.sleep(trials[k][3])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        rest = proc.stdout.read().split("\n")
        last[k] = next((x for x in reversed(rest) if x.strip()), last[k]).strip()

    threads = [threading.Thread(target=kill_later, args=(k,)) for k in range(len(procs))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
    return last


def test_kill_9_at_random_points_of_training_and_saving_resumes_bitwise(tmp_path):
    """A child trains and saves every step; it is SIGKILLed at seeded random points
    (``KILL_TRIALS``: a random step, in its training or its save, plus 0-50 ms); each
    resume from ``latest`` trains to the end and must equal the uninterrupted run bitwise
    (weights, optimizer states, ``iterations``)."""
    rng = random.Random(22)
    (tmp_path / "nvme").mkdir(exist_ok=True)
    strategy = _strategy(2, "nvme", str(tmp_path / "nvme"))
    model = job.build(strategy)
    job.train(model, 0, KILL_STEPS)
    reference = _snapshot(model)
    _close(strategy, model)
    trials = []
    for t in range(KILL_TRIALS):
        (tmp_path / f"nvme{t}").mkdir(exist_ok=True)
        mark = f"{rng.choice(['train', 'save'])} {rng.randint(2, KILL_STEPS - 1)}"
        trials.append((tmp_path / f"ckpt{t}", tmp_path / f"nvme{t}", mark, rng.uniform(0, 0.05)))
    landed = _kill_children(trials)
    outcomes = []
    for (root, nvme, _, _), where in zip(trials, landed):
        leftovers = sorted(n for n in os.listdir(root) if n.startswith(".tmp-"))
        strategy = _strategy(2, "nvme", str(nvme))
        model = job.build(strategy, seed=99)  # everything must come from the checkpoint
        manager = CheckpointManager(str(root), model, strategy, max_to_keep=2)
        step = manager.restore().step
        job.train(model, step, KILL_STEPS - step)
        _assert_bitwise(_snapshot(model), reference)
        manager.save()  # and saving goes on (the dead save's .tmp- directory is pruned)
        assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
        outcomes.append((where, step, leftovers))
        _close(strategy, model)
    print(f"kill -9: {len(outcomes)}/{KILL_TRIALS} resumed bitwise: {outcomes}")


def test_nvme_store_steps_commit_by_the_counter_and_roll_back_bitwise(small_fs):
    """The store alone (no TensorFlow step): an update of step s whose counter did not
    move is rolled back; one whose counter moved commits; an update that hits ENOSPC
    part-way (a new sub-group's first write on the full tmpfs) rolls itself back."""
    from test_optim_state import _adam_step, _layout

    from zero_runtime.memory import NvmeFullError
    from zero_runtime.optim.nvme_state import NvmeOptimizerState

    layout = _layout()
    store = NvmeOptimizerState(
        layout, ("m", "v"), str(small_fs), sub_group_size=300, page_size_bytes=65536
    )
    rng = np.random.default_rng(0)
    n = layout.shard_size
    grad = rng.standard_normal(n, dtype=np.float32)
    first = ((0, 600),)  # sub-groups 0-1; 2-4 stay unallocated
    store.update(0, first, np.zeros(n, np.float32), grad, _adam_step, step=0)
    assert store.resolve(0, 1) == "commit" and store.updates(0) == 1
    m0 = store.read_shard(0, "m")
    store.update(0, first, np.zeros(n, np.float32), grad, _adam_step, step=1)
    assert not np.array_equal(store.read_shard(0, "m"), m0)  # read: counter unknown, commit
    store.update(0, first, np.zeros(n, np.float32), grad, _adam_step, step=2)
    m2 = store.uncommitted(0).undo[0][0].copy()  # sub-group 0's momentum before step 2
    assert store.resolve(0, 2) == "rollback"  # the counter stayed at 2: not applied
    assert np.array_equal(store.read_shard(0, "m")[:300], m2) and store.updates(0) == 2
    before = store.read_shard(0, "m")
    filler = faults.fill(small_fs)
    with pytest.raises(NvmeFullError):  # sub-groups 2-4 are written for the first time
        store.update(0, ((0, n),), np.zeros(n, np.float32), grad, _adam_step, step=2)
    assert store.uncommitted(0) is None and store.updates(0) == 2
    assert store.read_shard(0, "m").tobytes() == before.tobytes()
    assert store.state_bytes == 2 * 4 * 600  # the new sub-groups were freed
    filler.unlink()
    store.update(0, ((0, n),), np.zeros(n, np.float32), grad, _adam_step, step=2)
    assert store.resolve(0, 3) == "commit" and store.state_bytes == 2 * 4 * n
    store.close()
