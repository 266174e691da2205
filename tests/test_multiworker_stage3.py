"""Every ZeRO stage and offload mode across two real worker processes on 127.0.0.1.

Each config trains under 2 workers x 1 replica (``TF_CONFIG`` from ``zero_runtime.launch``)
and, in this process, under 1 process x 2 replicas (the same global replica count, global
batch and seed); per-step losses and the final weights (``get_weights()``, which at stage
3 all-gathers the shards across workers) must agree within 1e-5 relative (measured:
identical). Covered, kept to five configs for the suite's time: stage 3 with parameter
shards and optimizer states both on the device, both on the host, both on NVMe (each
worker its own slab file); stage 1 with device-tier optimizer states; stage 2 with
gradient accumulation and device-tier states. (Measured identical too, not run here:
stage 3 param none / nvme with host states, param cpu with device states, stage 2 with
device states, stage 1 accumulation with host states, stage 3 accumulation ``s3_accum``
(losses and weights bitwise equal); ``mw_stage3_job.CONFIGS``.) Each
config runs in its own pair of worker processes, one after the other, then the
references run here.

``s3_units``: the GPT nested in a functional DAG (a residual logit branch), run by
units (one all-gather and one reduce-scatter per layer use) with shards on the host
(measured 1.3e-6 relative, within the bound); ``s3_units_device`` the same with shards and
states on the device (per-worker shard variables, the step boundary reported from Python
after each call, the chief's live-tuning broadcast there; measured 1.3e-6).
Live tuning across workers: a control request written to the chief's run mid-job is
decided by the chief and applied by both workers at the same step boundary.

Row-paged embeddings across workers (``s3_embedding``: a 20 000 x 16 table, SGD, the
engine's default budgets): each worker holds only its own replica's row pages, and the
losses and the gathered table (touched rows moved, untouched rows as initialised) equal
one process's with two replicas (measured bitwise equal).
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time

import numpy as np
import psutil
import pytest
from helpers import mw_stage3_job, relaunch

pytestmark = [pytest.mark.slow]  # ~2-3 min: two workers and the references, 2 cores

CONFIGS = (
    "s3_all_device",  # parameter shards and optimizer states on the device tier
    "s3_param_cpu",  # both on the host
    "s3_param_nvme",  # both on NVMe
    "s3_embedding",  # a row-paged embedding table (hot/cold rows), SGD
    "s3_units",  # the GPT nested in a DAG: run by units, shards and states on the host
    "s3_units_device",  # the same, on the device: shard variables, no host call per step
    "s1_opt_none",  # device-tier optimizer states (the step's graph)
    "s2_accum_opt_none",  # accumulation (tf.cond, raw collectives) + device states
    "s2_tuning",  # live tuning: the chief's decision, adopted by every worker
)
TIMEOUT_S = 30.0  # collective_timeout_seconds (2 shared cores, 3 busy processes)
JOB_DEADLINE_S = 420  # the workers' job is not done by then: it hung (takes ~40-130 s)
RTOL, ATOL = 1e-5, 1e-7

#: (param tier, optimizer-state tier) of each stage-3 config, by the objects' own records.
STAGE3_TIERS = {
    "s3_all_device": ("device", "device"),
    "s3_param_cpu": ("host", "host"),
    "s3_param_nvme": ("nvme", "nvme"),
    "s3_units_device": ("device", "device"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{"workers": {name: [rank0, rank1]}, "reference": {name: record}, "seconds": ...}``."""
    root = tmp_path_factory.mktemp("mw3")
    out = root / "workers"
    out.mkdir()
    result: dict = {}

    def job() -> None:
        # One pair of worker processes per config: several MultiWorkerMirroredStrategy
        # objects in one process ("Enabling collective ops after program startup") ran
        # fine from the command line but hung at the 5th/6th strategy's first variable
        # broadcast under pytest in CI (matching group and instance keys on both
        # workers; cause not found), so each config gets fresh processes.
        text = result["text"] = io.StringIO()  # read on a hang too
        start = time.monotonic()
        status = 0
        for name in CONFIGS:
            args = [sys.executable, mw_stage3_job.__file__, str(out), "--configs", name]
            status = relaunch.launch_job(2, [*args, "--timeout", str(TIMEOUT_S)], text)
            if status != 0:
                break
        result["status"] = status
        result["seconds"] = time.monotonic() - start
        result["output"] = text.getvalue()

    # The workers first, then the references (not side by side: 3 TensorFlow processes on
    # 2 cores made the workers' collectives time out under CI load).
    thread = threading.Thread(target=job)
    thread.start()
    thread.join(JOB_DEADLINE_S)
    if thread.is_alive():  # hung: stop the workers so they do not outlive the session
        for child in psutil.Process().children(recursive=True):
            if any("mw_stage3_job" in part for part in child.cmdline()):
                child.kill()
        thread.join(30)
    assert result.get("status") == 0, (
        "the workers did not finish: " + result["text"].getvalue()[-4000:]
        if "status" not in result
        else result["output"][-4000:]
    )
    ref_dir = root / "reference"
    ref_dir.mkdir()
    start = time.monotonic()
    reference = {name: mw_stage3_job.run(name, str(ref_dir), 2, TIMEOUT_S) for name in CONFIGS}
    ref_seconds = time.monotonic() - start
    workers = {
        name: [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in (0, 1)]
        for name in CONFIGS
    }
    print(
        f"workers: {result['seconds']:.0f} s for {len(CONFIGS)} configs; "
        f"references: {ref_seconds:.0f} s"
    )
    return {"workers": workers, "reference": reference}


def _max_rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), ATOL / RTOL)))


@pytest.mark.parametrize("name", CONFIGS)
def test_two_workers_match_one_process_with_two_replicas(name, runs):
    ref = runs["reference"][name]
    assert ref["strategy"] == "ZeroInfinityStrategy"
    assert (ref["num_replicas_in_sync"], ref["local_replicas"]) == (2, 2)
    assert not ref["fallback_mirrored"]
    assert ref["losses"][-1] < ref["losses"][0]  # it trained
    worst = 0.0
    for rank, rec in enumerate(runs["workers"][name]):
        assert rec["rank"] == rank and rec["config"] == name
        assert rec["strategy"] == "MultiWorkerZeroInfinityStrategy"
        assert (rec["num_replicas_in_sync"], rec["local_replicas"]) == (2, 1)
        assert not rec["fallback_mirrored"]
        assert len(rec["losses"]) == len(ref["losses"])
        np.testing.assert_allclose(rec["losses"], ref["losses"], rtol=RTOL, atol=0)
        assert len(rec["weights"]) == len(ref["weights"])
        for got, want in zip(rec["weights"], ref["weights"], strict=True):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
            worst = max(worst, _max_rel(got, want))
        worst = max(worst, _max_rel(rec["losses"], ref["losses"]))
    print(f"{name}: max relative difference to one process (losses, weights) {worst:.3g}")


@pytest.mark.parametrize("name", sorted(STAGE3_TIERS))
def test_stage3_each_worker_holds_only_its_own_shards(name, runs):
    """A worker's pool holds the parameter shards of its own replica only (rank r: replica
    r), on the configured tier; one process with two replicas holds both."""
    param_tier, opt_tier = STAGE3_TIERS[name]
    ref = runs["reference"][name]
    assert ref["local_replica_ids"] == [0, 1]
    per_replica = ref["shard_tensors_per_replica"]
    # Host/NVMe: the shards are packed into page-sized chunks (zero_runtime/memory/flat_store.py).
    assert ref["shard_tensors"] == sorted([0, 1] * per_replica)
    for rank, rec in enumerate(runs["workers"][name]):
        assert rec["local_replica_ids"] == [rank]
        assert rec["shard_tensors"] == [rank] * rec["shard_tensors_per_replica"]
        assert rec["shard_tensors_per_replica"] == per_replica
        assert rec["variables"] == ref["variables"] > 0
        assert (rec["shard_tiers"], rec["optimizer_tier"]) == ([param_tier], opt_tier)


def test_live_tuning_is_decided_by_the_chief_and_applied_by_every_worker_at_one_step(runs):
    """The request goes to the chief's run only (``worker_0``, as the view writes it);
    both workers apply it at the same step, with the same changes, as one process does."""
    want = mw_stage3_job.TUNED
    ref = runs["reference"]["s2_tuning"]

    def decisions(rec):
        return [{k: v for k, v in d.items() if k != "decided_at"} for d in rec["decisions"]]

    (ref_decision,) = decisions(ref)
    assert ref_decision["status"] == "applied" and ref_decision["version"] == 1
    # written before batch TUNE_AT, decided at the boundary after it: in effect from the next
    assert ref_decision["step"] == mw_stage3_job.TUNE_AT + 1
    assert {k: v["new"] for k, v in ref_decision["changes"].items()} == want
    for rec in runs["workers"]["s2_tuning"]:
        assert decisions(rec) == [ref_decision]
        assert rec["tuned"] == want


def test_row_paged_embedding_across_workers_holds_own_rows_and_matches_one_process(runs):
    """Each worker's pool holds only its own replica's row pages (10 of the table's 20);
    the touched rows equal one process's (bitwise: the ids and gradients are combined with
    the same collectives) and moved, the untouched rows are the initial ones; the table's
    placement row is written per worker with its own pages' bytes per tier."""
    ref = runs["reference"]["s3_embedding"]
    touched = np.asarray(ref["touched"])
    initial = np.asarray(ref["initial_table"], np.float32)
    untouched = np.setdiff1d(np.arange(initial.shape[0]), touched)
    ref_table = np.asarray(ref["weights"][0], np.float32)
    assert ref["row_page_replicas"] == [0, 1] and ref["row_pages"] == 2 * ref["pages_per_shard"]
    assert np.abs(ref_table[touched] - initial[touched]).max() > 1e-3  # the rows trained
    for rank, rec in enumerate(runs["workers"]["s3_embedding"]):
        assert rec["row_page_replicas"] == [rank]  # its own replica's row pages only
        assert rec["row_pages"] == rec["pages_per_shard"] == 10
        table = np.asarray(rec["weights"][0], np.float32)  # gathered across workers
        np.testing.assert_array_equal(table[touched], ref_table[touched])
        np.testing.assert_array_equal(table[untouched], initial[untouched])
        assert sum(rec["h2d_pages"]) > 0  # cold row pages came up from the host
        row = rec["placement_row"]
        assert row["row_pages"] == 10 and row["rows_touched"] > 0
        assert sum(row["tier_bytes"].values()) == 10 * 65536  # its 10 row pages, whole
        # default budget: a row cache, not the whole table gathered (the rule before)
        assert rec["device_capacity"] < 4 * 20_000 * 16
