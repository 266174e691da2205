"""Multi-worker ZeroInfinityStrategy: two real worker processes on 127.0.0.1.

Parity: stages 1 and 2 (optimizer states on the host) across 2 workers x 1 replica give
the same per-step losses and final weights as one process with 2 replicas, on the same
global batch and seed. Failure: a worker killed, or stalled, mid-step ends the other
within the collective timeout with an error naming the rank that failed.
Each TF process needs ~5 s to start; every job is shared by one set of assertions.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import mw_job, relaunch

import zero_runtime
from zero_runtime import launch, multiworker

JOB = os.path.join(os.path.dirname(__file__), "helpers", "mw_job.py")
TIMEOUT_S = 10.0  # collective_timeout_seconds of the failure jobs
JOB_DEADLINE_S = 240  # a job that is not done by then has hung
STARTUP_S = 30.0  # cluster_guard.startup_timeout_seconds(TIMEOUT_S)


def _launch_job(out_dir: str, stage: int, logdir: str | None, result: dict) -> None:
    args = [sys.executable, JOB, out_dir, "--stage", str(stage)]
    if logdir:
        args += ["--logdir", logdir]
    text = io.StringIO()
    result["status"] = relaunch.launch_job(2, args, text)
    result["output"] = text.getvalue()


@pytest.fixture(scope="module")
def mw_runs(tmp_path_factory):
    """Stage 1 and stage 2 jobs, 2 workers each, launched at once; {stage: (records, ...)}."""
    root = tmp_path_factory.mktemp("mw")
    results: dict[int, dict] = {1: {}, 2: {}}
    threads = []
    for stage in (1, 2):
        out = root / f"stage{stage}"
        out.mkdir()
        logdir = str(root / "logs") if stage == 2 else None
        t = threading.Thread(target=_launch_job, args=(str(out), stage, logdir, results[stage]))
        t.start()
        threads.append(t)
    for t in threads:
        t.join(JOB_DEADLINE_S)
    runs = {}
    for stage in (1, 2):
        res = results[stage]
        assert res.get("status") == 0, res.get("output", "job did not finish")[-3000:]
        records = [
            json.loads((root / f"stage{stage}" / f"rank{r}.json").read_text()) for r in (0, 1)
        ]
        runs[stage] = records
    runs["logdir"] = str(root / "logs")
    return runs


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """The same training in this process: one strategy over 2 local replicas per stage."""
    out = str(tmp_path_factory.mktemp("ref"))
    runs = {}
    for stage in (1, 2):
        strategy = zero_runtime.ZeroInfinityStrategy(
            {
                "stage": stage,
                "offload_optimizer": "cpu",
                "collective_timeout_seconds": TIMEOUT_S,
                "reduce_bucket_size": 200,
            },
            num_cpu_replicas=2,
        )
        runs[stage] = mw_job.fit_record(strategy, mw_job.STEPS, out)
        strategy.close()
    return runs


@pytest.mark.parametrize("stage", [1, 2])
def test_two_workers_match_one_process_with_two_replicas(stage, mw_runs, reference_runs):
    ref = reference_runs[stage]
    assert ref["strategy"] == "ZeroInfinityStrategy" and ref["local_replicas"] == 2
    for rank, rec in enumerate(mw_runs[stage]):
        assert rec["rank"] == rank
        assert rec["strategy"] == "MultiWorkerZeroInfinityStrategy"
        assert (rec["num_replicas_in_sync"], rec["local_replicas"]) == (2, 1)
        assert rec["optimizer"] == "zero_runtime.optim.partitioned"
        assert len(rec["losses"]) == mw_job.STEPS
        np.testing.assert_allclose(rec["losses"], ref["losses"], rtol=0, atol=1e-6)
        for got, want in zip(rec["weights"], ref["weights"], strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        # one step boundary per optimizer step, counted over this worker's one replica
        assert rec["steps_recorded"] == mw_job.STEPS
    assert ref["losses"][-1] < ref["losses"][0]  # it trained


def test_each_worker_writes_its_own_run_and_the_chief_the_cluster(mw_runs):
    logdir = mw_runs["logdir"]
    assert sorted(os.listdir(logdir)) == ["cluster.json", "worker_0", "worker_1"]
    cluster = json.loads(open(os.path.join(logdir, "cluster.json")).read())
    assert cluster["num_workers"] == 2 and cluster["num_replicas_in_sync"] == 2
    assert cluster["runs"] == ["worker_0", "worker_1"]
    for r in (0, 1):
        files = os.listdir(os.path.join(logdir, f"worker_{r}"))
        assert any(f.startswith("events.out.tfevents") for f in files), files


def _start_pair(out_dir: str, extra: list[str]) -> tuple[list[subprocess.Popen], list[int]]:
    ports = launch.free_ports(2)
    procs = [
        subprocess.Popen(
            [sys.executable, JOB, out_dir, "--timeout", str(TIMEOUT_S), *extra],
            env=dict(os.environ, TF_CONFIG=launch.tf_config(ports, r), PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    return procs, ports


def _survivor_result(procs, ports, out_dir, step: int = 3) -> tuple[str, float, int]:
    """Wait for rank 0; return its output, seconds from rank 1 leaving (at ``step``) to
    rank 0's exit, and its status. Rank 1 is killed afterwards if it still runs (the
    stall case)."""
    try:
        output, _ = procs[0].communicate(timeout=JOB_DEADLINE_S)
        exited = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    left = json.loads(open(os.path.join(out_dir, "left.json")).read())
    assert left["rank"] == 1 and left["step"] == step
    return output, exited - left["time"], procs[0].returncode


@pytest.mark.parametrize("mode", ["killed", "stalled"])
def test_a_failed_worker_ends_the_job_within_the_timeout_naming_its_rank(mode, tmp_path):
    extra = ["--stage", "2", "--steps", "8", "--die-at", "3"]
    if mode == "stalled":
        extra.append("--stall")
    procs, ports = _start_pair(str(tmp_path), extra)
    output, seconds, status = _survivor_result(procs, ports, str(tmp_path))
    assert status == 1, output[-3000:]
    line = f"zero_runtime: worker rank 1 (127.0.0.1:{ports[1]})"
    assert line in output, output[-3000:]
    assert "worker rank 0 stops" in output
    assert not os.path.exists(tmp_path / "rank0.json")  # it did not finish training
    # + 5 s: the survivor's traceback and exit on 2 shared cores
    assert seconds < TIMEOUT_S + 5.0, seconds
    if mode == "stalled":
        assert "did not join a collective within 10 s" in output
        assert seconds > TIMEOUT_S - 1.0  # it waited for the timeout, no longer
    print(f"{mode}: rank 0 stopped {seconds:.1f} s after rank 1 left")


def test_a_worker_stalled_before_the_first_variable_ends_the_job_within_the_timeout(tmp_path):
    """Rank 0 broadcasts every new variable's initial value (MultiWorkerMirroredStrategy,
    no timeout of its own): with rank 1 stalled before its first variable, rank 0 ends
    after the start-up bound (30 s with the 10 s collective timeout) with the watchdog's
    error naming the broadcast (seen in CI: both workers blocked in that broadcast for 20
    minutes)."""
    procs, ports = _start_pair(str(tmp_path), ["--stage", "2", "--die-at", "-2", "--stall"])
    output, seconds, status = _survivor_result(procs, ports, str(tmp_path), step=-2)
    assert status == 1, output[-3000:]
    assert "broadcast of variable" in output, output[-3000:]
    assert "did not complete within 30 s" in output, output[-3000:]
    assert not os.path.exists(tmp_path / "rank0.json")
    # rank 0 reaches the broadcast a few seconds after rank 1 left (building its model)
    assert STARTUP_S - 1.0 < seconds < STARTUP_S + 15.0, seconds


def test_cluster_from_env_reads_tf_config():
    assert multiworker.cluster_from_env({}) is None
    single = {"TF_CONFIG": launch.tf_config([7001], 0)}
    assert multiworker.cluster_from_env(single) is None
    info = multiworker.cluster_from_env({"TF_CONFIG": launch.tf_config([7001, 7002], 1)})
    assert info == multiworker.ClusterInfo(("127.0.0.1:7001", "127.0.0.1:7002"), 1)
    assert not info.is_chief and info.num_workers == 2
    chief = {
        "cluster": {"chief": ["h:1"], "worker": ["h:2", "h:3"]},
        "task": {"type": "worker", "index": 1},
    }
    assert multiworker.cluster_from_env({"TF_CONFIG": json.dumps(chief)}).rank == 2
    with pytest.raises(ValueError, match="not valid JSON"):
        multiworker.cluster_from_env({"TF_CONFIG": "{"})
    bad = {"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 5}}
    with pytest.raises(ValueError, match=r"TF_CONFIG task.index=5 \(int\) is invalid"):
        multiworker.cluster_from_env({"TF_CONFIG": json.dumps(bad)})


_TWO = {"worker": ["h:1", "h:2"]}
# (TF_CONFIG, the fragment its error must hold): '[1,2]' and 'null' are no AttributeError,
# "index": "x" an error naming TF_CONFIG, "index": 1.7 not taken as rank 1.
BAD_TF_CONFIGS = [
    ("[1,2]", "TF_CONFIG=[1, 2] (list) is invalid: expected an object"),
    ("null", "TF_CONFIG=null (NoneType) is invalid: expected an object"),
    ('"worker"', 'TF_CONFIG="worker" (str) is invalid: expected an object'),
    ("{", "TF_CONFIG is not valid JSON"),
    ({"cluster": [1, 2]}, "TF_CONFIG cluster=[1, 2] (list) is invalid: expected an object"),
    ({"cluster": {"worker": "h:1,h:2"}}, 'cluster.worker="h:1,h:2" (str) is invalid'),
    ({"cluster": {"worker": ["h:1", 2]}}, "cluster.worker[1]=2 (int) is invalid"),
    ({"cluster": {"worker": ["h:1", "h2"]}}, 'cluster.worker[1]="h2" (str) is invalid'),
    ({"cluster": {"worker": ["h:1", "h:0"]}}, 'cluster.worker[1]="h:0" (str) is invalid'),
    ({"cluster": {"worker": ["h:1", ":2"]}}, 'cluster.worker[1]=":2" (str) is invalid'),
    ({"cluster": {"chief": ["h:1", "h:2"]}}, 'cluster.chief=["h:1", "h:2"] (list)'),
    ({"cluster": _TWO}, "TF_CONFIG task=null (NoneType) is invalid: expected an object"),
    ({"cluster": _TWO, "task": [0]}, "TF_CONFIG task=[0] (list) is invalid"),
    (
        {"cluster": _TWO, "task": {"index": 0}},
        "task.type=null (NoneType) is invalid: expected 'worker'",
    ),
    ({"cluster": _TWO, "task": {"type": "ps", "index": 0}}, 'task.type="ps" (str) is invalid'),
    ({"cluster": _TWO, "task": {"type": "chief", "index": 0}}, 'task.type="chief" (str)'),
    ({"cluster": _TWO, "task": {"type": "worker"}}, "task.index=null (NoneType) is invalid"),
    ({"cluster": _TWO, "task": {"type": "worker", "index": "x"}}, 'task.index="x" (str)'),
    ({"cluster": _TWO, "task": {"type": "worker", "index": "1"}}, 'task.index="1" (str)'),
    ({"cluster": _TWO, "task": {"type": "worker", "index": 1.7}}, "task.index=1.7 (float)"),
    ({"cluster": _TWO, "task": {"type": "worker", "index": 1.0}}, "task.index=1.0 (float)"),
    ({"cluster": _TWO, "task": {"type": "worker", "index": True}}, "task.index=true (bool)"),
    ({"cluster": _TWO, "task": {"type": "worker", "index": -1}}, "task.index=-1 (int)"),
    ({"cluster": _TWO, "task": {"type": "worker", "index": 2}}, "task.index=2 (int)"),
]


@pytest.mark.parametrize(("tf_config", "fragment"), BAD_TF_CONFIGS)
def test_a_malformed_tf_config_is_named_with_what_is_accepted(tf_config, fragment):
    raw = tf_config if isinstance(tf_config, str) else json.dumps(tf_config)
    with pytest.raises(multiworker.TFConfigError) as info:
        multiworker.cluster_from_env({"TF_CONFIG": raw})
    message = str(info.value)
    assert fragment in message, message
    assert message.startswith("TF_CONFIG")
    assert 'must be a JSON object {"cluster": {"chief": ["host:port"], "worker"' in message
    if "task.index" in fragment:
        assert "expected an int in [0, 1] (cluster.worker has 2)" in message
    assert isinstance(info.value, ValueError)


def test_the_strategy_refuses_a_malformed_tf_config(monkeypatch):
    """The error reaches the user from ``ZeroInfinityStrategy(...)``, before TF starts."""
    monkeypatch.setenv("TF_CONFIG", "null")
    with pytest.raises(multiworker.TFConfigError, match="TF_CONFIG=null"):
        zero_runtime.ZeroInfinityStrategy({"stage": 1})


def test_without_tf_config_the_strategy_is_single_process(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = zero_runtime.ZeroInfinityStrategy({"stage": 1}, num_cpu_replicas=2)
    assert type(strategy) is zero_runtime.ZeroInfinityStrategy
    assert strategy.num_replicas_in_sync == 2
    strategy.close()


def test_describe_failure_names_the_peer():
    import tensorflow as tf

    info = multiworker.ClusterInfo(("127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"), 0)
    gone = tf.errors.UnavailableError(
        None,
        None,
        "Error: tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:2\n",
    )
    assert multiworker.describe_failure(gone, info) == (
        "worker rank 2 (127.0.0.1:7003) stopped sending heartbeats (exited, crashed or "
        "frozen); worker rank 0 stops (UnavailableError)"
    )
    stalled = tf.errors.DeadlineExceededError(None, None, "Collective has timed out")
    assert multiworker.describe_failure(stalled, info, 10.0) == (
        "one of worker ranks [1, 2] did not join a collective within 10 s (stalled, or ran "
        "out of data); worker rank 0 stops (DeadlineExceededError)"
    )
    assert multiworker.describe_failure(ValueError("x"), info) is None


def test_a_worker_pool_holds_only_its_replicas_shards():
    """Stage 3 on worker rank 1 of 2: only replica 1's shard is in the pool; reading the
    value outside a step asks the cross-worker gather for the other rows (here a stand-in
    for ``comm.gather_local_shards``, which tests/test_multiworker_stage3.py runs for real)."""
    from zero_runtime.memory import PagedBufferPool
    from zero_runtime.sharded_variable import ShardedVariable

    value = np.arange(15, dtype=np.float32).reshape(5, 3)  # 5 rows -> 3 per shard, padded
    pool = PagedBufferPool(host_budget_bytes=1 << 20, page_size_bytes=65536)
    with pytest.raises(ValueError, match="gather_remote is required"):
        ShardedVariable(value, pool=pool, num_shards=2, tier="host", name="w", local_replicas=[1])
    asked = []

    def gather(local: dict) -> np.ndarray:  # what every worker would contribute
        asked.append(sorted(local))
        rows = np.zeros((2, 9), np.float32)
        rows[0] = value[:3].reshape(-1)  # replica 0's shard, from the other worker
        rows[1] = local[1]
        return rows

    v = ShardedVariable(
        value,
        pool=pool,
        num_shards=2,
        tier="host",
        name="w",
        local_replicas=[1],
        gather_remote=gather,
    )
    assert [t.rsplit("/", 1)[1] for t in pool.tensor_ids()] == ["r1"]
    np.testing.assert_array_equal(v.read_shard(1), [9, 10, 11, 12, 13, 14, 0, 0, 0])
    np.testing.assert_array_equal(v.numpy(), value)
    assert asked == [[1]]
    v.free()
    assert pool.tensor_ids() == []
    pool.close()


def test_uneven_data_across_workers_is_a_clear_error_not_a_hang(tmp_path):
    """Rank 1 reads 2 batches fewer than rank 0 (its own data, auto-sharding off)."""
    start = time.monotonic()
    procs, _ = _start_pair(str(tmp_path), ["--stage", "2", "--steps", "6", "--uneven"])
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=JOB_DEADLINE_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    elapsed = time.monotonic() - start
    assert [p.returncode for p in procs] == [1, 1], outputs
    # the worker that ran out of data says why; its peer then sees it leave
    assert "zero_runtime: the workers issued different collectives (uneven data" in outputs[1]
    assert "zero_runtime: worker rank 1 (127.0.0.1:" in outputs[0]
    assert elapsed < 60 + TIMEOUT_S, elapsed  # start-up (~15 s on 2 shared cores) + timeout
    print(f"uneven: both workers stopped {elapsed:.1f} s after launch")


CLUSTER_JOB = os.path.join(os.path.dirname(__file__), "helpers", "cluster_job.py")


def _listening(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def test_a_peer_that_never_starts_ends_rank_0_within_the_startup_timeout(tmp_path):
    """Rank 0 of a 2-worker TF_CONFIG whose rank 1 never starts waits a bounded time
    (max(30, 3 x collective_timeout_seconds=10) = 30 s, not TensorFlow's > 150 s, deaf to
    SIGINT and SIGTERM) and names the missing rank; SIGINT during it ends
    the process at once. Two lone rank-0 processes run side by side: one waits out the
    timeout, the other is interrupted once it is waiting (its server port listens)."""
    from zero_runtime import cluster_guard

    wait = cluster_guard.startup_timeout_seconds(TIMEOUT_S)
    assert wait == 30.0 and cluster_guard.startup_timeout_seconds(60.0) == 180.0
    ports = launch.free_ports(4)  # (rank 0, never-started rank 1) x 2 clusters
    procs = [
        subprocess.Popen(
            [sys.executable, CLUSTER_JOB],
            env=dict(os.environ, TF_CONFIG=launch.tf_config(ports[2 * i : 2 * i + 2], 0)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    timed_out, interrupted = procs
    try:
        deadline = time.monotonic() + JOB_DEADLINE_S
        while not _listening(ports[2]) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # inside the registration wait
        assert interrupted.poll() is None
        interrupted.send_signal(signal.SIGINT)
        sent = time.monotonic()
        interrupted.wait(timeout=30)
        stopped_after = time.monotonic() - sent
        output, _ = timed_out.communicate(timeout=JOB_DEADLINE_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert interrupted.returncode == -signal.SIGINT, interrupted.returncode
    assert stopped_after < 3.0, stopped_after
    assert timed_out.returncode == 1, output[-3000:]
    assert (
        f"TimeoutError: the cluster did not start within 30 s: worker rank 0 waited for all 2 "
        f"workers of TF_CONFIG to register (nothing listens at rank 1 (127.0.0.1:{ports[1]}))"
    ) in output, output[-3000:]
    assert "training" not in output
    print(f"lone rank 0: SIGINT stopped it in {stopped_after:.2f} s; the other timed out")


def test_a_clean_job_exits_without_a_crash_report(tmp_path):
    """A successful job ends without rank 0 logging ``StartAbort UNAVAILABLE ... The
    tasks have crashed``, which it would when rank 1 leaves first (no shutdown barrier)
    and rank 0 still works for longer than the heartbeat timeout (10 s). Rank 0 lingers
    13 s here; the exit barrier keeps rank 1 until rank 0 exits too."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zero_runtime.cli",
            "launch",
            "--nproc",
            "2",
            CLUSTER_JOB,
            "--linger",
            "13",
        ],
        capture_output=True,
        text=True,
        timeout=JOB_DEADLINE_S,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "[rank 0] rank 0 done" in output and "[rank 1] rank 1 done" in output
    for line in output.splitlines():
        assert "StartAbort" not in line and "unhealthy" not in line, line
        assert "have crashed" not in line and "exit barrier failed" not in line, line
