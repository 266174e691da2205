"""The main job (``scripts/run_demo.sh`` -> ``python -m demo.compare``), end to end.

One real run of the comparison per session, as the README's demo but with fewer
ZeRO-Infinity steps: on the same device (TensorFlow's CPU allocator capped at the demo's
36 MiB), judged by one measure (TensorFlow's allocator in-step peak), plain data
parallelism (stage 0) runs out of the device in its first steps and writes the
post-mortem; ZeRO-Infinity (stage 3, parameters and optimizer states on NVMe files)
trains the same model within it, with all three tiers occupied and pages moving both
ways; its loss is a standard TensorBoard scalar.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from playwright.sync_api import expect
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util
from test_browser import open_view, plugin_frame, require_built_frontend

from tb_plugin import metadata
from zero_runtime import oom

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
STEPS = 8
SCREENSHOT = REPO / "docs" / "screenshot_demo.png"  # the README's first picture
DEVICE = 36 << 20  # bytes: demo.compare's default device (the allocator's cap)
#: bytes: how far below the cap the BFC allocator may refuse a request (free bytes split
#: into chunks too small for it); 1 MiB, about 3% of DEVICE.
BFC_FRAGMENTATION_SLACK = 1 << 20
POOL = 12 << 20  # bytes: its default ZeRO-Infinity pool budget
ARGS: list[str] = []  # the README's model and batch


@pytest.fixture(scope="session")
def main_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """(logdir, finished process) of one ``python -m demo.compare`` run."""
    root = tmp_path_factory.mktemp("main_job")
    logdir, nvme = root / "logs", root / "nvme"
    proc = subprocess.run(
        [sys.executable, "-m", "demo.compare", "--logdir", str(logdir), "--steps", str(STEPS)]
        + ["--nvme-dir", str(nvme), *ARGS],
        cwd=REPO,
        env=dict(os.environ, ZERO_RUNTIME_PROFILE_EVERY="0"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (
        proc.stdout[-3000:] + proc.stderr[-3000:] + _failure_detail(logdir / "zero_infinity", nvme)
    )
    return logdir, proc


def _failure_detail(run_dir: Path, nvme: Path) -> str:
    """The ZeRO run's failed request as its post-mortem records it (the error's own
    message: a full disk, a thrashing placement...) and the NVMe directory's free space,
    for the assertion message of a failed main job."""
    path = run_dir / oom.OOM_FILENAME
    request = json.loads(path.read_text()).get("failed_request") if path.exists() else None
    free = shutil.disk_usage(nvme).free if nvme.exists() else None
    return f"\nZeRO run's failed request: {request}\nfree bytes under --nvme-dir: {free}"


def _accumulator(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def _vectors(acc: EventAccumulator, tag: str) -> list[np.ndarray]:
    return [tensor_util.make_ndarray(e.tensor_proto) for e in acc.Tensors(tag)]


def test_mirrored_run_runs_out_and_advises_zero(main_job):
    """Stage 0 runs out of the device in its first steps: TensorFlow's allocator refuses a
    request at the cap (its in-step peak plus the request reaches it, up to fragmentation);
    the post-mortem advises ZeRO stages (each with a verdict), and the log ends with one
    summary line and the allocator's figure, not a traceback."""
    logdir, proc = main_job
    report = json.loads((logdir / "mirrored_oom" / oom.OOM_FILENAME).read_text())
    assert report["step"] in (0, 1)
    failed = report["failed_request"]
    assert failed["tier"] == "device" and failed["error_type"] == "ResourceExhaustedError"
    peak = report["readings"]["framework_device_peak_bytes"]
    # The BFC allocator refuses when no free chunk holds the request: its in-step peak plus
    # the request reaches the cap up to the free bytes fragmentation strands (CI measured a
    # refusal 12 KiB short of the cap). A refusal further below the cap is not "at the cap".
    assert failed["bytes"] > 0, failed
    assert peak + failed["bytes"] > DEVICE - BFC_FRAGMENTATION_SLACK, (peak, failed["bytes"])
    assert peak <= DEVICE, peak
    assert report["config"]["stage"] == 0
    assert report["config"]["device_budget_bytes"] == DEVICE
    # ZeRO is advised; a change is labelled "fits" only when the replay verifies it
    # (docs/oom.md). ZeRO-Infinity is replayed on the estimator's stage-3 figures of this
    # model and ranks first: the second run, on the same device, is its check.
    zero = [a for a in report["advice"] if a["change"].get("stage", 0) >= 1]
    assert all(a["verdict"] in ("fits", "may fit", "does not fit") for a in zero)
    top = report["advice"][0]
    assert top["change"] == {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}
    assert top["verdict"] == "fits" and 0 < top["predicted_bytes"] <= DEVICE, top
    assert all(a["frees_bytes"] > 0 for a in report["advice"]), report["advice"]
    # One accounting: the device row's used bytes are its holders' sum, and the figure the
    # budget check read is kept beside them, named.
    device = report["tiers"]["device"]
    assert device["used_bytes"] == sum(h["bytes"] for h in device["holders"])
    assert device["used_bytes"] > DEVICE
    # The allocator refused a request: the figure it failed at is its in-step peak.
    assert (device["checked_source"], device["checked_bytes"]) == ("allocator_peak", int(peak))
    assert "TensorFlow's allocator peaked at" in report["summary"]
    # The device's memory is the allocator's cap: a budget raised past it does not fit.
    raise_ = next(a for a in report["advice"] if "device_budget_bytes" in a["change"])
    assert raise_["verdict"] == "does not fit", raise_
    assert "this machine has 36.00 MiB for the tier" in raise_["description"]
    step = report["step"]
    assert (
        f"out of memory: Step {step} ran out of memory on the device tier: TensorFlow's "
        "allocator refused a request" in proc.stderr
    ), proc.stderr[-3000:]
    assert (
        f"device, by TensorFlow's allocator in-step peak: highest {peak / 2**20:.1f} MiB at "
        f"step {step} over {step + 1} steps, cap 36 MiB: an allocation past it failed"
    ) in proc.stderr, proc.stderr[-3000:]
    # The post-mortem's path once in the whole log.
    path = logdir / "mirrored_oom" / oom.OOM_FILENAME
    assert (proc.stdout + proc.stderr).count(str(path)) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not any(line.startswith(("I0000", "W0000")) for line in proc.stderr.splitlines())


def test_both_runs_are_judged_by_the_allocator_peak(main_job):
    """One measure for both runs: TensorFlow's allocator in-step peak against
    the device's memory, stated in the log and recorded in run_info; ZeRO-Infinity's is
    within the cap on every step, and its pool's pages within the pool budget."""
    logdir, proc = main_job
    assert "Both are judged by TensorFlow's allocator in-step peak" in proc.stdout
    acc = _accumulator(logdir / "zero_infinity")
    info = json.loads(_vectors(acc, metadata.TAG_RUN_INFO)[-1].item())
    assert info["device_capacity_bytes"] == DEVICE
    assert info["config"]["device_budget_bytes"] == POOL
    col = metadata.READING_COLUMNS.index("framework_device_peak_bytes")
    peaks = [float(r[col]) for r in _vectors(acc, metadata.TAG_READINGS)]
    assert len(peaks) == STEPS and 0 < max(peaks) <= DEVICE, peaks
    assert (
        f"highest {max(peaks) / 2**20:.1f} MiB at step {int(np.argmax(peaks))} over {STEPS} "
        "steps, cap 36 MiB: within it on every step"
    ) in proc.stdout
    mirrored = json.loads(
        _vectors(_accumulator(logdir / "mirrored_oom"), metadata.TAG_RUN_INFO)[-1].item()
    )
    assert mirrored["device_capacity_bytes"] == DEVICE


def test_zero_infinity_run_trains_on_three_tiers(main_job):
    """Stage 3 + NVMe under the same budget: every step recorded, device, host and NVMe
    occupied, pages written to and read from NVMe, the device within its budget, and the
    loss (a standard scalar) falling."""
    logdir, proc = main_job
    assert f"{STEPS} steps recorded" in proc.stdout
    acc = _accumulator(logdir / "zero_infinity")
    tiers = _vectors(acc, metadata.TAG_TIERS)
    assert len(tiers) == STEPS
    used = metadata.TIER_COLUMNS.index("used_bytes")
    device, host, nvme = (metadata.TIERS.index(t) for t in ("device", "host", "nvme"))
    for m in tiers:
        assert 0 < m[device, used] <= POOL
        assert m[host, used] > 0 and m[nvme, used] > 0
    pages = np.stack(_vectors(acc, metadata.TAG_PAGES))
    col = metadata.PAGE_COLUMNS.index
    assert pages[:, col("h2n_bytes")].sum() > 0 and pages[:, col("n2h_bytes")].sum() > 0
    info = json.loads(_vectors(acc, metadata.TAG_RUN_INFO)[-1].item())
    assert info["stage"] == 3
    losses = [float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors("train/loss")]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.1, losses


def test_zero_infinity_run_times_every_step(main_job):
    """Without the profiler (ZERO_RUNTIME_PROFILE_EVERY=0), stage 3's comm/compute
    breakdown and overlap come from the runtime's own intervals on every step (its
    collectives' watchdog callbacks and NVMe I/O); step 0 alone is marked as traced."""
    logdir, _ = main_job
    acc = _accumulator(logdir / "zero_infinity")
    rows = [dict(zip(metadata.TIMING_COLUMNS, v)) for v in _vectors(acc, metadata.TAG_TIMING)]
    assert len(rows) == STEPS
    assert [r["traced"] for r in rows] == [1.0] + [0.0] * (STEPS - 1)
    measured = [r for r in rows if np.isfinite(r["overlap_ratio"])]
    assert len(measured) >= 0.9 * STEPS, rows
    for r in measured:
        assert 0 < r["comm_seconds"] <= r["step_seconds"] + 1e-9
        assert 0 <= r["overlap_seconds"] <= r["comm_seconds"] + 1e-9
        assert 0 < r["compute_seconds"] <= r["step_seconds"] + 1e-9
    assert sum(r["io_seconds"] for r in rows) > 0  # NVMe page I/O, timed per job


@pytest.mark.browser
def test_both_runs_side_by_side_in_the_tab(main_job, tensorboard_server, browser):
    """The README's first picture: both runs selected in the Memory Hierarchy tab, the
    mirrored run's OOM post-mortem shown, the ZeRO-Infinity run's last step read out with
    bytes on the device, host and NVMe tiers."""
    require_built_frontend()
    logdir, _ = main_job
    server = tensorboard_server(str(logdir), load_fast=True)
    page, frame, console = open_view(browser, server)
    try:
        zero = frame.locator('section.mh-run[data-run="zero_infinity"]')
        readout = zero.locator(f'.mh-readout[data-step="{STEPS - 1}"]')
        expect(readout).to_have_count(1, timeout=60_000)
        for tier in ("device", "host", "nvme"):
            used = readout.locator(f'tr[data-tier="{tier}"]').get_attribute("data-used-bytes")
            assert float(used) > 0, tier
        mirrored = frame.locator('section.mh-run[data-run="mirrored_oom"]')
        oom_view = mirrored.locator('.mh-section[data-view="oom"]')
        expect(oom_view).to_be_visible(timeout=60_000)
        headline = oom_view.locator(".mh-oom-headline")
        expect(headline).to_contain_text("Out of memory at step")
        expect(headline).to_contain_text("requested")  # TensorFlow's allocator refused it
        expect(oom_view.locator(".mh-oom-recent-tier")).to_have_count(3)
        # Stage 0 is the baseline, not a fallback; the stand-in is named once.
        facts = mirrored.locator(".mh-facts")
        expect(facts.locator('[data-badge="baseline"]')).to_have_count(1)
        expect(facts.locator('[data-badge="fallback"]')).to_have_count(0)
        assert facts.inner_text().count("CPU stand-in") == 1, facts.inner_text()
        zero_device = zero.locator('.mh-tier-cell[data-tier="device"] .mh-device-note')
        expect(zero_device).to_contain_text("paged pool")
        # Each device figure named by what it measures; the allocator peak against the
        # device's memory, the pool's accounting above its budget only by the shards.
        expect(zero_device).to_contain_text("TensorFlow allocator peak (in step), the measure")
        expect(zero_device).to_contain_text("against the device’s memory of 36 MiB")
        expect(zero_device).not_to_contain_text("OVERRUN")
        head = zero.locator('.mh-tier-cell[data-tier="device"] .mh-tier-notes')
        expect(head).to_contain_text("pool pages + gradient shards (in step)")
        expect(head).to_contain_text("device memory (allocator limit) 36 MiB")
        expect(head).to_contain_text("pool budget (device_budget_bytes) 12 MiB")
        expect(zero.locator(".mh-estimate-notes")).to_contain_text("host window for NVMe pages")
        assert plugin_frame(page).evaluate("window.__cspViolations") == []
        assert [c for c in console if c.startswith(("error", "pageerror"))] == []
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        # The what-if is reachable in the demo's TensorBoard (no --memory_hierarchy_tuning,
        # both jobs finished): Predict effect replays the ZeRO run's recorded trace; Apply
        # is not offered. The mirrored run recorded no trace: read-only.
        tuning = zero.locator(".mh-tuning")
        expect(tuning).to_have_attribute("data-mode", "predict", timeout=60_000)
        expect(tuning.locator(".mh-tuning-note")).to_contain_text("can still be replayed")
        expect(tuning.locator("button.mh-tuning-submit")).to_be_hidden()
        budget = tuning.locator('tr[data-key="device_budget_bytes"]')
        expect(budget.locator(".mh-tuning-bounds")).to_contain_text("whole pages of 256 KiB")
        budget.locator("input").fill("6 MiB")
        tuning.locator("button.mh-tuning-predict").click()
        box = tuning.locator(".mh-whatif")
        expect(box).to_have_attribute("data-state", "ready", timeout=120_000)
        peak = box.locator('tr[data-key="device_peak"]')
        # The whole device tier (the gathered units included) within the proposed budget;
        # the demo's pool keeps no page on the device (parameters and states live on the
        # host and NVMe), so the budget moves nothing and the peak stays as measured.
        predicted = float(peak.get_attribute("data-predicted"))
        assert 0 < predicted <= 6 << 20
        assert float(peak.get_attribute("data-now")) == predicted
        expect(mirrored.locator(".mh-tuning")).to_have_attribute("data-mode", "read-only")
    finally:
        page.context.close()


def test_the_story_through_the_plugin_routes(main_job, plugin_client):
    """The end-to-end check, through ``/data/plugin/memory_hierarchy/``: the
    mirrored run has an OOM record; the ZeRO run moved pages both ways between host and
    NVMe, held NVMe bytes, measured overlap on >= 90% of its steps."""
    logdir, _ = main_job
    client = plugin_client(str(logdir))
    base = "/data/plugin/memory_hierarchy"

    def get(route: str, **query: str) -> dict:
        resp = client.get(f"{base}/{route}", query_string=query)
        assert resp.status_code == 200, (route, query, resp.get_data(as_text=True)[:500])
        return json.loads(resp.get_data(as_text=True))

    names = {r["run"] for r in get("runs")["runs"]}
    assert {"mirrored_oom", "zero_infinity"} <= names, names
    report = get("oom", run="mirrored_oom")
    assert report["postmortem"]["failed_request"]["error_type"] == "ResourceExhaustedError"
    # The run that trained has no OOM record, and the answer says which run has.
    resp = client.get(f"{base}/oom", query_string={"run": "zero_infinity"})
    assert resp.status_code == 404
    assert json.loads(resp.get_data(as_text=True))["error"]["message"] == (
        "Not found: run 'zero_infinity' has no OOM record (it did not run out of memory); "
        "runs with one: ['mirrored_oom']"
    )
    pages = get("series", run="zero_infinity", tag=metadata.TAG_PAGES)["values"]
    assert sum(v or 0 for v in pages["h2n_bytes"]) > 0
    assert sum(v or 0 for v in pages["n2h_bytes"]) > 0
    tiers = get("series", run="zero_infinity", tag=metadata.TAG_TIERS)["values"]
    assert all((v or 0) > 0 for v in tiers["nvme"]["used_bytes"])
    timing = get("series", run="zero_infinity", tag=metadata.TAG_TIMING)["values"]
    ratios = timing["overlap_ratio"]
    assert len(ratios) == STEPS
    assert sum(r is not None for r in ratios) >= 0.9 * STEPS, ratios
