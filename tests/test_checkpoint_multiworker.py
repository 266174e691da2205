"""Sharded checkpoints across 2 real worker processes on 127.0.0.1 (zero_runtime.launch).

Each worker saves its own replica's shards and the chief publishes the index. The chief
is SIGKILLed mid-save (the writer's kill hook, right after its first shard file is
fsynced) while saving checkpoint ``B``: the job fails, ``latest`` still names ``A``, the
unpublished temporary directory is invisible to readers, and ``A`` restores here (2
replicas in one process) with the weights the workers had when they saved it.

Before that, in the same pair of processes (TensorFlow's start-up is paid once), a
stage-3 phase: parameters and optimizer states on NVMe, each worker holding only its own
replica's shards, save ``S3``, continue (the uninterrupted run), then restore ``S3`` on
the 2 workers into a fresh model; this process then restores it on 1 replica (resharding
2 -> 1). The next steps' losses equal the uninterrupted run's (2 workers: bitwise; 1
replica: within 1e-6 relative). Then a stage-3 model with a row-paged embedding table
(lazy Adam) trains on both workers and saves; it restores here on 1 replica.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import time

import numpy as np
import pytest
from helpers import checkpoint_job as job
from helpers import relaunch

import zero_runtime
from zero_runtime.checkpoint import CheckpointManager, CheckpointReader, read_index

JOB = os.path.join(os.path.dirname(__file__), "helpers", "checkpoint_job.py")
JOB_DEADLINE_S = 240


SAVED_AT, NEXT = 3, 3  # steps before the checkpoint; steps compared after it


@pytest.fixture(scope="module")
def job_run(tmp_path_factory) -> dict:
    """One 2-worker launch: the stage-3 phase, then the stage-1 kill-mid-save phase.
    ``{"status", "log", "out", "root", "root3", "nvme", "seconds"}``."""
    base = tmp_path_factory.mktemp("ckmw")
    out, root, root3, nvme = base / "out", base / "ckpt", base / "ckpt3", base / "nvme"
    out.mkdir()
    nvme.mkdir(exist_ok=True)
    args = [sys.executable, JOB, "multiworker", str(out), str(root), "--kill-rank", "0"]
    args += ["--first-step", str(SAVED_AT), "--steps", str(NEXT)]
    args += ["--stage3-root", str(root3), "--nvme", str(nvme)]
    args += ["--embedding-root", str(base / "ckpt_emb")]
    text = io.StringIO()

    def reset() -> None:  # a relaunch starts from empty directories
        for d in (out, root, root3, nvme, base / "ckpt_emb"):
            shutil.rmtree(d, ignore_errors=True)
        out.mkdir()
        nvme.mkdir(exist_ok=True)

    start = time.monotonic()
    status = relaunch.launch_job(2, args, text, reset)
    seconds = time.monotonic() - start
    print(f"2-worker checkpoint job: {seconds:.1f} s")
    return dict(
        status=status,
        log=text.getvalue(),
        out=out,
        root=root,
        root3=root3,
        nvme=nvme,
        root_emb=base / "ckpt_emb",
    )


def test_stage3_two_workers_save_and_restore_on_two_workers_and_one_replica(job_run):
    out, root3 = job_run["out"], job_run["root3"]
    assert os.path.exists(out / "rank1_stage3.json"), job_run["log"][-3000:]
    recs = [json.loads((out / f"rank{r}_stage3.json").read_text()) for r in (0, 1)]
    index = read_index(str(root3 / "S3"))
    assert index.partition["kind"] == "rows" and index.step == SAVED_AT
    assert index.world == {
        "num_replicas": 2,
        "num_workers": 2,
        "stage": 3,
        "offload_optimizer": "nvme",
        "offload_param": "nvme",
        "gradient_accumulation_steps": 1,
    }
    # each worker wrote only its own replica's shard file (it holds only those shards)
    assert {n: (f.rank, f.replica) for n, f in index.files.items()} == {
        "replica_00000.bin": (0, 0),
        "replica_00001.bin": (1, 1),
        "replicated.bin": (0, None),
    }
    assert [r["local_replicas"] for r in recs] == [[0], [1]]
    want = recs[0]["uninterrupted"]
    assert len(want) == NEXT and want == recs[1]["uninterrupted"]
    for rec in recs:  # restored on 2 workers: same partition, bitwise
        assert (rec["step"], rec["saved_replicas"], rec["replicas"]) == (SAVED_AT, 2, 2)
        assert rec["iterations"] == SAVED_AT + NEXT
        assert rec["restored"] == want
        for got, w in zip(rec["restored_weights"], recs[0]["weights"], strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
    # restored here on 1 replica (2 -> 1), parameters and states on NVMe
    cfg = job.config(3, "nvme", str(job_run["nvme"]), offload_param="nvme")
    strategy = zero_runtime.ZeroInfinityStrategy(cfg, num_cpu_replicas=1)
    model = job.build(strategy, seed=99)
    info = CheckpointManager(str(root3), model, strategy).restore()
    assert (info.tag, info.saved_replicas, info.replicas) == ("S3", 2, 1)
    for got, w in zip(model.get_weights(), recs[0]["weights"], strict=True):
        np.testing.assert_array_equal(got, np.asarray(w, np.float32))
    losses = job.train(model, SAVED_AT, NEXT)
    np.testing.assert_allclose(losses, want, rtol=1e-6, atol=0)
    worst = float(np.max(np.abs(np.subtract(losses, want)) / np.abs(want)))
    print(f"stage 3, 2 workers -> 1 replica: max relative loss difference {worst:.3g}")
    model.close()
    strategy.close()


def test_row_paged_table_saved_by_two_workers_restores_on_one_replica(job_run):
    """Each worker saves its replica's rows and the row pages it has states for (it
    reports them to the chief through the coordination service); restored here on 1
    replica the states equal both workers' row for row and the losses continue."""
    out = job_run["out"]
    assert os.path.exists(out / "rank1_embedding.json"), job_run["log"][-3000:]
    recs = [json.loads((out / f"rank{r}_embedding.json").read_text()) for r in (0, 1)]
    assert [rec["pages"] for rec in recs] == [{"0": [0, 1]}, {"1": [0]}]
    index = read_index(str(job_run["root_emb"] / "E"))
    (table,) = index.partition["row_paged"]
    assert table["state_pages"] == {"0": [0, 1], "1": [0]}
    assert table["state_rows"] == [[0, 2048], [4000, 5024]]
    assert {n: f.rank for n, f in index.files.items()} == {
        "replica_00000.bin": 0,
        "replica_00001.bin": 1,
        "replicated.bin": 0,
    }
    want = recs[0]["uninterrupted"]
    assert want == recs[1]["uninterrupted"]
    strategy = zero_runtime.ZeroInfinityStrategy(job.embedding_config("cpu"), num_cpu_replicas=1)
    model = job.build_embedding(strategy, seed=99)
    info = CheckpointManager(str(job_run["root_emb"]), model, strategy).restore()
    assert (info.saved_replicas, info.replicas) == (2, 1)
    (embedding,) = model.engine.row_paged.values()
    assert embedding.state_pages(0) == [0, 1, 3, 4]  # rows 0-2047 and 4000-5023, re-paged
    for slot in ("momentum", "velocity"):  # each worker's rows (zeros elsewhere) add up
        saved = sum(np.load(out / f"rank{r}_embedding_{slot}.npy") for r in (0, 1))
        np.testing.assert_array_equal(embedding.state_rows(slot), saved)
    losses = job.train(model, SAVED_AT, NEXT, job.embedding_data)
    np.testing.assert_allclose(losses, want, rtol=1e-6, atol=0)
    model.close()
    strategy.close()


def test_chief_killed_mid_save_leaves_the_previous_checkpoint_loadable(job_run):
    out, root = job_run["out"], job_run["root"]
    status, log = job_run["status"], job_run["log"]
    assert status != 0, log[-3000:]
    assert "ZERO_RUNTIME_CKPT_KILL_AFTER_FILES=1: killing this process mid-save" in log
    # A completed on both workers, B never published
    assert sorted(p for p in os.listdir(out) if p.endswith("_A.json") or "_B" in p) == [
        "rank0_A.json",
        "rank1_A.json",
    ], log[-3000:]
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
