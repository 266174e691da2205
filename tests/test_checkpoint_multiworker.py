"""Sharded checkpoints across 2 real worker processes on 127.0.0.1 (zero_runtime.launch).

Each worker saves its own replica's shards and the chief publishes the index. The chief
is SIGKILLed mid-save (the writer's kill hook, right after its first shard file is
fsynced) while saving checkpoint ``B``: the job fails, ``latest`` still names ``A``, the
unpublished temporary directory is invisible to readers, and ``A`` restores here (2
replicas in one process) with the weights the workers had when they saved it.
"""

from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
from helpers import checkpoint_job as job

import zero_runtime
from zero_runtime import launch
from zero_runtime.checkpoint import CheckpointManager, CheckpointReader, read_index

JOB = os.path.join(os.path.dirname(__file__), "helpers", "checkpoint_job.py")
JOB_DEADLINE_S = 240


def test_chief_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    out, root = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    args = [sys.executable, JOB, "multiworker", str(out), str(root), "--kill-rank", "0"]
    args += ["--first-step", "3"]
    text = io.StringIO()
    status = launch.launch(2, args, out=text)
    log = text.getvalue()
    assert status != 0, log[-3000:]
    assert "ZERO_RUNTIME_CKPT_KILL_AFTER_FILES=1: killing this process mid-save" in log
    # A completed on both workers, B never published
    assert sorted(os.listdir(out)) == ["rank0_A.json", "rank1_A.json"], log[-3000:]
    entries = sorted(os.listdir(root))
    assert [e for e in entries if not e.startswith(".")] == ["A", "latest"], entries
    temps = [e for e in entries if e.startswith(".tmp-B-")]
    assert len(temps) == 1 and "replica_00000.bin" in os.listdir(root / temps[0])
    assert not os.path.exists(root / temps[0] / "index.json")
    assert (root / "latest").read_text().strip() == "A"
    index = read_index(str(root / "A"))
    assert index.world["num_workers"] == 2 and index.world["num_replicas"] == 2
    assert {f.rank for f in index.files.values()} == {0, 1}  # each worker wrote its shard
    CheckpointReader(str(root / "A")).verify()
    # A restores (2 replicas, one process) to the weights both workers had at A.
    want = json.loads((out / "rank0_A.json").read_text())["weights"]
    other = json.loads((out / "rank1_A.json").read_text())["weights"]
    strategy = zero_runtime.ZeroInfinityStrategy(job.config(1, "cpu"))
    model = job.build(strategy, seed=99)
    manager = CheckpointManager(str(root), model, strategy)
    assert manager.checkpoints() == ["A"]
    info = manager.restore()
    assert (info.tag, info.step, info.saved_replicas) == ("A", 3, 2)
    for got, w, w1 in zip(model.get_weights(), want, other, strict=True):
        np.testing.assert_array_equal(got, np.asarray(w, np.float32))
        np.testing.assert_array_equal(got, np.asarray(w1, np.float32))
    assert int(model.optimizer.iterations.numpy()) == 3
    strategy.close()
