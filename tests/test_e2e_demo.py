"""End to end: the demo trains under ZeRO stage 1, and a real TensorBoard shows its tiers.

One demo run per session (a real subprocess, as the README's main command runs it); a
real ``tensorboard`` on a free loopback port; the Memory Hierarchy tab in headless
Chromium (Debian's, through Playwright).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from playwright.sync_api import expect
from test_browser import open_view, plugin_frame, require_built_frontend

from tb_plugin import metadata

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
DEMO_STEPS = 30
RUN = "gpt_zero1"
SCREENSHOT = REPO / "docs" / "screenshot_stage1.png"  # the README's first picture: test_main_job


@pytest.fixture(scope="session")
def demo_logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log directory holding one real demo run of DEMO_STEPS steps."""
    logdir = tmp_path_factory.mktemp("demo_logs")
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-m", "demo.train", "--logdir", str(logdir), "--steps", str(DEMO_STEPS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{DEMO_STEPS} steps recorded" in proc.stdout, proc.stdout
    return logdir


def test_demo_writes_every_step(demo_logdir, plugin_client):
    """The plugin's data route returns every step of the demo with non-zero bytes."""
    client = plugin_client(str(demo_logdir))
    resp = client.get(
        "/data/plugin/memory_hierarchy/series", query_string={"run": RUN, "tag": metadata.TAG_TIERS}
    )
    assert resp.status_code == 200, resp.get_data(as_text=True)
    body = json.loads(resp.get_data(as_text=True))
    assert body["steps"] == list(range(DEMO_STEPS))
    device, host = body["values"]["device"], body["values"]["host"]
    assert all(v > 0 for v in device["used_bytes"])
    assert all(v > 0 for v in host["used_bytes"])
    # The host tier holds exactly the Adam moments of 137,216 parameters: 2 slots, 2 shards
    # of ceil(137216 / 2) elements; used adds the update's scratch buffers (other_bytes).
    assert host["optimizer_bytes"][-1] == 2 * 2 * 4 * (137_216 // 2)
    assert host["used_bytes"][-1] == host["optimizer_bytes"][-1] + host["other_bytes"][-1]
    assert host["other_bytes"][-1] > 0
    assert device["param_bytes"][-1] == 2 * 4 * 137_216


@pytest.mark.browser
def test_demo_in_the_memory_hierarchy_tab(demo_logdir, tensorboard_server, browser):
    """The tab in Chromium shows the demo's steps with non-zero device and host bytes."""
    require_built_frontend()
    server = tensorboard_server(str(demo_logdir), load_fast=True)
    page, frame, console = open_view(browser, server)
    try:
        last = DEMO_STEPS - 1
        readout = frame.locator(f'section.mh-run[data-run="{RUN}"] .mh-readout[data-step="{last}"]')
        expect(readout).to_have_count(1, timeout=60_000)
        chart = frame.locator(f'section.mh-run[data-run="{RUN}"] .mh-chart')
        assert chart.get_attribute("data-first-step") == "0"
        assert chart.get_attribute("data-last-step") == str(last)
        assert chart.get_attribute("data-points") == str(DEMO_STEPS)
        for tier in ("device", "host"):
            used = readout.locator(f'tr[data-tier="{tier}"]').get_attribute("data-used-bytes")
            assert float(used) > 0, tier
        # The stand-in is named once: the device fact says it, so no badge repeats it.
        facts = frame.locator(f'section.mh-run[data-run="{RUN}"] .mh-facts')
        expect(facts.locator('[data-fact="device"]')).to_have_text("device: device (CPU stand-in)")
        assert facts.inner_text().count("CPU stand-in") == 1, facts.inner_text()
        expect(frame.locator(f'section.mh-run[data-run="{RUN}"] .mh-facts')).to_contain_text(
            "ZeRO stage: 1"
        )
        assert plugin_frame(page).evaluate("window.__cspViolations") == []
        assert [c for c in console if c.startswith(("error", "pageerror"))] == []
        page.screenshot(path=str(SCREENSHOT), full_page=True)
    finally:
        page.context.close()
