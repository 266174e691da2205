"""End-to-end: the Memory Hierarchy tab in a real TensorBoard, in a real headless Chromium.

Each test runs against both data paths, ``--load_fast=true`` (Rust data server) and
``--load_fast=false`` (Python multiplexer). The view exposes the last step's values as text
and as data-* attributes (see frontend/src/views/run_panel.js), which is what is read here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import synthetic
from playwright.sync_api import expect

from tb_plugin import plugin

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
SCREENSHOT = REPO / "docs" / "screenshot_tier_occupancy.png"
PLUGIN_FRAME = 'iframe[src*="plugin_entry.html?name=memory_hierarchy"]'
LOAD_TIMEOUT_MS = 60_000  # first load: TensorBoard's first reload of the logdir included
LIVE_TIMEOUT_MS = 45_000  # reload interval (1 s) + the view's poll (5 s), on a busy machine

# Records Content-Security-Policy violations in every frame, before any page script runs.
CSP_RECORDER = """
window.__cspViolations = [];
document.addEventListener('securitypolicyviolation', (e) => {
  window.__cspViolations.push(`${e.violatedDirective} ${e.blockedURI}`);
});
"""

# What a reader of each run's panel sees, as plain data.
READ_PANELS = """
(sections) => sections.map((s) => ({
  run: s.dataset.run,
  name: s.querySelector('.mh-run-name').textContent,
  facts: s.querySelector('.mh-facts').innerText,
  standin: s.querySelector('.mh-standin')?.textContent ?? null,
  status: s.querySelector('.mh-status').textContent,
  points: s.querySelector('.mh-chart').dataset.points,
  firstStep: s.querySelector('.mh-chart').dataset.firstStep,
  lastStep: s.querySelector('.mh-chart').dataset.lastStep,
  canvases: s.querySelectorAll('.mh-chart canvas').length,
  imgs: s.querySelectorAll('img').length,
  step: s.querySelector('.mh-readout').dataset.step,
  caption: s.querySelector('.mh-readout caption')?.textContent,
  tiers: Object.fromEntries([...s.querySelectorAll('.mh-readout tr[data-tier]')].map((r) => [
    r.dataset.tier,
    {
      label: r.querySelector('.mh-tier').textContent,
      usedText: r.querySelector('.mh-used').textContent,
      capacityText: r.querySelector('.mh-capacity').textContent,
      used: r.dataset.usedBytes ?? null,
      capacity: r.dataset.capacityBytes ?? null,
    },
  ])),
}))
"""


def require_built_frontend() -> None:
    """Fail (not skip) when the frontend bundle is missing."""
    if not os.path.isfile(os.path.join(plugin.STATIC_DIR, "index.js")):
        pytest.fail(
            "tb_plugin/static/index.js is missing: the frontend is not built. "
            "Run scripts/setup.sh (it runs `npm ci && npm run build` in frontend/)."
        )


def open_view(browser, server):
    """Open the Memory Hierarchy tab; returns (page, plugin frame locator, console log)."""
    context = browser.new_context(viewport={"width": 1280, "height": 1400})
    context.add_init_script(CSP_RECORDER)
    page = context.new_page()
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    page.goto(f"{server.url}/#memory_hierarchy")
    return page, page.frame_locator(PLUGIN_FRAME), console


def plugin_frame(page):
    """The plugin iframe's Frame (for evaluating scripts in it)."""
    return next(f for f in page.frames if "plugin_entry.html?name=memory_hierarchy" in f.url)


@pytest.mark.parametrize("load_fast", [True, False], ids=["load_fast", "python_loader"])
def test_tier_occupancy_chart_shows_every_run(
    browser, tensorboard_server, synthetic_logdir, load_fast
):
    require_built_frontend()
    server = tensorboard_server(synthetic_logdir, load_fast=load_fast)
    page, frame, console = open_view(browser, server)
    try:
        last = synthetic.NUM_STEPS - 1
        readouts = frame.locator(f'section.mh-run .mh-readout[data-step="{last}"]')
        expect(readouts).to_have_count(len(synthetic.RUNS), timeout=LOAD_TIMEOUT_MS)
        panels = frame.locator("section.mh-run").evaluate_all(READ_PANELS)
        assert sorted(p["run"] for p in panels) == sorted(synthetic.RUNS)
        for panel in panels:
            run = panel["run"]
            want = synthetic.tiers(run, last)
            info = synthetic.run_info(run)
            assert panel["name"] == run  # the HTML-looking name shown as text
            assert panel["imgs"] == 0
            assert panel["status"] == ""
            assert panel["canvases"] >= 1
            assert (panel["points"], panel["firstStep"], panel["lastStep"]) == ("50", "0", "49")
            assert (panel["step"], panel["caption"]) == (str(last), f"Step {last}")
            assert f"ZeRO stage: {info['stage']}" in panel["facts"]
            assert f"replicas: {info['num_replicas']}" in panel["facts"]
            tiers = panel["tiers"]
            for tier in ("device", "host", "nvme"):
                assert float(tiers[tier]["used"]) == want[tier]["used_bytes"]
            assert float(tiers["device"]["used"]) > 0 and float(tiers["host"]["used"]) > 0
            assert float(tiers["device"]["capacity"]) == want["device"]["capacity_bytes"]
            assert tiers["nvme"]["capacity"] is None
            assert tiers["nvme"]["capacityText"] == "unbounded"
            if run == synthetic.RUN_STANDIN:
                assert panel["standin"] == "device (CPU stand-in)"
                assert tiers["device"]["label"] == "device (CPU stand-in)"
                assert tiers["device"]["usedText"] == "113 MiB"  # (64 + 49) MiB
                assert tiers["host"]["usedText"] == "708 MiB"  # 512 + 4 * 49 MiB
                assert tiers["device"]["capacityText"] == "256 MiB"
                assert tiers["host"]["capacityText"] == "4 GiB"
            else:
                assert panel["standin"] is None
                assert tiers["device"]["label"] == "device"
                assert tiers["device"]["usedText"] == "226 MiB"  # 2 * (64 + 49) MiB
        # The chart's legend names the stand-in too.
        expect(frame.locator(".u-legend").first).to_contain_text("device (CPU stand-in) used")
        in_frame = plugin_frame(page)
        # uPlot's CSS (injected as <style>) applies under TensorBoard's CSP ...
        font = in_frame.evaluate("getComputedStyle(document.querySelector('.uplot')).fontFamily")
        assert font.startswith("system-ui")
        # ... and nothing was blocked, nothing injected from the run name ran.
        assert in_frame.evaluate("window.__cspViolations") == []
        assert page.evaluate("window.__cspViolations") == []
        assert in_frame.evaluate("window.__xss") is None
        errors = [c for c in console if c.startswith(("error", "pageerror"))]
        assert errors == []
        if load_fast:
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
    finally:
        page.context.close()


@pytest.mark.parametrize("load_fast", [True, False], ids=["load_fast", "python_loader"])
def test_new_steps_of_a_live_run_appear_without_reloading(
    browser, tensorboard_server, tmp_path, load_fast
):
    require_built_frontend()
    logdir = str(tmp_path / "live_logdir")
    run = synthetic.RUN_STANDIN
    synthetic.write_run(logdir, run, range(10))
    server = tensorboard_server(logdir, load_fast=load_fast, reload_interval=1)
    page, frame, _console = open_view(browser, server)
    try:
        readout = frame.locator("section.mh-run .mh-readout")
        expect(readout).to_have_attribute("data-step", "9", timeout=LOAD_TIMEOUT_MS)
        in_frame = plugin_frame(page)
        in_frame.evaluate("window.__sameDocument = true")
        synthetic.write_run(logdir, run, range(10, 20))  # the run goes on
        expect(readout).to_have_attribute("data-step", "19", timeout=LIVE_TIMEOUT_MS)
        assert in_frame.evaluate("window.__sameDocument") is True  # no reload happened
        device = frame.locator('.mh-readout tr[data-tier="device"]')
        want = synthetic.tiers(run, 19)["device"]["used_bytes"]
        assert float(device.get_attribute("data-used-bytes")) == want
        expect(frame.locator(".mh-chart")).to_have_attribute("data-points", "20")
    finally:
        page.context.close()
