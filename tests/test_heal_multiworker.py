"""A 2-worker job that heals itself: kill -9 of a worker at a random step, then SIGTERM to
a worker at a random later step, under ``zero-runtime launch --max-restarts``.

Stage 3, parameters and optimizer states on NVMe, 2 workers x 1 CPU replica, ``fit`` with
``ZeroBackupAndRestore(save_freq=2)`` (tests/helpers/heal_job.py). The job finishes by
itself: the kill restarts the group, which resumes at the last backup with the batches
that followed it; the SIGTERM makes both workers save at one agreed step and exit 42, and
the next group resumes there. Its final weights equal an uninterrupted run's bitwise (the
same job without faults, launched at the same time). No worker process survives, the
NVMe directory ends empty, and the restart events name each cause.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_launch import _alive

pytestmark = [pytest.mark.slow]  # ~75 s: three 2-worker start-ups and a reference run

JOB = os.path.join(os.path.dirname(__file__), "helpers", "heal_job.py")
SEED = int(os.environ.get("ZERO_RUNTIME_HEAL_SEED", "42"))
SAVE_EVERY = 2
TOTAL_STEPS = 18  # 3 epochs of 6 batches (heal_job's defaults)
_STEP = re.compile(r"rank (\d) pid (\d+) attempt (\d) step (\d+)")


def _launch(base, name: str, *extra: str, job_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """``zero-runtime launch --nproc 2 EXTRA`` of heal_job.py (``JOB_ARGS`` appended) with
    ``<name>_ckpt``, ``<name>_out`` and ``<name>_nvme`` under ``base``."""
    for d in (f"{name}_out", f"{name}_nvme"):
        os.makedirs(base / d)
    return subprocess.Popen(
        [sys.executable, "-m", "zero_runtime.cli", "launch", "--nproc", "2", *extra]
        + ["--checkpoint-dir", str(base / f"{name}_ckpt"), JOB]
        + [str(base / f"{name}_out"), str(base / f"{name}_nvme"), "--save-every", "2"]
        + list(job_args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def side_by_side(base, job, reference, on_line, name: str, **seen: dict) -> dict:
    """Feed each output line of the launched ``job`` to ``on_line(line)`` until it ends,
    then wait for the ``reference`` launch (both are killed if anything fails). Returns
    ``base``, the job's ``lines`` and ``log``, the reference's ``ref_log``, both exit
    statuses and ``seen`` (what ``on_line`` filled: ``sent``, ``resumed``, ``pids``); prints
    them and the seconds taken, as ``name``."""
    start = time.monotonic()
    lines: list[str] = []
    try:
        for line in job.stdout:
            lines.append(line)
            on_line(line)
        job.wait(timeout=60)
        ref_log, _ = reference.communicate(timeout=240)
    finally:
        for proc in (job, reference):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    seconds = time.monotonic() - start
    print(f"{name} (seed {SEED}): {seen['sent']}, resumed {seen['resumed']}, {seconds:.1f} s")
    return dict(
        seen,
        base=base,
        lines=lines,
        log="".join(lines),
        ref_log=ref_log,
        status=job.returncode,
        ref_status=reference.returncode,
    )


@pytest.fixture(scope="module")
def healed(tmp_path_factory) -> dict:
    """The reference and the faulted job, run side by side; what the test observed."""
    base = tmp_path_factory.mktemp("heal")
    rng = random.Random(SEED)
    kill_rank, kill_at = rng.randrange(2), rng.randint(3, 9)
    term_rank, term_after = rng.randrange(2), rng.randint(2, 5)  # steps after the resume
    reference = _launch(base, "ref")
    faulted = _launch(base, "job", "--max-restarts", "3", "--preemption-grace", "20")
    pids: dict[tuple[int, int], int] = {}
    sent: dict[str, tuple[int, int, int]] = {}  # signal -> (rank, pid, step seen)
    resumed: dict[int, int] = {}

    def on_line(line: str) -> None:
        found = _STEP.search(line)
        if "resumed at step" in line:
            resumed.setdefault(len(sent), int(line.split()[-1]))
        if not found:
            return
        rank, pid, attempt, step = (int(g) for g in found.groups())
        pids[(attempt, rank)] = pid
        if attempt == 0 and step >= kill_at and "kill" not in sent:
            target = pids.get((0, kill_rank))
            if target:
                os.kill(target, signal.SIGKILL)
                sent["kill"] = (kill_rank, target, step)
        if attempt == 1 and "term" not in sent and step >= resumed.get(1, 99) + term_after:
            target = pids.get((1, term_rank))
            if target:
                os.kill(target, signal.SIGTERM)
                sent["term"] = (term_rank, target, step)

    return side_by_side(
        base, faulted, reference, on_line, "heal test", sent=sent, resumed=resumed, pids=pids
    )


def test_the_job_finishes_by_itself_with_the_uninterrupted_weights(healed):
    assert_finished_like_the_reference(healed, {"kill", "term"})


def assert_finished_like_the_reference(seen: dict, signals: set[str]) -> None:
    """Both launches exited 0 after the job got ``signals``, and the job's final weights
    (``base/job_out/final.npz``) equal the reference's bitwise."""
    log = seen["log"]
    assert seen["ref_status"] == 0, seen["ref_log"][-3000:]
    assert seen["status"] == 0, log[-4000:]
    assert set(seen["sent"]) == signals, log[-4000:]
    base = seen["base"]
    want = np.load(base / "ref_out" / "final.npz")
    got = np.load(base / "job_out" / "final.npz")
    assert len(got.files) == len(want.files) == 6
    for name in want.files:
        np.testing.assert_array_equal(got[name], want[name])


def test_each_restart_resumes_at_the_last_save_or_the_agreed_step(healed):
    log, sent, resumed = healed["log"], healed["sent"], healed["resumed"]
    # the kill: the group resumes at the last backup before it (lost <= save_every steps,
    # + the step in flight when the signal landed, + a save the kill cut short)
    killed_step = sent["kill"][2]
    assert resumed[1] % SAVE_EVERY == 0 and 0 <= killed_step - resumed[1] <= 2 * SAVE_EVERY + 1
    # the SIGTERM: both workers saved at one agreed step, exited 42, and the next group
    # resumed exactly there (no step lost)
    saved = re.findall(r"rank (\d) preempted: saved \S+ at step (\d+); exiting 42", log)
    assert sorted(int(r) for r, _ in saved) == [0, 1], log[-4000:]
    agreed = {int(s) for _, s in saved}
    assert len(agreed) == 1 and resumed[2] == agreed.pop()
    assert sent["term"][2] <= resumed[2] <= sent["term"][2] + 2
    assert f"rank {sent['term'][0]} received SIGTERM" in log
    assert "[launcher] restart 2/3 after rank " in log


def test_the_events_name_each_cause(healed):
    with open(healed["base"] / "job_ckpt" / "restarts.jsonl") as f:
        events = [json.loads(line) for line in f]
    resumes = [e for e in events if e["event"] == "resume"]
    events = [e for e in events if e["event"] != "resume"]
    assert [e["event"] for e in events] == ["start", "restart", "start", "restart", "start", "exit"]
    kill, term = events[1], events[3]
    # each group's resume step, the steps the kill cost, none for the preemption
    assert [e["step"] for e in resumes] == [0, healed["resumed"][1], healed["resumed"][2]]
    assert resumes[1]["steps_lost"] == kill["last_step"] - resumes[1]["step"] >= 0
    assert resumes[2]["steps_lost"] == 0
    assert events[-1]["goodput"]["useful_steps"] == TOTAL_STEPS
    assert (kill["rank"], kill["pid"], kill["signal"]) == (
        healed["sent"]["kill"][0],
        healed["sent"]["kill"][1],
        "SIGKILL",
    )
    assert kill["cause"].startswith("killed by SIGKILL")
    assert term["exit_status"] == 42 and term["cause"].startswith("preempted")
    assert events[-1]["status"] == 0 and events[-1]["restarts"] == 2


def test_nothing_is_left_behind(healed):
    base = healed["base"]
    assert [p for p in healed["pids"].values() if _alive(p)] == []
    assert os.listdir(base / "job_nvme") == [] and os.listdir(base / "ref_nvme") == []
    # the completed fit deleted its backups; the restart events stay
    assert os.listdir(base / "job_ckpt") == ["restarts.jsonl"]
    assert not os.path.exists(base / "ref_ckpt")
