"""The local multi-worker launcher: TF_CONFIG per rank, prefixed output, fail-fast."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from zero_runtime import launch

WORKER = """
import json, os, sys, time
cfg = json.loads(os.environ["TF_CONFIG"])
rank = cfg["task"]["index"]
world = os.environ["ZERO_RUNTIME_WORLD_SIZE"]
print("cluster", json.dumps(cfg["cluster"]), "rank", rank, "world", world)
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
if mode == "fail" and rank == 1:
    time.sleep(0.2)
    sys.exit(3)
if mode == "fail":
    time.sleep(60)  # would hang the job without fail-fast
if mode == "stall" and rank == 0:  # the line multiworker's failure hook prints, then exit
    time.sleep(0.2)
    print("zero_runtime: worker rank 1 (127.0.0.1:23461) did not join a collective within "
          "10 s (stalled, or ran out of data); worker rank 0 stops (DeadlineExceededError)",
          file=sys.stderr, flush=True)
    sys.exit(1)
if mode == "stall":
    time.sleep(60)  # the stalled peer: still running when rank 0 gives up
if mode == "sleep":  # a worker that only stops when it is stopped
    print("sleeping pid", os.getpid(), flush=True)
    time.sleep(120)
print("done", rank)
"""


@pytest.fixture
def worker_script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


def test_tf_config_names_the_cluster_and_the_rank():
    cfg = json.loads(launch.tf_config([7001, 7002], 1))
    assert cfg == {
        "cluster": {"worker": ["127.0.0.1:7001", "127.0.0.1:7002"]},
        "task": {"type": "worker", "index": 1},
    }
    with pytest.raises(ValueError, match="rank 2 out of range for 2 workers"):
        launch.tf_config([7001, 7002], 2)


def test_every_worker_runs_with_its_rank_and_output_is_prefixed(worker_script):
    out = io.StringIO()
    status = launch.launch(3, [sys.executable, worker_script], port_base=23456, out=out)
    assert status == 0
    lines = out.getvalue().splitlines()
    for rank in range(3):
        assert f"[rank {rank}] done {rank}" in lines
        started = [ln for ln in lines if ln.startswith(f"[rank {rank}] cluster")]
        assert len(started) == 1 and started[0].endswith(f"rank {rank} world 3")
        assert '"127.0.0.1:23456", "127.0.0.1:23457", "127.0.0.1:23458"' in started[0]


def test_one_failing_worker_stops_the_others_with_its_status(worker_script):
    out = io.StringIO()
    start = time.monotonic()
    status = launch.launch(2, [sys.executable, worker_script, "fail"], out=out)
    elapsed = time.monotonic() - start
    assert status == 3
    assert elapsed < 30  # rank 0 would sleep 60 s: it was stopped
    assert "[launcher] rank 1 exited with status 3; stopping the other workers" in out.getvalue()
    assert "[rank 0] done 0" not in out.getvalue()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["launch", "--nproc", "0", "x.py"], "expected an int >= 1"),
        (["launch", "--nproc", "2", "missing_script.py"], "script 'missing_script.py' not found"),
        (["launch", "--nproc", "2", "--port-base", "65535", "/bin/true"], "leaves no room"),
    ],
)
def test_cli_rejects_bad_arguments_with_exit_2(argv, message):
    proc = subprocess.run(
        [sys.executable, "-m", "zero_runtime.cli", *argv], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert message in proc.stderr


def test_cli_launch_end_to_end(worker_script):
    proc = subprocess.run(
        [sys.executable, "-m", "zero_runtime.cli", "launch", "--nproc", "2", worker_script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 0] done 0" in proc.stdout and "[rank 1] done 1" in proc.stdout


def test_a_stall_is_blamed_on_the_stalled_rank_not_on_the_survivor(worker_script):
    """The worker that timed out exits first; the launcher names the rank it reported
    (still running) and stops it within the grace period, not the collective timeout."""
    out = io.StringIO()
    t0 = time.monotonic()
    status = launch.launch(2, [sys.executable, worker_script, "stall"], out=out)
    elapsed = time.monotonic() - t0
    assert status == 1
    assert (
        "[launcher] rank 0 exited with status 1 because worker rank 1 (127.0.0.1:23461) did "
        "not join a collective within 10 s (stalled, or ran out of data) (it is still "
        "running); stopping the other workers"
    ) in out.getvalue()
    assert elapsed < launch.TERMINATE_GRACE_SECONDS + 10  # SIGTERM+SIGINT stop the sleeper


CLUSTER_JOB = os.path.join(os.path.dirname(__file__), "helpers", "cluster_job.py")


def _start_launcher(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "zero_runtime.cli", "launch", "--nproc", "2", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a stray signal to the test's group never reaches it
    )


def _worker_pids(launcher: subprocess.Popen, marker: str, lines: list[str]) -> list[int]:
    """Read the launcher's output until both workers printed ``marker ... pid P``."""
    pids: dict[int, int] = {}
    deadline = time.monotonic() + 180
    while len(pids) < 2 and time.monotonic() < deadline:
        line = launcher.stdout.readline()
        if not line:
            break
        lines.append(line)
        words = line.split()
        if marker in line and "pid" in words:
            pids[int(words[1].rstrip("]"))] = int(words[words.index("pid") + 1])
    assert len(pids) == 2, "".join(lines)[-3000:]
    return list(pids.values())


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_sigterm_to_the_launcher_stops_training_workers():
    """``kill <launcher>`` does not leave the workers training, reparented to init: the
    launcher forwards the signal as a preemption (SIGTERM to each worker); workers that do
    not save on it (no ``ZeroBackupAndRestore``: TensorFlow's notifier takes SIGTERM) are
    stopped when the preemption grace period runs out (SIGTERM + SIGINT to each worker's
    group, SIGKILL after 3 s); its status is 128 + 15."""
    grace = 2.0
    launcher = _start_launcher(["--preemption-grace", str(grace), CLUSTER_JOB, "--steps", "100000"])
    lines: list[str] = []
    try:
        pids = _worker_pids(launcher, "training", lines)
        time.sleep(1.0)  # in fit
        assert all(_alive(p) for p in pids)
        launcher.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        rest, _ = launcher.communicate(timeout=grace + launch.TERMINATE_GRACE_SECONDS + 20)
        stopped_after = time.monotonic() - sent
        survivors = _wait_gone(pids, 2.0)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in pids if "pids" in locals() else []:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    output = "".join(lines) + rest
    assert survivors == [], output[-3000:]
    assert launcher.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "[launcher] SIGTERM: preempting 2 worker(s)" in output
    assert "[launcher] the grace period ran out; stopping the workers" in output
    assert grace < stopped_after < grace + 2 * launch.TERMINATE_GRACE_SECONDS + 10, stopped_after
    print(f"SIGTERM: launcher and both workers gone {stopped_after:.1f} s after the signal")


def test_workers_die_with_a_killed_launcher(worker_script):
    """A launcher killed outright (SIGKILL: nothing of it runs) takes its workers with it:
    they were started with PR_SET_PDEATHSIG = SIGKILL."""
    launcher = _start_launcher([worker_script, "sleep"])
    lines: list[str] = []
    pids: list[int] = []
    try:
        pids = _worker_pids(launcher, "sleeping", lines)
        launcher.kill()
        launcher.wait(timeout=10)
        survivors = _wait_gone(pids, 5.0)
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    assert survivors == [], "".join(lines)
