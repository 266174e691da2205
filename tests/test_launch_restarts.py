"""``zero-runtime launch --max-restarts``: the restart loop, its events file, what is not
restarted, the checkpoint directory's lock, and no orphan process or held port.

Workers here are small Python programs without TensorFlow (fast); the real training jobs
that restart, resume and survive preemption are in tests/test_heal_multiworker.py and
tests/test_heal_loop.py.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_launch import _alive

from zero_runtime import launch
from zero_runtime.launch import restarts

# A worker driven by its arguments: MODE and a directory for its marks. The attempt is
# ZERO_RUNTIME_RESTART_COUNT; rank 0 writes "<dir>/attempt<N>" with its env.
WORKER = r"""
import json, os, signal, socket, subprocess, sys, time
mode, marks = sys.argv[1], sys.argv[2]
rank = int(os.environ["ZERO_RUNTIME_RANK"])
attempt = int(os.environ["ZERO_RUNTIME_RESTART_COUNT"])
port = int(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][rank].rsplit(":", 1)[1])
if rank == 0:
    keys = ("ZERO_RUNTIME_CHECKPOINT_DIR", "ZERO_RUNTIME_PREEMPTION_GRACE_SECONDS",
            "ZERO_RUNTIME_WORLD_SIZE", "ZERO_RUNTIME_MAX_WORLD_SIZE")
    with open(os.path.join(marks, f"attempt{attempt}"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
print("rank", rank, "pid", os.getpid(), "attempt", attempt, flush=True)
if mode == "crash_once" and attempt == 0:
    # listen on the cluster port and leave a child holding it, then die by SIGKILL
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port)); s.listen()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             pass_fds=[s.fileno()])
    with open(os.path.join(marks, f"child{rank}"), "w") as f:
        f.write(str(child.pid))
    time.sleep(0.3)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
if mode == "always_fail":
    time.sleep(0.1)
    sys.exit(3 if rank == 1 else 0)
if mode == "mismatch" and rank == 0:
    print("Traceback (most recent call last):", flush=True)
    print("zero_runtime.checkpoint.errors.CheckpointMismatchError: variable 'dense/kernel' "
          "(parameter #0): model shape (6, 16) != checkpoint shape (6, 12)", flush=True)
    sys.exit(1)
if mode == "usage" and rank == 0:
    print("train.py: error: unrecognized arguments: --bogus", flush=True)
    sys.exit(2)
if mode == "preempted" and attempt == 0:
    time.sleep(0.2 + 0.8 * rank)  # rank 1 still saving when rank 0 exits 42
    sys.exit(42)
if mode == "elastic":  # shrink 2 -> 1 (rank 1 killed twice), grow 1 -> 2 (SIGUSR1)
    from zero_runtime import progress
    world = int(os.environ["ZERO_RUNTIME_WORLD_SIZE"])
    saved_file = os.path.join(marks, "saved")
    start = int(open(saved_file).read()) if os.path.exists(saved_file) else 0
    step = start
    def save(suffix):  # atomic, as a real checkpoint is: a kill mid-write leaves the last
        with open(saved_file + suffix, "w") as f:
            f.write(str(step))
        os.replace(saved_file + suffix, saved_file)
    def preempted(signum, frame):  # a preemption: save the step, exit 42
        save(".sigterm.tmp")
        sys.exit(42)
    signal.signal(signal.SIGTERM, preempted)
    progress.report(start, resumed=True, rank=rank)
    while True:
        time.sleep(0.1)
        step += 1
        progress.report(step, rank=rank)
        if rank == 0 and step % 2 == 0:
            save(".tmp")
        if attempt < 2 and rank == 1 and step == start + 3:
            os.kill(os.getpid(), signal.SIGKILL)
        if world == 1 and step == start + 2:
            os.kill(os.getppid(), signal.SIGUSR1)  # the launcher: grow back
        if attempt == 3 and step == start + 2:
            break
if mode == "preemptible":  # saves and exits 42 on SIGTERM
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))
    print("waiting pid", os.getpid(), flush=True)
    time.sleep(60)
if mode == "deaf":  # ignores SIGTERM (TensorFlow's notifier takes it before our handler)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("waiting pid", os.getpid(), flush=True)
    time.sleep(60)
print("rank", rank, "done", flush=True)
"""


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    marks = tmp_path / "marks"
    marks.mkdir()
    return str(path), marks


def _run(script, mode, marks, ckpt, max_restarts, **kwargs) -> tuple[int, str]:
    """``launch`` 2 workers of WORKER in ``mode``; returns (status, output)."""
    out = io.StringIO()
    status = launch.launch(
        2,
        [sys.executable, script, mode, str(marks)],
        out=out,
        max_restarts=max_restarts,
        checkpoint_dir=str(ckpt),
        **kwargs,
    )
    return status, out.getvalue()


def _events(ckpt) -> list[dict]:
    with open(os.path.join(ckpt, launch.EVENTS_FILE)) as f:
        return [json.loads(line) for line in f]


def _bindable(port: int) -> bool:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
    try:
        s.bind(("127.0.0.1", port))
        s.listen()
        return True
    except OSError:
        return False
    finally:
        s.close()


def test_a_killed_worker_restarts_the_group_and_leaves_no_orphan_or_held_port(worker, tmp_path):
    script, marks = worker
    ckpt = tmp_path / "ckpt"
    status, log = _run(script, "crash_once", marks, ckpt, 2, preemption_grace_seconds=7)
    assert status == 0, log
    children = [int((marks / f"child{r}").read_text()) for r in (0, 1)]
    assert [c for c in children if _alive(c)] == [], log  # the dead worker's child too
    events = _events(ckpt)
    assert [e["event"] for e in events] == ["start", "restart", "start", "exit"]
    restart = events[1]
    assert restart["rank"] == 1 and restart["reported_by"] == 1
    assert (restart["signal"], restart["exit_status"]) == ("SIGKILL", 128 + 9)
    assert restart["cause"] == "killed by SIGKILL (kill -9, or the kernel's out-of-memory killer)"
    assert (restart["restart"], restart["max_restarts"]) == (1, 2)
    assert events[2]["attempt"] == 1 and events[-1]["status"] == 0
    assert all(_bindable(p) for p in events[0]["ports"])  # attempt 0's ports are free
    assert (
        "[launcher] restart 1/2 after rank 1: killed by SIGKILL (kill -9, or the kernel's "
        "out-of-memory killer)" in log
    )
    env = json.loads((marks / "attempt1").read_text())
    assert env == {
        "ZERO_RUNTIME_CHECKPOINT_DIR": str(ckpt),
        "ZERO_RUNTIME_PREEMPTION_GRACE_SECONDS": "7",
        "ZERO_RUNTIME_WORLD_SIZE": "2",
        "ZERO_RUNTIME_MAX_WORLD_SIZE": "2",
    }


def test_restarts_stop_after_max_restarts_with_the_last_status(worker, tmp_path):
    script, marks = worker
    status, log = _run(script, "always_fail", marks, tmp_path / "ckpt", 2)
    assert status == 3
    events = _events(tmp_path / "ckpt")
    assert [e["event"] for e in events] == ["start", "restart", "start", "restart", "start", "exit"]
    assert events[1]["cause"].startswith("exited with status 3: rank 1 pid ")  # its last line
    assert events[1]["rank"] == 1
    assert "not restarted: no restart left (--max-restarts 2)" in log
    assert sorted(p.name for p in marks.iterdir()) == ["attempt0", "attempt1", "attempt2"]


@pytest.mark.parametrize(
    ("mode", "status", "why"),
    [
        ("mismatch", 1, "CheckpointMismatchError: variable 'dense/kernel'"),
        ("usage", 2, "exited with status 2: train.py: error: unrecognized arguments"),
    ],
)
def test_a_failure_a_restart_cannot_fix_is_not_restarted_and_writes_nothing(
    worker, tmp_path, mode, status, why
):
    script, marks = worker
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("step00000004\n")
    before = sorted(os.listdir(ckpt))
    got, log = _run(script, mode, marks, ckpt, 3)
    assert got == status
    assert sorted(os.listdir(ckpt)) == before  # no events file: nothing changed
    line = [ln for ln in log.splitlines() if ln.startswith("[launcher] rank 0:")]
    assert len(line) == 1 and why in line[0], log
    assert line[0].endswith("not restarted: a restart would fail the same way")
    assert sorted(p.name for p in marks.iterdir()) == ["attempt0"]


def test_a_preempted_worker_lets_its_peers_finish_saving_then_the_group_restarts(worker, tmp_path):
    script, marks = worker
    t0 = time.monotonic()
    status, log = _run(script, "preempted", marks, tmp_path / "ckpt", 1)
    assert status == 0, log
    restart = _events(tmp_path / "ckpt")[1]
    assert restart["exit_status"] == 42 and restart["rank"] == 0
    assert restart["cause"] == "preempted: saved a checkpoint and exited 42"
    # rank 1 exited on its own (42 at 1.0 s), it was not stopped at 0.2 s
    assert "[launcher] rank 0 exited with status 42 (preempted: saved a checkpoint)" in log
    assert time.monotonic() - t0 < 30


def test_describe_names_the_stalled_peer_a_survivor_reported():
    tail = [
        "zero_runtime: worker rank 1 (127.0.0.1:5) did not join a collective within 10 s "
        "(stalled, or ran out of data); worker rank 0 stops (DeadlineExceededError)",
        "tensorflow.python.framework.errors_impl.DeadlineExceededError: collective timed out",
    ]
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    w = launch.group.Worker(0, proc, returncode=1, blames=(1, tail[0][14:].split(";")[0]))
    w.tail.extend(tail)
    failure = restarts.describe(launch.group.GroupOutcome(1, w, (1,), (proc.pid, 4242), (5, 6)))
    assert (failure.rank, failure.reported_by, failure.pid) == (1, 0, 4242)
    assert failure.restartable
    assert failure.line() == (
        "rank 1 (reported by rank 0): worker rank 1 (127.0.0.1:5) did not join a collective "
        "within 10 s (stalled, or ran out of data) (it was still running)"
    )


def _cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zero_runtime.cli", "launch", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_input_is_one_line_before_any_worker_starts(worker, tmp_path):
    script, marks = worker
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("step00000004\n")
    before = sorted(os.listdir(ckpt))
    cases = [
        (
            ["--max-restarts", "-1"],
            "argument --max-restarts: invalid value -1: expected an int >= 0",
        ),
        (["--max-restarts", "2"], "--max-restarts needs --checkpoint-dir DIR"),
        (["--preemption-grace", "0"], "expected a number > 0"),
        (["--checkpoint-dir", str(ckpt / "latest")], "is not a directory"),
        (["--min-nproc", "3"], "--min-nproc 3 must be between 1 and --nproc 2 (it is above"),
        (["--min-nproc", "1"], "--min-nproc 1 below --nproc 2 needs --max-restarts >= 1"),
        (
            ["--nproc", "3", "--min-nproc", "2", "--max-restarts", "1", "--checkpoint-dir", "x"],
            "--min-nproc 2: no world size from 2 to 2 divides --nproc 3",
        ),
        (["--shrink-after", "0"], "argument --shrink-after: invalid value 0"),
        (["--logdir", str(ckpt / "latest")], "--logdir"),
    ]
    for args, message in cases:
        proc = _cli("--nproc", "2", *args, script, "ok", str(marks))
        assert proc.returncode == 2, (args, proc.stderr)
        errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
        assert len(errors) == 1 and message in errors[0], (args, proc.stderr)
    # a directory another job holds: refused, naming the holder
    holder = launch.dir_lock.DirectoryLock(str(ckpt)).acquire()
    try:
        proc = _cli("--nproc", "2", "--checkpoint-dir", str(ckpt), script, "ok", str(marks))
    finally:
        holder.release()
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, proc.stderr
    assert (
        f"checkpoint directory '{ckpt}' is in use by another job (pid {os.getpid()}:" in errors[0]
    )
    assert errors[0].endswith("(nothing was changed)")
    assert list(marks.iterdir()) == []  # no worker started
    assert sorted(os.listdir(ckpt)) == before


def test_the_lock_is_released_when_its_holder_is_killed(tmp_path):
    ckpt = tmp_path / "ckpt"
    code = (
        "import sys, time; from zero_runtime.launch.dir_lock import DirectoryLock; "
        f"DirectoryLock({str(ckpt)!r}).acquire(); print('locked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(launch.DirectoryLockedError, match="in use by another job"):
            launch.dir_lock.DirectoryLock(str(ckpt)).acquire()
    finally:
        proc.kill()
        proc.wait()
    launch.dir_lock.DirectoryLock(str(ckpt)).acquire().release()  # no stale lock
    assert os.listdir(ckpt) == []


def test_a_rank_that_keeps_failing_shrinks_the_job_and_sigusr1_grows_it_back(worker, tmp_path):
    """Rank 1 killed in two groups in a row (--shrink-after 2) -> the next group runs 1
    worker (--min-nproc 1); SIGUSR1 to the launcher preempts it (it saves, exits 42) and
    the next group runs 2 again, not counted as a restart. The events say why, and the
    steps and seconds each change lost, from rank 0's progress reports."""
    script, marks = worker
    ckpt, logdir = tmp_path / "ckpt", tmp_path / "logs"
    status, log = _run(
        script, "elastic", marks, ckpt, 3, min_nproc=1, shrink_after=2, logdir=str(logdir)
    )
    assert status == 0, log
    events = _events(ckpt)
    kinds = [e["event"] for e in events if e["event"] != "resume"]
    assert kinds == [
        "start",
        "restart",
        "start",
        "restart",
        "resize",
        "start",
        "resize",
        "start",
        "exit",
    ], log
    starts = [e for e in events if e["event"] == "start"]
    assert [(e["attempt"], e["nproc"]) for e in starts] == [(0, 2), (1, 2), (2, 1), (3, 2)]
    shrink, grow = [e for e in events if e["event"] == "resize"]
    assert (shrink["from_nproc"], shrink["to_nproc"]) == (2, 1)
    assert shrink["reason"] == "rank 1 failed 2 time(s) in a row (--shrink-after 2, --min-nproc 1)"
    assert (grow["from_nproc"], grow["to_nproc"], grow["reason"]) == (2 - 1, 2, "asked (SIGUSR1)")
    assert events[-1]["restarts"] == 2  # the grow is not a restart
    assert "[launcher] resize 2 -> 1 workers: rank 1 failed 2 time(s) in a row" in log
    assert "[launcher] SIGUSR1 (grow): preempting 1 worker(s)" in log
    world = [json.loads((marks / f"attempt{a}").read_text()) for a in range(4)]
    assert [w["ZERO_RUNTIME_WORLD_SIZE"] for w in world] == ["2", "2", "1", "2"]
    assert {w["ZERO_RUNTIME_MAX_WORLD_SIZE"] for w in world} == {"2"}
    # each group resumed where the last save (or the grow's preemption save) left it
    resumes = [e for e in events if e["event"] == "resume"]
    assert [e["attempt"] for e in resumes] == [0, 1, 2, 3]
    assert resumes[0]["cause"] is None and resumes[0]["steps_lost"] is None
    assert [e["kind"] for e in resumes] == [None, "restart", "resize", "resize"]
    assert resumes[1]["cause"].startswith("restart 1/3 after rank 1: killed by SIGKILL")
    assert "resize 2 -> 1 workers" in resumes[2]["cause"]
    assert resumes[3]["cause"] == "resize 1 -> 2 workers: asked (SIGUSR1)"
    assert resumes[3]["steps_lost"] == 0  # the grow saved where it stopped
    for e in resumes[1:3]:
        assert 0 <= e["steps_lost"] <= 2 and 0 < e["seconds_lost"] < 30, e
        assert 0 < e["restart_seconds"] < 30, e
    goodput = events[-1]["goodput"]
    assert goodput["useful_steps"] == resumes[-1]["step"] + 2
    assert goodput["all_steps"] >= goodput["useful_steps"]
    assert 0 < goodput["time_ratio"] < 1 and 0 < goodput["steps_ratio"] <= 1
    # the tab's copy in the log directory: the same lines
    assert (logdir / "memory_hierarchy_restarts.jsonl").read_text() == (
        ckpt / "restarts.jsonl"
    ).read_text()


def test_sigterm_to_the_launcher_preempts_the_workers_and_ends_the_job(worker, tmp_path):
    """SIGTERM to the launcher is forwarded as a preemption: each worker saves (here:
    exits 42 at once) and the launcher exits 42 without a restart; a second SIGTERM
    stops workers that did not react (status 143)."""
    script, marks = worker
    for mode, want in (("preemptible", 42), ("deaf", 143)):
        ckpt = tmp_path / f"ckpt_{mode}"
        launcher = subprocess.Popen(
            [sys.executable, "-m", "zero_runtime.cli", "launch", "--nproc", "2"]
            + ["--max-restarts", "3", "--checkpoint-dir", str(ckpt), "--preemption-grace", "20"]
            + [script, mode, str(marks)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        lines, waiting = [], 0
        try:
            for line in launcher.stdout:
                lines.append(line)
                waiting += "waiting pid" in line
                if waiting == 2:
                    break
            pids = [int(ln.split()[-1]) for ln in lines if "waiting pid" in ln]
            launcher.send_signal(signal.SIGTERM)
            if mode == "deaf":
                time.sleep(1.0)
                launcher.send_signal(signal.SIGTERM)  # the second one stops them at once
            rest, _ = launcher.communicate(timeout=30)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        log = "".join(lines) + rest
        assert launcher.returncode == want, log
        assert "[launcher] SIGTERM: preempting 2 worker(s)" in log
        assert [p for p in pids if _alive(p)] == []
        assert "restart 1/3" not in log
        if mode == "preemptible":
            assert (
                "[launcher] received SIGTERM: every worker saved and exited 42; not restarted"
                in log
            )
        else:
            assert "[launcher] received SIGTERM; stopping 2 running worker(s)" in log
