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


def test_demo_resumes_from_its_checkpoint_like_an_uninterrupted_run(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _demo(tmp_path / "logs", "--steps", "6", "--checkpoint-dir", str(full))
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
