"""examples/: the same custom training loop under MirroredStrategy and under ZeRO-Infinity.

The two scripts differ only in their strategy lines (at most 3 lines of a diff), and both
train: the ZeRO-Infinity one at stage 3 with parameters and optimizer states in NVMe files,
to the same losses and weights as MirroredStrategy's (1 replica there on a CPU-only host,
2 here: the sums differ in order only, so within 1e-5 relative).
"""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
MIRRORED = ROOT / "examples" / "custom_loop_mirrored.py"
ZERO = ROOT / "examples" / "custom_loop_zero.py"
STEPS = 8


def _changed_lines() -> list[str]:
    diff = difflib.unified_diff(
        MIRRORED.read_text().splitlines(), ZERO.read_text().splitlines(), lineterm="", n=0
    )
    return [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def test_examples_differ_only_in_the_strategy_lines():
    changed = _changed_lines()
    assert 1 <= len(changed) <= 3, changed
    for line in changed:
        assert "zero_runtime" in line or "MirroredStrategy" in line, line


def _train(script: Path, out: Path, nvme: Path) -> list[float]:
    env = {**os.environ, "NVME_PATH": str(nvme)}
    run = subprocess.run(
        [sys.executable, str(script), "--steps", str(STEPS), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [float(line.split()[-1]) for line in run.stdout.splitlines() if line.startswith("step")]


@pytest.mark.slow
def test_both_examples_train_to_the_same_weights(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    ref = _train(MIRRORED, tmp_path / "mirrored.npz", nvme)
    got = _train(ZERO, tmp_path / "zero.npz", nvme)
    assert len(ref) == len(got) == STEPS
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    a, b = np.load(tmp_path / "mirrored.npz"), np.load(tmp_path / "zero.npz")
    assert a.files == b.files
    for k in a.files:
        scale = max(float(np.max(np.abs(a[k]))), 1e-3)
        assert float(np.max(np.abs(a[k] - b[k]))) <= 1e-5 * scale, k
