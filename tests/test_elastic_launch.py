"""A 2-worker job that shrinks to 1 and grows back to 2 under ``zero-runtime launch
--min-nproc 1``, keeping its global batch: the loss continues and the final weights are
the uninterrupted run's.

Stage 3, parameters and optimizer states on NVMe, ``fit`` with
``ZeroBackupAndRestore(save_freq=2)`` and ``zero_runtime.elastic.batch_plan`` (global batch
8: 2 workers x 4 examples, or 1 worker x 4 examples x 2 accumulation steps;
tests/helpers/heal_job.py ``--elastic``). Rank 1 is killed at a random step
(``--shrink-after 1``: the next group runs 1 worker), then SIGUSR1 to the launcher at a
random later step preempts the 1-worker group (it saves at an agreed step, exits 42) and
the next group runs 2 workers again. The job finishes by itself; each optimizer step's
loss (the mean of its micro-batches' losses at 1 worker) equals the uninterrupted 2-worker
run's (launched at the same time) within float32 rounding of the mean, and the final
weights bitwise: the accumulated mean ``(g0 + g1) / 2`` is the two workers'
``g0 / 2 + g1 / 2`` exactly.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal

import numpy as np
import pytest
from test_heal_multiworker import _launch, assert_finished_like_the_reference, side_by_side
from test_launch import _alive

pytestmark = [pytest.mark.slow]  # ~80 s: three 2-worker start-ups and a reference run

SEED = int(os.environ.get("ZERO_RUNTIME_HEAL_SEED", "42"))
TOTAL_STEPS = 18  # optimizer steps: 3 epochs of 6 global batches (heal_job's defaults)
_STEP = re.compile(r"rank (\d) pid (\d+) attempt (\d) step (\d+) loss (\S+) accum (\d)")


def _losses(lines: list[str]) -> dict[int, dict[int, np.float32]]:
    """Rank 0's loss of each optimizer step, per attempt: ``{attempt: {step: loss}}`` (at
    accumulation N the mean of the step's N micro-batch losses, in float32)."""
    micro: dict[int, dict[int, list[np.float32]]] = {}
    for line in lines:
        found = _STEP.search(line)
        if not found or found.group(1) != "0":
            continue
        attempt, batches, accum = int(found.group(3)), int(found.group(4)), int(found.group(6))
        step = (batches - 1) // accum + 1
        micro.setdefault(attempt, {}).setdefault(step, []).append(np.float32(found.group(5)))
    return {
        a: {
            s: np.float32(np.sum(v, dtype=np.float32) / np.float32(len(v)))
            for s, v in steps.items()
        }
        for a, steps in micro.items()
    }


@pytest.fixture(scope="module")
def resized(tmp_path_factory) -> dict:
    """The reference and the resized job, run side by side; what the test observed."""
    base = tmp_path_factory.mktemp("elastic")
    rng = random.Random(SEED)
    kill_at, grow_after = rng.randint(3, 7), rng.randint(2, 4)  # optimizer steps
    elastic = ("--elastic",)
    reference = _launch(base, "ref", job_args=elastic)
    job = _launch(
        base,
        "job",
        *("--max-restarts", "3", "--min-nproc", "1", "--shrink-after", "1"),
        *("--preemption-grace", "20", "--logdir", str(base / "job_logs")),
        job_args=elastic,
    )
    pids: dict[tuple[int, int], int] = {}
    sent: dict[str, tuple] = {}
    resumed: dict[int, int] = {}

    def on_line(line: str) -> None:
        if "resumed at step" in line:
            resumed.setdefault(len(sent), int(line.split()[-1]))
        found = _STEP.search(line)
        if not found:
            return
        rank, pid, attempt, batches = (int(g) for g in found.group(1, 2, 3, 4))
        step = batches // int(found.group(6))  # optimizer steps done
        pids[(attempt, rank)] = pid
        if attempt == 0 and step >= kill_at and "kill" not in sent and (0, 1) in pids:
            os.kill(pids[(0, 1)], signal.SIGKILL)
            sent["kill"] = (pids[(0, 1)], step)
        if attempt == 1 and "grow" not in sent and step >= resumed.get(1, 99) + grow_after:
            job.send_signal(signal.SIGUSR1)
            sent["grow"] = (step,)

    return side_by_side(
        base, job, reference, on_line, "elastic test", sent=sent, resumed=resumed, pids=pids
    )


def test_the_job_shrinks_grows_and_finishes_with_the_uninterrupted_weights(resized):
    assert_finished_like_the_reference(resized, {"kill", "grow"})
    starts = re.findall(r"rank 0 pid \d+ attempt (\d) start world (\d)", resized["log"])
    assert starts == [("0", "2"), ("1", "1"), ("2", "2")]


def test_the_loss_continues_across_each_resize(resized):
    """Every optimizer step's loss, from the group that kept it (the last one to run it),
    equals the uninterrupted run's; the 1-worker group ran its steps as 2 micro-batches."""
    (ref,) = _losses(resized["ref_log"].splitlines()).values()
    assert sorted(ref) == list(range(1, TOTAL_STEPS + 1))
    per_attempt = _losses(resized["lines"])
    kept: dict[int, np.float32] = {}
    for attempt in sorted(per_attempt):
        kept.update(per_attempt[attempt])  # a later group's redone step replaces it
    assert sorted(kept) == sorted(ref)
    assert len(per_attempt[1]) >= 2  # the 1-worker group trained (accumulating)
    # 2 workers: (s0 + s1) / (n0 + n1); 1 worker: (s0 / n0 + s1 / n1) / 2 (float32
    # rounding; the weights above are bitwise)
    np.testing.assert_allclose(
        [kept[s] for s in ref], [ref[s] for s in ref], rtol=1e-6, err_msg=str(per_attempt)
    )
    # the grow lost nothing: the 2-worker group resumed at the step the 1-worker one saved
    saved = re.findall(r"rank 0 preempted: saved \S+ at step (\d+); exiting 42", resized["log"])
    assert len(saved) == 1 and resized["resumed"][2] == int(saved[0])


def test_the_events_name_the_shrink_and_the_grow(resized):
    with open(resized["base"] / "job_ckpt" / "restarts.jsonl") as f:
        events = [json.loads(line) for line in f]
    kinds = [e["event"] for e in events if e["event"] != "resume"]
    assert kinds == ["start", "restart", "resize", "start", "resize", "start", "exit"]
    restart, shrink, grow = (e for e in events if e["event"] in ("restart", "resize"))
    assert (restart["rank"], restart["signal"]) == (1, "SIGKILL")
    assert (shrink["from_nproc"], shrink["to_nproc"]) == (2, 1)
    assert (grow["to_nproc"], grow["reason"]) == (2, "asked (SIGUSR1)")
    resumes = [e for e in events if e["event"] == "resume"]
    assert [e["step"] for e in resumes[1:]] == [resized["resumed"][1], resized["resumed"][2]]
    assert resumes[2]["steps_lost"] == 0 and resumes[1]["steps_lost"] <= 2 + 1
    final = events[-1]["goodput"]
    assert final["useful_steps"] == TOTAL_STEPS and final["all_steps"] >= TOTAL_STEPS
    assert 0 < final["time_ratio"] < 1
    assert (resized["base"] / "job_logs" / "memory_hierarchy_restarts.jsonl").exists()


def test_nothing_is_left_behind(resized):
    base = resized["base"]
    assert [p for p in resized["pids"].values() if _alive(p)] == []
    assert os.listdir(base / "job_nvme") == [] and os.listdir(base / "ref_nvme") == []
    assert os.listdir(base / "job_ckpt") == ["restarts.jsonl"]
