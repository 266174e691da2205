"""The main job checkpoints and resumes: ``demo.train --checkpoint-dir DIR [--resume]``.

Two real demo processes with a tiny GPT (as the README's command runs the demo): the
first trains 6 steps saving every 3 (``step00000003``, ``step00000006``); the second
starts from a copy of ``step00000003`` alone, ``--resume``s and trains to step 6. Its
step-6 checkpoint holds the same parameters and optimizer states as the first run's,
read back through the checkpoint index (same replicas, same batches after ``skip``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from demo import data
from demo import train as demo_train
from zero_runtime.checkpoint import CheckpointReader, read_index

REPO = Path(__file__).resolve().parent.parent
#: A tiny demo: 1 block of width 16 on 64 KiB of text, 4 sequences of 16 bytes per step.
TINY = ["--d-model", "16", "--layers", "1", "--seq-len", "16", "--batch-size", "4"]
TINY += ["--corpus-bytes", "65536", "--checkpoint-every", "3", "--set", "stage=2"]


def _demo(logdir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, "-m", "demo.train", "--logdir", str(logdir), *TINY, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    """The uninterrupted demo run's checkpoint root: 6 steps, saved at 3 and 6."""
    base = tmp_path_factory.mktemp("demo_full")
    _demo(base / "logs", "--steps", "6", "--checkpoint-dir", str(base / "ckpt"))
    return base / "ckpt"


def test_demo_resumes_from_its_checkpoint_like_an_uninterrupted_run(full, tmp_path):
    resumed = tmp_path / "resumed"
    assert sorted(os.listdir(full)) == ["latest", "step00000003", "step00000006"]
    resumed.mkdir()
    shutil.copytree(full / "step00000003", resumed / "step00000003")
    (resumed / "latest").write_text("step00000003\n")
    proc = _demo(tmp_path / "logs", "--steps", "6", "--checkpoint-dir", str(resumed), "--resume")
    assert f"resumed from {resumed / 'step00000003'} at step 3" in proc.stdout, proc.stdout
    assert "done: 3 steps" in proc.stdout
    assert sorted(os.listdir(resumed)) == ["latest", "step00000003", "step00000006"]
    want = CheckpointReader(str(full / "step00000006"))
    got = CheckpointReader(str(resumed / "step00000006"))
    assert got.index.step == want.index.step == 6
    assert want.index.world["stage"] == 2 and want.index.optimizer["slots"] == [
        "momentum",
        "velocity",
    ]
    names = [t.name for t in want.index.tensors]
    assert names == [t.name for t in got.index.tensors]
    assert any(n.startswith("slot/velocity/") for n in names)
    for name in names:  # parameters, Adam states, step counter: as if never interrupted
        np.testing.assert_allclose(got.read(name), want.read(name), rtol=1e-6, atol=1e-7)
    # the run resumed from step 3 changed the parameters since then
    before = read_index(str(resumed / "step00000003"))
    assert before.step == 3
    assert not np.array_equal(
        CheckpointReader(str(resumed / "step00000003")).read("param/0"), want.read("param/0")
    )


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _main_in_process(tmp_path: Path, *args: str) -> int:
    """``demo.train.main`` in this process (2 logical CPUs: --replicas 2, the default)."""
    return demo_train.main(["--logdir", str(tmp_path / "logs"), *TINY, *args])


def test_resume_with_a_damaged_latest_stops_and_changes_nothing(full, tmp_path, capsys):
    """A truncated ``latest`` or a deleted ``index.json`` is not "no checkpoint" (then
    ``--resume`` would train from step 0 and replace the older checkpoints): status 2,
    the message names the bad pointer/tag and lists what is loadable, nothing changes."""
    root = tmp_path / "ckpt"
    shutil.copytree(full, root)
    cases = [
        ("", "checkpoint tag '' (named by"),
        ("step0000", "checkpoint 'step0000' (named by"),
        ("../elsewhere", "is not a tag"),
    ]
    for latest, message in cases:
        (root / "latest").write_text(latest)
        before = _tree(root)
        assert (
            _main_in_process(tmp_path, "--steps", "6", "--checkpoint-dir", str(root), "--resume")
            == 2
        )
        err = capsys.readouterr().err
        assert message in err and "['step00000003', 'step00000006']" in err, err
        assert _tree(root) == before
    (root / "latest").write_text("step00000006\n")
    (root / "step00000006" / "index.json").unlink()
    before = _tree(root)
    assert (
        _main_in_process(tmp_path, "--steps", "6", "--checkpoint-dir", str(root), "--resume") == 2
    )
    err = capsys.readouterr().err
    assert "has no index.json (incomplete or damaged)" in err and "['step00000003']" in err, err
    assert _tree(root) == before
    # Another architecture (--d-model 32): the mismatch is named, nothing is assigned/saved.
    (root / "latest").write_text("step00000003\n")
    before = _tree(root)
    args = ["--d-model", "32", "--steps", "6", "--checkpoint-dir", str(root), "--resume"]
    assert _main_in_process(tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert "model shape (16, 32) != checkpoint shape (16, 16)" in err, err
    assert _tree(root) == before


def test_fresh_run_into_a_checkpoint_dir_with_checkpoints_refuses(full, tmp_path, capsys):
    """Without ``--resume`` a run would re-save step3/step6 over the old run's: status 2."""
    root = tmp_path / "ckpt"
    shutil.copytree(full, root)
    before = _tree(root)
    assert _main_in_process(tmp_path, "--steps", "6", "--checkpoint-dir", str(root)) == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints ['step00000003', 'step00000006']" in err, err
    assert "--resume" in err
    assert _tree(root) == before


def test_resume_with_another_batch_size_continues_at_the_next_sequence(full, tmp_path, capsys):
    """Saved after 3 steps of 4 sequences; resumed with --batch-size 2 for 2 more steps:
    the stream continues at sequence 12 (not 3 * 2 = 6), the new checkpoint records 16."""
    assert read_index(str(full / "step00000003")).client_state["data"] == {
        "batch_size": 4,
        "seq_len": 16,
        "seed": 0,
        "corpus_bytes": 65536,
        "samples": 12,
    }
    root = tmp_path / "ckpt"
    root.mkdir()
    shutil.copytree(full / "step00000003", root / "step00000003")
    (root / "latest").write_text("step00000003\n")
    args = [*TINY, "--batch-size", "2", "--steps", "5", "--checkpoint-dir", str(root), "--resume"]
    assert demo_train.main(["--logdir", str(tmp_path / "logs"), *args]) == 0
    out = capsys.readouterr().out
    assert "12 sequences seen" in out and "continuing at sequence 12" in out, out
    assert read_index(str(root / "step00000005")).client_state["data"]["samples"] == 16
    # The stream itself: sequences 12, 13 are the first half of the 4-batch stream's batch 3.
    parsed = demo_train.build_parser().parse_args(args)
    tokens = data.split_corpus(data.load_corpus(65536, seed=0)).train
    x2, y2 = next(iter(demo_train.resume_dataset(tokens, parsed, 12)))
    x4, y4 = next(iter(data.make_dataset(tokens, 16, 4, seed=0).skip(3)))
    np.testing.assert_array_equal(x2.numpy(), x4.numpy()[:2])
    np.testing.assert_array_equal(y2.numpy(), y4.numpy()[:2])


def test_a_non_utf8_index_stops_a_resume_with_status_2_and_blocks_no_save(full, tmp_path, capsys):
    """A non-UTF-8 byte in an ``index.json`` is no ``UnicodeDecodeError`` (exit 1) and
    breaks no later save (pruning does not read each index): ``--resume`` onto it stops
    with status 2 naming the file, nothing changed; a run resuming from an intact checkpoint
    trains and saves over the damaged one."""
    root = tmp_path / "ckpt"
    shutil.copytree(full, root)
    index = root / "step00000006" / "index.json"
    data = index.read_bytes()
    at = data.index(b'"tag": "') + len(b'"tag": "')
    index.write_bytes(data[:at] + b"\xff" + data[at + 1 :])
    before = _tree(root)
    assert (
        _main_in_process(tmp_path, "--steps", "6", "--checkpoint-dir", str(root), "--resume") == 2
    )
    err = capsys.readouterr().err
    assert f"{index}: damaged index: byte {at} is not UTF-8" in err, err
    assert _tree(root) == before
    assert _main_in_process(tmp_path, "--steps", "6", "--checkpoint-dir", str(root)) == 2
    assert "already holds checkpoints ['step00000003', 'step00000006']" in capsys.readouterr().err
    (root / "latest").write_text("step00000003\n")
    assert (
        _main_in_process(tmp_path, "--steps", "6", "--checkpoint-dir", str(root), "--resume") == 0
    )
    assert read_index(str(root / "step00000006")).step == 6  # the damaged copy replaced
    assert (root / "latest").read_text() == "step00000006\n"


def test_a_save_on_a_full_disk_stops_the_demo_with_status_2_naming_the_file(tmp_path, capsys):
    """``--checkpoint-dir`` on a full file system (a filled 1 MiB tmpfs): the first save
    fails; the demo exits 2 with the message (file, bytes needed and free), and no
    ``.tmp-*`` directory is left."""
    from helpers import faults

    small = tmp_path / "small"
    faults.mount_tmpfs_or_skip(small, "size=1m")
    try:
        (small / "ckpt").mkdir()
        faults.fill(small)
        args = ["--steps", "3", "--checkpoint-dir", str(small / "ckpt")]
        assert _main_in_process(tmp_path, *args) == 2
        err = capsys.readouterr().err
        assert "checkpoint save failed: the file system is full" in err, err
        assert f"writing {small / 'ckpt' / '.tmp-step00000003-'}" in err, err
        assert "bytes are free there now" in err
        assert os.listdir(small / "ckpt") == []
    finally:
        faults.unmount(small)
