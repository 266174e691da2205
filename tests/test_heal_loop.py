"""A custom loop that heals itself through ``CheckpointManager.restore_or_initialize`` /
``after_step`` under ``zero-runtime launch --max-restarts``, and the three ways a
preemption ends (tests/helpers/heal_loop_job.py, one process with 2 CPU replicas):

- attempt 0, one SIGTERM: the loop saves at the next step boundary and exits 42; the next
  attempt resumes exactly there;
- attempt 1, two SIGTERMs: the second ends the process at once (status 143); the next
  attempt resumes at the last periodic save before it;
- attempt 2, a SIGTERM during a step longer than the grace period (2 s): SIGALRM ends it
  when the period runs out (status 142), also from the last periodic save.

The fourth attempt finishes; its final weights equal the uninterrupted loop's (run in this
process, same 2 replicas) bitwise.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import checkpoint_job as job
from helpers import heal_loop_job

pytestmark = [pytest.mark.slow]  # four start-ups of one TensorFlow process

JOB = os.path.join(os.path.dirname(__file__), "helpers", "heal_loop_job.py")
SAVE_EVERY = 3
_STEP = re.compile(r"pid (\d+) attempt (\d) step (\d+)")
_RESUMED = re.compile(r"attempt (\d) resumed at step (\d+)")


@pytest.fixture(scope="module")
def healed(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("heal_loop")
    (base / "out").mkdir()
    cmd = [sys.executable, "-m", "zero_runtime.cli", "launch", "--nproc", "1"]
    cmd += ["--max-restarts", "3", "--preemption-grace", "2"]
    cmd += ["--checkpoint-dir", str(base / "ckpt"), JOB, str(base / "out")]
    cmd += ["--save-every", str(SAVE_EVERY), "--slow-attempt", "2"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines, resumed, sent = [], {}, {}
    try:
        for line in proc.stdout:
            lines.append(line)
            if found := _RESUMED.search(line):
                resumed[int(found.group(1))] = int(found.group(2))
            found = _STEP.search(line)
            if not found:
                continue
            pid, attempt, step = (int(g) for g in found.groups())
            if attempt in sent or attempt > 2 or step < resumed.get(attempt, 0) + 2:
                continue
            os.kill(pid, signal.SIGTERM)
            if attempt == 1:  # the second signal, once the first one's handler ran
                time.sleep(0.05)
                os.kill(pid, signal.SIGTERM)
            sent[attempt] = step
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with open(base / "ckpt" / "restarts.jsonl") as f:
        events = [json.loads(line) for line in f]
    return dict(
        base=base,
        log="".join(lines),
        status=proc.returncode,
        resumed=resumed,
        sent=sent,
        events=events,
    )


def test_the_loop_finishes_with_the_uninterrupted_weights(healed):
    assert healed["status"] == 0, healed["log"][-4000:]
    strategy = job.strategy_for(2, "cpu")
    model = job.build(strategy)
    heal_loop_job.train(strategy, model, 0)
    got = np.load(healed["base"] / "out" / "final.npz")
    for i, want in enumerate(model.get_weights()):
        np.testing.assert_array_equal(got[f"arr_{i}"], want)
    job.close(strategy, model)


def test_each_way_a_preemption_ends(healed):
    sent, resumed = healed["sent"], healed["resumed"]
    assert sorted(sent) == [0, 1, 2], healed["log"][-4000:]
    restarts = [e for e in healed["events"] if e["event"] == "restart"]
    assert [(e["exit_status"], e["signal"]) for e in restarts] == [
        (42, None),
        (143, "SIGTERM"),
        (142, "SIGALRM"),
    ]
    assert restarts[2]["cause"] == (
        "killed by SIGALRM (its preemption grace period ran out before it saved)"
    )
    # one signal: saved at the step it arrived after, nothing lost
    assert resumed[1] == sent[0]
    assert f"preempted: saved {healed['base'] / 'ckpt'}" in healed["log"]
    # at once / out of time, before step n's after_step: back to the last periodic save
    assert resumed[2] == (sent[1] - 1) // SAVE_EVERY * SAVE_EVERY
    assert resumed[3] == (sent[2] - 1) // SAVE_EVERY * SAVE_EVERY
    assert healed["events"][-1] == {**healed["events"][-1], "status": 0, "restarts": 3}


def test_a_latest_of_another_model_is_one_line_and_not_restarted(tmp_path):
    """The worker's restore refuses it before any variable or file changes; the launcher
    says so on one line and does not restart (a restart would fail the same way)."""
    import keras

    from zero_runtime.checkpoint import CheckpointManager

    strategy = job.strategy_for(2, "cpu")
    with strategy.scope():
        other = keras.Sequential([keras.Input((job.FEATURES,)), keras.layers.Dense(job.CLASSES)])
        other.compile(optimizer="adam", loss="mse")
    x, y = job.data()
    other.train_on_batch(x[:8], y[:8])
    root = tmp_path / "ckpt"
    CheckpointManager(str(root), other, strategy).save()
    strategy.close()
    before = {p: os.stat(root / p).st_mtime_ns for p in os.listdir(root)}
    (tmp_path / "out").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "zero_runtime.cli", "launch", "--nproc", "1"]
        + ["--max-restarts", "3", "--checkpoint-dir", str(root), JOB, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[launcher]")]
    assert lines[-1].startswith(
        "[launcher] rank 0: exited with status 1: CheckpointMismatchError: "
    )
    assert lines[-1].endswith("; not restarted: a restart would fail the same way")
    assert "restart 1/3" not in proc.stdout
    assert {p: os.stat(root / p).st_mtime_ns for p in os.listdir(root)} == before
