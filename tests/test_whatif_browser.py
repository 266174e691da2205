"""End to end in Chromium: a change's predicted effect before it is applied, then beside
what was measured.

A real stage-3 training job (``tests/helpers/tuning_job.py --stage3``: parameter shards
on the host, every gathered block on the device; nothing pages at the default budget), a
real ``tensorboard --memory_hierarchy_tuning`` over its log directory, the tab in headless
Chromium. In the live-tuning panel, ``device_budget_bytes`` = 1 MiB and *Predict effect*
show, with no request written, page moves going from 0 to a positive number per step and
a device peak within 1 MiB (the job's recorded access trace replayed through the pool's
policy). Applied, the panel lists the request with predicted beside measured page moves,
within 20% of each other, and the config change in *Config changes* and its marker on
the device chart say the same.
The panel with the prediction is saved as ``docs/screenshot_whatif.png``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect
from test_browser import open_view, require_built_frontend
from test_tuning_e2e import (
    LIVE_TIMEOUT_MS,
    LOAD_TIMEOUT_MS,
    RUN,
    _start_job,
    _stopped_at_exit,
    read_readout_step,
    wait_for_job_step,
)

from zero_runtime import control

pytestmark = [pytest.mark.slow, pytest.mark.browser]

SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "screenshot_whatif.png"

MIB = 2**20


def test_a_prediction_is_shown_before_apply_and_beside_measured_after(
    browser, tensorboard_server, tmp_path
):
    require_built_frontend()
    logdir, stop, job, job_log = _start_job(tmp_path, "--stage3")
    with _stopped_at_exit(job, stop, job_log):
        server = tensorboard_server(
            str(logdir),
            load_fast=True,
            reload_interval=1,
            extra_args=("--memory_hierarchy_tuning",),
        )
        wait_for_job_step(job, job_log, 10)
        page, frame, console = open_view(browser, server)
        try:
            panel = frame.locator(f'section.mh-run[data-run="{RUN}"] .mh-tuning')
            expect(panel).to_have_attribute("data-enabled", "true", timeout=LOAD_TIMEOUT_MS)
            budget = panel.locator('tr[data-key="device_budget_bytes"]')
            budget.locator("input").fill("1 MiB")
            panel.locator("button.mh-tuning-predict").click()
            box = panel.locator(".mh-whatif")
            expect(box).to_have_attribute("data-state", "ready", timeout=LIVE_TIMEOUT_MS)
            # Before apply: nothing was written, and the prediction is on the page.
            assert not (logdir / RUN / control.REQUEST_FILE).exists()
            expect(panel.locator(".mh-tuning-state")).to_have_attribute("data-state", "none")
            expect(box.locator(".mh-whatif-headline")).to_contain_text("page moves 0 \u2192")
            h2d = box.locator('tr[data-key="moves_h2d"]')
            assert float(h2d.get_attribute("data-now")) == 0
            predicted_h2d = float(h2d.get_attribute("data-predicted"))
            assert predicted_h2d > 0
            peak = box.locator('tr[data-key="device_peak"]')
            assert float(peak.get_attribute("data-predicted")) <= MIB
            assert float(peak.get_attribute("data-now")) > MIB
            frame.locator(
                f'section.mh-run[data-run="{RUN}"] .mh-section[data-view="tuning"]'
            ).screenshot(path=str(SCREENSHOT))
            # Apply; after some steps at 1 MiB, predicted beside measured.
            panel.locator("button.mh-tuning-submit").click()
            state = panel.locator(".mh-tuning-state")
            expect(state).to_have_attribute("data-state", "applied", timeout=LIVE_TIMEOUT_MS)
            step = int(state.get_attribute("data-step"))
            deadline = time.monotonic() + LIVE_TIMEOUT_MS / 1000
            while read_readout_step(frame) < step + 4:
                assert time.monotonic() < deadline, "the job stopped recording steps"
                assert job.poll() is None, job_log.read_text()[-3000:]
                time.sleep(0.5)
            outcome = panel.locator('.mh-whatif-outcome[data-version="1"]')
            expect(outcome).to_have_attribute("data-applied-step", str(step))
            expect(outcome).not_to_have_attribute(
                "data-measured-moves", "", timeout=LIVE_TIMEOUT_MS
            )
            predicted = float(outcome.get_attribute("data-predicted-moves"))
            measured = float(outcome.get_attribute("data-measured-moves"))
            print(f"page moves per step: predicted {predicted}, measured {measured}")
            assert measured > 0 and abs(predicted - measured) <= 0.2 * measured
            expect(outcome).to_contain_text("measured")
            run_panel = frame.locator(f'section.mh-run[data-run="{RUN}"]')
            marker = run_panel.locator(f'.mh-config-event[data-step="{step}"] .mh-config-whatif')
            expect(marker).to_contain_text("predicted", timeout=LIVE_TIMEOUT_MS)
            expect(marker).to_contain_text("measured")
            # The charts' marker of the change carries it in its tooltip.
            chart_marker = run_panel.locator(
                f'.mh-tier-cell[data-tier="device"] .mh-marker[data-step="{step}"]'
            )
            expect(chart_marker).to_have_attribute(
                "title", re.compile("predicted .* measured"), timeout=LIVE_TIMEOUT_MS
            )
            assert [c for c in console if c.startswith(("error", "pageerror"))] == []
        finally:
            page.context.close()
