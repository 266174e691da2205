"""End to end: a setting changed from the tab, in a real browser, changes a running job.

A real training job (``tests/helpers/tuning_job.py``: Keras ``fit`` under
``ZeroInfinityStrategy``, a subprocess), a real ``tensorboard --memory_hierarchy_tuning``
over its log directory, and the Memory Hierarchy tab in headless Chromium. Through the
tab's live-tuning panel the test first submits an out-of-bounds value (refused, nothing
written), then ``telemetry_every_n_steps`` 1 -> 3 and ``device_budget_bytes`` unset ->
1 GiB; the panel reports the request applied at step N, and the job's own event files
show the change from step N on: a tiers record only every third step, with the new
device capacity. A second test runs the job at ZeRO stage 3 and lowers, then raises, the
device budget from the tab: page moves appear while it is low and stop when it is raised.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect
from test_browser import open_view, plugin_frame, require_built_frontend

from tb_plugin import metadata
from zero_runtime import control

pytestmark = [pytest.mark.slow, pytest.mark.browser]

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "helpers" / "tuning_job.py"
SCREENSHOT = REPO / "docs" / "screenshot_tuning.png"
RUN = "job"
GIB = 2**30
NEW_EVERY = 3  # telemetry_every_n_steps set from the tab
STEPS_AFTER = 30  # steps the job runs after the change before it is stopped
LOAD_TIMEOUT_MS = 90_000  # job start (TensorFlow import, first trace) + TensorBoard reload
LIVE_TIMEOUT_MS = 45_000  # the job's next step boundary + reload (1 s) + the view's poll (5 s)


def read_readout_step(frame) -> int:
    """The last recorded step the run's panel shows (-1 before the first)."""
    step = frame.locator(f'section.mh-run[data-run="{RUN}"] .mh-readout').get_attribute("data-step")
    return int(step) if step else -1


def _start_job(tmp_path: Path, *extra: str):
    """Start tests/helpers/tuning_job.py; returns (logdir, stop file, process, log path)."""
    logdir = tmp_path / "logs"
    logdir.mkdir()
    stop = tmp_path / "stop"
    job_log = tmp_path / "job.log"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO))
    with open(job_log, "wb") as log:
        job = subprocess.Popen(
            [sys.executable, str(JOB), "--logdir", str(logdir), "--run", RUN, *extra]
            + ["--stop-file", str(stop)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return logdir, stop, job, job_log


def wait_for_job_step(job: subprocess.Popen, job_log: Path, step: int) -> None:
    """Wait until the job printed ``tuning_job: step <step>`` (it trains), or fail."""
    deadline = time.monotonic() + LOAD_TIMEOUT_MS / 1000
    while f"tuning_job: step {step}" not in job_log.read_text(errors="replace"):
        assert job.poll() is None, job_log.read_text()[-3000:]
        assert time.monotonic() < deadline, job_log.read_text()[-3000:]
        time.sleep(0.25)


@contextlib.contextmanager
def _stopped_at_exit(job: subprocess.Popen, stop: Path, job_log: Path):
    """Run the body; then ask the job to stop and require a clean exit (kill it on error)."""
    try:
        yield
        stop.touch()
        assert job.wait(timeout=120) == 0, job_log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=30)


def test_a_setting_changed_in_the_tab_takes_effect_in_the_running_job(
    browser, tensorboard_server, plugin_client, tmp_path
):
    require_built_frontend()
    logdir, stop, job, job_log = _start_job(tmp_path)
    with _stopped_at_exit(job, stop, job_log):
        _drive_the_tab(browser, tensorboard_server, logdir, stop, job, job_log)
    assert "tuning_job: done" in job_log.read_text()
    _assert_the_job_changed(plugin_client(str(logdir)))


def _drive_the_tab(browser, tensorboard_server, logdir, stop, job, job_log) -> None:
    server = tensorboard_server(
        str(logdir), load_fast=True, reload_interval=1, extra_args=("--memory_hierarchy_tuning",)
    )
    wait_for_job_step(job, job_log, 10)  # training runs
    page, frame, console = open_view(browser, server)
    try:
        panel = frame.locator(f'section.mh-run[data-run="{RUN}"] .mh-tuning')
        telemetry = panel.locator('tr[data-key="telemetry_every_n_steps"]')
        budget = panel.locator('tr[data-key="device_budget_bytes"]')
        expect(telemetry).to_have_attribute("data-value", "1", timeout=LOAD_TIMEOUT_MS)
        assert job.poll() is None, job_log.read_text()[-3000:]
        expect(panel).to_have_attribute("data-enabled", "true")
        state = panel.locator(".mh-tuning-state")
        expect(state).to_have_attribute("data-state", "none")
        expect(budget.locator(".mh-tuning-current")).to_have_text("not set")
        expect(budget.locator(".mh-tuning-bounds")).to_have_text("64 KiB … 1 PiB (bytes)")
        submit = panel.locator("button.mh-tuning-submit")
        message = panel.locator(".mh-tuning-message")
        # Out of bounds: the server refuses it, the panel shows why, nothing is written.
        telemetry.locator("input").fill("0")
        submit.click()
        expect(message).to_contain_text(
            "Not applied: Invalid argument: telemetry_every_n_steps=0 is invalid"
        )
        assert not (logdir / RUN / control.REQUEST_FILE).exists()
        # The change.
        telemetry.locator("input").fill(str(NEW_EVERY))
        budget.locator("input").fill("1 GiB")
        submit.click()
        expect(state).to_have_attribute("data-version", "1")  # from the POST's answer
        expect(state).to_have_attribute("data-state", "applied", timeout=LIVE_TIMEOUT_MS)
        expect(message).to_be_hidden()  # "Request v1 written; waiting" is gone once decided
        step = int(state.get_attribute("data-step"))
        expect(state).to_have_text(
            f"Request v1: applied at step {step} (device_budget_bytes not set → 1 GiB, "
            "telemetry_every_n_steps 1 → 3)."
        )
        expect(telemetry).to_have_attribute("data-value", str(NEW_EVERY), timeout=LIVE_TIMEOUT_MS)
        expect(budget).to_have_attribute("data-value", str(GIB))
        expect(telemetry.locator(".mh-tuning-since")).to_have_text(f" since step {step} (v1)")
        # The charts mark the applied change, and the list names it.
        run_panel = frame.locator(f'section.mh-run[data-run="{RUN}"]')
        expect(run_panel.locator(f'.mh-config-event[data-step="{step}"]')).to_have_text(
            f"step {step}v1 applied: device_budget_bytes not set → 1 GiB, "
            "telemetry_every_n_steps 1 → 3",
            timeout=LIVE_TIMEOUT_MS,
        )
        device_markers = run_panel.locator(
            f'.mh-tier-cell[data-tier="device"] .mh-marker[data-step="{step}"]'
        )
        expect(device_markers).to_have_count(1, timeout=LIVE_TIMEOUT_MS)
        # Let the job run on, then record the panel as the docs' screenshot.
        deadline = time.monotonic() + LIVE_TIMEOUT_MS / 1000
        while read_readout_step(frame) < step + STEPS_AFTER:
            assert time.monotonic() < deadline, "the job stopped recording steps"
            assert job.poll() is None, job_log.read_text()[-3000:]
            time.sleep(0.5)
        frame.locator(
            f'section.mh-run[data-run="{RUN}"] .mh-section[data-view="tuning"]'
        ).screenshot(path=str(SCREENSHOT))
        in_frame = plugin_frame(page)
        assert in_frame.evaluate("window.__cspViolations") == []
        # The refused POST is logged by the browser as a failed resource load (400).
        errors = [
            c for c in console if c.startswith(("error", "pageerror")) and "status of 400" not in c
        ]
        assert errors == []
    finally:
        page.context.close()


def test_the_device_budget_set_in_the_tab_moves_pages_in_a_stage3_job(
    browser, tensorboard_server, plugin_client, tmp_path
):
    """Live tuning's effect: lower the budget from the tab, pages move; raise it, they stop."""
    require_built_frontend()
    logdir, stop, job, job_log = _start_job(tmp_path, "--stage3")
    with _stopped_at_exit(job, stop, job_log):
        low_step, high_step = _set_budget_twice(browser, tensorboard_server, logdir, job, job_log)
    body = plugin_client(str(logdir)).get(
        "/data/plugin/memory_hierarchy/series",
        query_string={"run": RUN, "tag": metadata.TAG_PAGES, "points": "0"},
    )
    assert body.status_code == 200, body.get_data(as_text=True)
    series = body.get_json()
    moves = {
        step: (h2d or 0) + (d2h or 0)
        for step, h2d, d2h in zip(
            series["steps"], series["values"]["h2d_pages"], series["values"]["d2h_pages"]
        )
    }
    before = [m for s, m in moves.items() if s < low_step]
    low = [m for s, m in moves.items() if low_step <= s < high_step]
    after = [m for s, m in moves.items() if s > high_step]  # the raise step itself may move
    assert before and low and after, moves
    # Every touched row page fits the job's 4 MiB budget: no page moves; at 1 MiB they
    # spill to the host and come back every step; at 4 MiB they fit again.
    assert max(before) == 0, moves
    assert min(low) > 0, moves
    assert sum(after) / len(after) < sum(low) / len(low), moves


def _set_budget_twice(browser, tensorboard_server, logdir, job, job_log) -> tuple[int, int]:
    """Lower device_budget_bytes to 1 MiB, then raise it to 4 MiB, from the panel."""
    server = tensorboard_server(
        str(logdir), load_fast=True, reload_interval=1, extra_args=("--memory_hierarchy_tuning",)
    )
    wait_for_job_step(job, job_log, 10)
    page, frame, _console = open_view(browser, server)
    try:
        panel = frame.locator(f'section.mh-run[data-run="{RUN}"] .mh-tuning')
        budget = panel.locator('tr[data-key="device_budget_bytes"]')
        expect(panel).to_have_attribute("data-enabled", "true", timeout=LOAD_TIMEOUT_MS)
        state = panel.locator(".mh-tuning-state")
        steps = []
        for version, text, value in ((1, "1 MiB", 2**20), (2, "4 MiB", 4 * 2**20)):
            budget.locator("input").fill(text)
            panel.locator("button.mh-tuning-submit").click()
            expect(state).to_have_attribute("data-version", str(version), timeout=LIVE_TIMEOUT_MS)
            expect(state).to_have_attribute("data-state", "applied", timeout=LIVE_TIMEOUT_MS)
            expect(budget).to_have_attribute("data-value", str(value), timeout=LIVE_TIMEOUT_MS)
            step = int(state.get_attribute("data-step"))
            steps.append(step)
            deadline = time.monotonic() + LIVE_TIMEOUT_MS / 1000
            while read_readout_step(frame) < step + 6:  # let a few steps run at this budget
                assert time.monotonic() < deadline, "the job stopped recording steps"
                assert job.poll() is None, job_log.read_text()[-3000:]
                time.sleep(0.5)
        return steps[0], steps[1]
    finally:
        page.context.close()


def _assert_the_job_changed(client) -> None:
    """From the job's event files: applied at step N, then a record every third step."""
    prefix = "/data/plugin/memory_hierarchy"
    events = client.get(
        f"{prefix}/json", query_string={"run": RUN, "tag": metadata.TAG_CONFIG_EVENT}
    ).json["events"]
    assert len(events) == 1, events
    decision = events[0]["value"]
    n = events[0]["step"]
    assert (decision["status"], decision["version"], decision["step"]) == ("applied", 1, n)
    assert decision["changes"] == {
        "telemetry_every_n_steps": {"old": 1, "new": NEW_EVERY},
        "device_budget_bytes": {"old": None, "new": GIB},
    }
    tiers = client.get(
        f"{prefix}/series",
        query_string={"run": RUN, "tag": metadata.TAG_TIERS, "points": "0"},
    ).json
    steps = tiers["steps"]
    last = steps[-1]
    assert last >= n + STEPS_AFTER
    # Before N every step was recorded; from N on only every third step.
    assert steps == list(range(n)) + [s for s in range(n, last + 1) if s % NEW_EVERY == 0]
    capacity = tiers["values"]["device"]["capacity_bytes"]
    before = [c for s, c in zip(steps, capacity) if s < n]
    after = [c for s, c in zip(steps, capacity) if s >= n]
    assert all(c is None for c in before)  # unbounded as started (NaN -> null)
    assert after and all(c == GIB for c in after)
    assert not any(isinstance(c, float) and math.isnan(c) for c in after)
