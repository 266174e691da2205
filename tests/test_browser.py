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


TIER_HEADS = """
(cells) => cells.map((c) => ({
  tier: c.dataset.tier,
  title: c.querySelector('.mh-tier-title').textContent,
  notes: c.querySelector('.mh-tier-notes').textContent,
  canvases: c.querySelectorAll('canvas').length,
}))
"""

# The figures a view's summary line shows: metric -> {text, value (data-value)}.
READ_SUMMARY = """
(p) => ({
  step: p.dataset.step,
  metrics: Object.fromEntries([...p.querySelectorAll('.mh-metric')].map((m) => [
    m.dataset.metric,
    {text: m.querySelector('.mh-metric-value').textContent, value: m.dataset.value ?? null},
  ])),
})
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
        # One chart per tier, with its own header; the stand-in is named on its chart.
        alpha = frame.locator(f'section.mh-run[data-run="{synthetic.RUN_STANDIN}"]')
        heads = alpha.locator(".mh-tier-cell").evaluate_all(TIER_HEADS)
        assert heads == [
            {
                "tier": "device",
                "title": "device (CPU stand-in)",
                # Each device peak and limit named by what it measures.
                "notes": "peak 113 MiB · pool pages + gradient shards (in step) 114 MiB · "
                "TensorFlow allocator peak (in step) 114 MiB · pool budget (device_budget_bytes) "
                "256 MiB",
                "canvases": 1,
            },
            {
                "tier": "host",
                "title": "host",
                "notes": "peak 708 MiB · in-step peak 709 MiB · capacity 4 GiB",
                "canvases": 1,
            },
            {
                "tier": "nvme",
                "title": "nvme",
                "notes": "peak 784 MiB · in-step peak 785 MiB · capacity unbounded",
                "canvases": 1,
            },
        ]
        device_legend = alpha.locator('.mh-tier-cell[data-tier="device"] .u-legend')
        device_labels = ("param", "grad", "other", "used", "pool budget", "allocator in use")
        peaks = ("pool pages + gradient shards (in step)", "TensorFlow allocator peak (in step)")
        for label in (*device_labels, *peaks):
            expect(device_legend).to_contain_text(label)
        # Axis titles, and a legend readable without hovering: the last step's values.
        device_cell = alpha.locator('.mh-tier-cell[data-tier="device"]')
        expect(device_cell.locator("[data-axis-titles]")).to_have_attribute(
            "data-axis-titles", "step | bytes on the tier"
        )
        values = dict(
            device_legend.locator("tr.u-series").evaluate_all(
                "(rows) => rows.map((r) => [r.querySelector('.u-label')?.textContent,"
                " r.querySelector('.u-value')?.textContent])"
            )
        )
        assert values["step"] == str(last), values
        assert values["used"] == "113 MiB", values
        expect(alpha.locator('.mh-tier-cell[data-tier="host"] .u-legend')).to_contain_text(
            "process RSS"
        )
        expect(alpha.locator('.mh-tier-cell[data-tier="nvme"] .u-legend')).to_contain_text(
            "on disk"
        )
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


# The plugin frame's data requests (route names), sent before and after the first paint
# mark, from the frame's resource timing entries.
REQUESTS_AROUND_PAINT = """
() => {
  const paint = performance.getEntriesByName('mh-first-meaningful-paint')[0].startTime;
  const routes = {before: [], after: []};
  for (const e of performance.getEntriesByType('resource')) {
    const m = e.name.match(/\\/data\\/plugin\\/memory_hierarchy\\/([a-z_]+)(\\?|$)/);
    if (m && m[1] !== 'index') (e.startTime < paint ? routes.before : routes.after).push(m[1]);
  }
  return routes;
}
"""


def test_first_paint_takes_one_request_for_listing_and_first_panels(
    browser, tensorboard_server, synthetic_logdir
):
    """GET /first_view brings the listing and the first panels' tier data: until the tier
    charts have drawn, the view sends no /runs, /series or /json request of its own."""
    require_built_frontend()
    server = tensorboard_server(synthetic_logdir, load_fast=True)
    page, frame, console = open_view(browser, server)
    try:
        expect(frame.locator("body[data-first-paint=done]")).to_have_count(
            1, timeout=LOAD_TIMEOUT_MS
        )
        assert frame.locator("body").get_attribute("data-first-paint-runs") == str(
            len(synthetic.RUNS)
        )
        # Round 2 (page moves, step time, placement) is fetched after the paint.
        expect(frame.locator(".mh-placement tbody tr")).to_have_count(9, timeout=LOAD_TIMEOUT_MS)
        routes = plugin_frame(page).evaluate(REQUESTS_AROUND_PAINT)
        assert routes["before"] == ["first_view"]
        assert "series" in routes["after"] and "json" in routes["after"]
        assert "first_view" not in routes["after"]
        assert [c for c in console if c.startswith(("error", "pageerror"))] == []
    finally:
        page.context.close()


# -- the other views (one page load against the shared load_fast server) ------------------

DOCS = REPO / "docs"
ALPHA = f'section.mh-run[data-run="{synthetic.RUN_STANDIN}"]'
# The beta run's name is HTML; its panel is selected by position (runs sort by name).
BETA = ".mh-runs > section.mh-run:nth-child(2)"
CHARTS_PER_ALPHA_PANEL = 3 + 3 + 2  # tiers, page moves, step time
SCREENSHOTS = {
    "tiers": f'{ALPHA} .mh-section[data-view="tiers"]',
    "pages": f'{ALPHA} .mh-section[data-view="pages"]',
    "timing": f'{ALPHA} .mh-section[data-view="timing"]',
    "placement": f'{ALPHA} .mh-section[data-view="placement"]',
    "config": f'{ALPHA} .mh-section[data-view="config"]',
    "runs": "fieldset.mh-runs-selector",
    "overlay": "section.mh-overlay",
    "oom": f'{ALPHA} .mh-section[data-view="oom"]',
}


@pytest.fixture(scope="module")
def views_page(browser, tensorboard_server, synthetic_logdir):
    """The tab over the synthetic logdir (load_fast), loaded once for the view tests."""
    require_built_frontend()
    server = tensorboard_server(synthetic_logdir, load_fast=True)
    page, frame, console = open_view(browser, server)
    last = synthetic.NUM_STEPS - 1
    expect(frame.locator(f'section.mh-run .mh-readout[data-step="{last}"]')).to_have_count(
        len(synthetic.RUNS), timeout=LOAD_TIMEOUT_MS
    )
    expect(frame.locator(".mh-placement tbody tr")).to_have_count(9, timeout=LOAD_TIMEOUT_MS)
    yield page, frame, console, server
    page.context.close()


def placement_names(frame, panel: str) -> list[str]:
    """The variable names of a panel's placement table, top to bottom, as shown."""
    return frame.locator(f"{panel} .mh-placement tbody tr td.mh-col-name").all_text_contents()


def test_page_moves_view_shows_directions_hit_rate_and_stall(views_page):
    _page, frame, _console, _server = views_page
    last = synthetic.NUM_STEPS - 1  # 49: h2d 1 page, d2h 1 page, 3 hits of 4
    summary = frame.locator(f'{ALPHA} .mh-section[data-view="pages"] .mh-summary')
    got = summary.evaluate(READ_SUMMARY)
    assert got["step"] == str(last)
    metrics = got["metrics"]
    assert metrics["h2d_bytes"] == {"text": "1 pages, 1 MiB", "value": str(2**20)}
    assert metrics["d2h_bytes"] == {"text": "1 pages, 1 MiB", "value": str(2**20)}
    assert metrics["n2h_bytes"] == {"text": "0 pages, 0 B", "value": "0"}
    assert metrics["prefetch_hit_rate"]["text"] == "75%"
    assert float(metrics["prefetch_hit_rate"]["value"]) == synthetic.prefetch_hit_rate(
        synthetic.RUN_STANDIN, last
    )
    assert metrics["stall_seconds"] == {"text": "2 ms", "value": "0.002"}
    section = frame.locator(f'{ALPHA} .mh-section[data-view="pages"]')
    expect(section.locator("canvas")).to_have_count(3)
    legends = section.locator(".u-legend").all_text_contents()
    assert "host→device" in legends[0] and "nvme→host" in legends[0]
    assert "prefetch hit rate" in legends[2] and "stall" in legends[2]
    beta = frame.locator(f'{BETA} .mh-section[data-view="pages"]')
    expect(beta.locator(".mh-note")).to_have_text("No page moves recorded for this run.")
    expect(beta.locator("canvas")).to_have_count(0)


def test_step_time_view_names_unmeasured_parts(views_page):
    _page, frame, _console, _server = views_page
    alpha = frame.locator(f'{ALPHA} .mh-section[data-view="timing"]')
    metrics = alpha.locator(".mh-summary").evaluate(READ_SUMMARY)["metrics"]
    assert metrics["compute_seconds"]["text"] == "60 ms"
    assert metrics["comm_seconds"]["text"] == "40 ms"
    assert metrics["overlap_seconds"]["text"] == "30 ms"
    assert metrics["stall_seconds"]["text"] == "2 ms"
    assert metrics["step_seconds"]["text"] == "149 ms"  # 0.1 + 0.001 * 49 s
    assert metrics["overlap_ratio"] == {"text": "75%", "value": "0.75"}
    assert metrics["io_seconds"]["text"] == "10 ms"
    expect(alpha.locator("canvas")).to_have_count(2)
    expect(alpha.locator(".mh-missing")).to_be_hidden()
    # Step 0 traced the step function (4 s): drawn, marked, and kept out of the y-range.
    expect(alpha.locator(".mh-note:not([hidden])").first).to_have_text(
        "Step 0 traced (compiled) the step function (4 s); the y-axis scales to the other steps."
    )
    traced = alpha.locator('.mh-marker-traced[data-step="0"]')
    expect(traced).to_have_count(1)
    assert "traced the step function" in traced.get_attribute("title")
    y_max = float(alpha.locator(".mh-plot").first.get_attribute("data-y-max"))
    assert y_max == pytest.approx(0.149)  # the largest untraced value: step 49, 149 ms
    beta = frame.locator(f'{BETA} .mh-section[data-view="timing"]')
    metrics = beta.locator(".mh-summary").evaluate(READ_SUMMARY)["metrics"]
    assert metrics["step_seconds"]["text"] == "149 ms"
    for part in (
        "compute_seconds",
        "comm_seconds",
        "overlap_seconds",
        "stall_seconds",
        "io_seconds",
    ):
        assert metrics[part] == {"text": "not measured", "value": None}, part
    expect(beta.locator(".mh-missing")).to_have_text(
        "Not measured: compute, communication, overlapped, stall, NVMe I/O, overlap ratio."
    )
    expect(beta.locator(".mh-note:not([hidden])")).to_have_text("Overlap ratio: not measured.")
    # Only the measured series is drawn: one canvas (the breakdown), no zero lines.
    expect(beta.locator("canvas")).to_have_count(1)
    legend = beta.locator(".u-legend").first.text_content()
    assert "step total" in legend and "compute" not in legend


def test_placement_table_sorts_and_filters(views_page):
    _page, frame, _console, _server = views_page
    table = frame.locator(f"{ALPHA} .mh-placement")
    # Default: largest first.
    assert placement_names(frame, ALPHA) == [
        "embedding/embeddings",
        "lm_head/kernel",
        "dense/kernel",
        "dense/bias",
    ]
    first = table.locator("tbody tr").first.locator("td").all_text_contents()
    assert first == [
        "embedding/embeddings",
        "1000×512",
        "float32",
        "1.95 MiB",
        "optimizer state sharded 1/2 (ZeRO-1)",
        "1000 KiB",
        "device",
        "device",
        "nvme",
    ]
    name_header = table.locator('th[data-key="name"]')
    name_header.click()
    assert placement_names(frame, ALPHA) == sorted(placement_names(frame, ALPHA))
    expect(name_header).to_have_attribute("aria-sort", "ascending")
    name_header.click()
    expect(name_header).to_have_attribute("aria-sort", "descending")
    assert placement_names(frame, ALPHA) == [
        "lm_head/kernel",
        "embedding/embeddings",
        "dense/kernel",
        "dense/bias",
    ]
    table.locator('th[data-key="shape"]').click()  # by element count, ascending
    assert placement_names(frame, ALPHA)[0] == "dense/bias"
    search = frame.locator(f"{ALPHA} .mh-placement-filter")
    search.fill("nvme")
    assert placement_names(frame, ALPHA) == ["embedding/embeddings"]
    expect(frame.locator(f"{ALPHA} .mh-placement-count")).to_have_text("1 of 4 variables")
    search.fill("dense host")
    assert placement_names(frame, ALPHA) == ["dense/bias", "dense/kernel"]
    search.fill("")
    expect(frame.locator(f"{ALPHA} .mh-placement-count")).to_have_text("4 of 4 variables")
    # The HTML-looking variable name of the other run is text.
    assert synthetic.HTML_VARIABLE in placement_names(frame, BETA)
    assert frame.locator(f"{BETA} .mh-placement img").count() == 0


def test_predicted_versus_measured_and_config_markers(views_page):
    page, frame, console, _server = views_page
    rows = frame.locator(f"{ALPHA} .mh-estimate tr[data-tier]")
    expect(rows).to_have_count(3)
    expect(frame.locator(f"{ALPHA} .mh-estimate caption")).to_have_text(
        "Predicted: the estimator’s bytes per tier for this config and model, computed "
        f"before training. Measured: step {synthetic.NUM_STEPS - 1}, the last recorded — "
        "parameters + gradients + optimizer states per tier, and the peak inside that step."
    )
    device = frame.locator(f'{ALPHA} .mh-estimate tr[data-tier="device"]')
    assert device.get_attribute("data-predicted-bytes") == str(100 * 2**20)
    # Measured model states = param + grad + optimizer = 7/8 of the synthetic tier's use.
    assert device.get_attribute("data-measured-bytes") == str(113 * 2**20 * 7 // 8)
    # Then the estimate's in-step peak against the measured one (pool and allocator peaks
    # of the last step: 113 + 1 MiB on the device, 708 + 1 MiB on the host).
    assert device.get_attribute("data-measured-peak-bytes") == str(114 * 2**20)
    assert device.locator("td").all_text_contents() == [
        "100 MiB",
        "98.9 MiB",
        "98.9%",
        "150 MiB",
        "114 MiB",
        "76%",
    ]
    host = frame.locator(f'{ALPHA} .mh-estimate tr[data-tier="host"]')
    assert host.locator("td").all_text_contents() == [
        "640 MiB",
        "620 MiB",
        "96.8%",
        "640 MiB",
        "709 MiB",
        "111%",
    ]
    expect(frame.locator(f"{BETA} .mh-estimate")).to_have_text("No estimate recorded for this run.")
    # Config changes: listed, and a marker at their steps on every chart of the run.
    items = frame.locator(f"{ALPHA} .mh-config-event").evaluate_all(
        "(lis) => lis.map((li) => [li.dataset.step, li.querySelector('.mh-config-step')"
        ".textContent, li.querySelector('.mh-config-label').textContent])"
    )
    assert items == [
        ["10", "step 10", "prefetch_depth: 1 → 2"],
        ["30", "step 30", "prefetch_depth: 3 → 4"],
    ]
    for step in (10, 30):
        # A config change is marked on every chart (markers without a kind); step 30 is
        # also where the synthetic job resumed after a resize, marked on the step-time charts.
        config_markers = f'{ALPHA} .mh-marker:not([data-kind])[data-step="{step}"]'
        expect(frame.locator(config_markers)).to_have_count(CHARTS_PER_ALPHA_PANEL)
    resized = frame.locator(f'{ALPHA} .mh-marker[data-kind="resize"][data-step="30"]')
    expect(resized).to_have_count(2)  # the two step-time charts
    marker = frame.locator(f'{ALPHA} .mh-tier-cell[data-tier="device"] .mh-marker').first
    assert marker.get_attribute("title") == "step 10: prefetch_depth: 1 → 2"
    assert marker.bounding_box()["height"] > 100  # a vertical line across the plot
    beta_item = frame.locator(f"{BETA} .mh-config-event .mh-config-label")
    expect(beta_item).to_have_text("<b>offload</b> optimizer to nvme")  # text, not HTML
    expect(frame.locator(f'{BETA} .mh-marker[data-step="20"]')).to_have_count(3 + 1)
    in_frame = plugin_frame(page)
    assert in_frame.evaluate("window.__xss") is None
    assert in_frame.evaluate("window.__cspViolations") == []
    assert [c for c in console if c.startswith(("error", "pageerror"))] == []


def test_export_links_download_csv_and_json(views_page):
    page, frame, _console, _server = views_page
    links = frame.locator(f'{ALPHA} .mh-section[data-view="tiers"] a.mh-export')
    expect(links).to_have_count(8)  # tiers and readings: CSV, JSON x shown, every step
    full_csv = frame.locator(
        f'{ALPHA} .mh-section[data-view="tiers"] a.mh-export[data-format="csv"][data-scope="full"]'
    ).first
    assert full_csv.text_content() == "tiers CSV (every step)"
    response = page.request.get(full_csv.get_attribute("href"))
    assert response.status == 200
    assert response.headers["content-type"] == "text/csv; charset=utf-8"
    assert response.headers["content-disposition"].startswith(
        'attachment; filename="alpha_tiers_full.csv"'
    )
    lines = response.text().splitlines()
    assert len(lines) == 1 + synthetic.NUM_STEPS
    pages_links = frame.locator(f'{ALPHA} .mh-section[data-view="pages"] a.mh-export')
    shown_json = pages_links.and_(frame.locator('[data-format="json"][data-scope="shown"]'))
    response = page.request.get(shown_json.get_attribute("href"))
    assert response.status == 200
    body = response.json()
    assert body["tag"] == "memory_hierarchy/pages" and len(body["steps"]) == synthetic.NUM_STEPS
    placement_csv = frame.locator(
        f'{ALPHA} .mh-section[data-view="placement"] a.mh-export[data-format="csv"]'
    )
    response = page.request.get(placement_csv.get_attribute("href"))
    assert response.status == 200 and response.text().count("\n") == 1 + 4


def test_run_selector_hides_and_shows_runs_and_the_overlay(views_page):
    _page, frame, _console, _server = views_page
    overlay = frame.locator("section.mh-overlay")
    expect(overlay).to_be_visible()
    expect(overlay.locator("canvas")).to_have_count(3)
    legend = overlay.locator(".u-legend").first
    expect(legend).to_contain_text(synthetic.RUN_STANDIN)
    expect(legend).to_contain_text(synthetic.RUN_HTML_NAME)
    # Screenshots of every view while both runs are shown.
    for name, selector in SCREENSHOTS.items():
        frame.locator(selector).first.screenshot(path=str(DOCS / f"screenshot_{name}.png"))
    checkbox = frame.locator(
        f'label.mh-run-option[data-run="{synthetic.RUN_STANDIN}"] input[type="checkbox"]'
    )
    expect(checkbox).to_be_checked()
    checkbox.uncheck()
    expect(frame.locator("section.mh-run")).to_have_count(1)
    expect(frame.locator(ALPHA)).to_have_count(0)
    expect(overlay).to_be_hidden()
    frame.locator("button.mh-select-all").click()
    expect(frame.locator("section.mh-run")).to_have_count(2)
    expect(frame.locator(f"{ALPHA} .mh-readout")).to_have_attribute(
        "data-step", str(synthetic.NUM_STEPS - 1)
    )
    frame.locator(".mh-run-filter").fill("^alp")
    expect(frame.locator("label.mh-run-option:visible")).to_have_count(1)
    frame.locator(".mh-run-filter").fill("")


def test_oom_postmortem_panel_shows_request_tiers_holders_history_and_advice(views_page):
    page, frame, console, _server = views_page
    want = synthetic.oom_postmortem(synthetic.OOM_RUN)
    oom = frame.locator(f'{ALPHA} .mh-section[data-view="oom"]')
    expect(oom).to_be_visible()
    expect(oom).to_have_attribute("data-step", str(synthetic.OOM_STEP))
    expect(oom.locator(".mh-oom-headline")).to_have_text(
        "Out of memory at step 49 on device (CPU stand-in): 96 MiB requested."
    )
    expect(oom.locator(".mh-oom-summary")).to_have_text(want["summary"])
    request = oom.locator(".mh-oom-request")
    expect(request).to_have_attribute("data-bytes", str(96 * 2**20))
    facts = request.locator(".mh-oom-fact").evaluate_all(
        "(items) => items.map((i) => [i.dataset.fact, i.querySelector('dd').textContent])"
    )
    assert facts == [
        ["bytes", "96 MiB (100663296 bytes)"],
        ["tier", "device"],
        ["tensor", "adam/m/dense_kernel:shard1"],
        ["op", "page_in"],
        ["error", "PoolOutOfMemoryError"],
    ]
    # The raw error text is folded under a toggle, shown on click.
    details = request.locator("details.mh-oom-details")
    expect(details).not_to_have_attribute("open", "")
    expect(details.locator(".mh-oom-message")).to_be_hidden()
    details.locator("summary").click()
    expect(details.locator(".mh-oom-message")).to_have_text(want["failed_request"]["message"])
    tiers = oom.locator(".mh-oom-tier").evaluate_all(
        "(rows) => rows.map((r) => [r.dataset.tier, r.querySelector('.mh-oom-tier-text')"
        ".textContent, parseFloat(r.querySelector('.mh-oom-fill').style.width), "
        "r.classList.contains('mh-oom-failed-tier')])"
    )
    assert [t[:2] + t[3:] for t in tiers] == [
        ["device", "250 MiB of 256 MiB (97.7%)", True],
        ["host", "708 MiB of 4 GiB (17.3%)", False],
        ["nvme", "0 B used (capacity unbounded)", False],
    ]
    widths = [t[2] for t in tiers]  # the bars: used / capacity, percent of the track
    assert widths[0] == pytest.approx(100 * 250 / 256, abs=0.01)
    assert widths[1] == pytest.approx(100 * 708 / 4096, abs=0.01)
    assert widths[2] == 0
    holders = oom.locator(".mh-oom-holders tr[data-tier] td.mh-oom-holder-name")
    assert holders.all_text_contents() == [
        "adam/m",
        "params",
        "grads",
        "adam/v",
        synthetic.HTML_HOLDER,  # shown as text, not run as HTML
    ]
    assert oom.locator("img").count() == 0
    # One panel per tier, each with its own scale (one shared axis would be set by the
    # host's capacity and flatten the device and NVMe lines at zero).
    panels = oom.locator(".mh-oom-recent-tier")
    expect(panels).to_have_count(3)
    assert panels.evaluate_all("(c) => c.map((e) => e.dataset.tier)") == ["device", "host", "nvme"]
    recent = panels.first.locator(".mh-plot")
    expect(recent).to_have_attribute("data-points", str(synthetic.OOM_RECENT_STEPS))
    expect(recent.locator("canvas")).to_have_count(1)
    expect(recent.locator(".u-legend")).to_contain_text("device (CPU stand-in) used")
    expect(panels.nth(1).locator(".mh-tier-notes")).to_contain_text("(off scale)")
    advice = oom.locator(".mh-oom-advice-item")
    expect(advice).to_have_count(3)
    assert advice.evaluate_all("(lis) => lis.map((li) => li.dataset.rank)") == ["1", "2", "3"]
    top = advice.first
    expect(top.locator(".mh-oom-advice-desc")).to_have_text(
        "Keep the optimizer states in host memory"
    )
    expect(top.locator(".mh-oom-advice-change")).to_have_text("offload_optimizer = cpu")
    expect(top.locator(".mh-oom-advice-meta")).to_have_text("frees 40 MiB · fits · speed cost low")
    # A report with verdicts (docs/oom.md) shows "may fit" and the missing bytes; one
    # without (older runs) falls back to the fits flag.
    expect(advice.nth(2).locator(".mh-oom-advice-meta")).to_contain_text("may fit (8")
    assert advice.evaluate_all("(lis) => lis.map((li) => li.dataset.verdict)") == [
        "fits",
        "fits",
        "may fit",
    ]
    # The other run recorded no post-mortem: no OOM section shown.
    expect(frame.locator(f'{BETA} .mh-section[data-view="oom"]')).to_be_hidden()
    in_frame = plugin_frame(page)
    assert in_frame.evaluate("window.__xss") is None
    assert [c for c in console if c.startswith(("error", "pageerror"))] == []
    oom.screenshot(path=str(DOCS / "screenshot_oom.png"))


def test_tuning_panel_is_read_only_and_says_how_to_enable_when_the_flag_is_off(views_page):
    _page, frame, _console, _server = views_page
    # The stand-in run ended with its OOM post-mortem: nothing to tune, and it says so.
    dead = frame.locator(f"{ALPHA} .mh-tuning")
    expect(dead).to_have_attribute("data-job-ended", "true")
    expect(dead.locator(".mh-tuning-note")).to_contain_text(
        f"This job ended with an out-of-memory failure at step {synthetic.OOM_STEP}"
    )
    # Read-only: the settings are shown (as the note says), with no inputs and no button.
    expect(dead.locator("tr[data-key]").first).to_be_visible()
    expect(dead.locator("button.mh-tuning-submit")).to_be_hidden()
    assert dead.locator("input").count() == 0
    panel = frame.locator(f"{BETA} .mh-tuning")
    expect(panel).to_have_attribute("data-enabled", "false")
    expect(panel).to_have_attribute("data-job-ended", "false")
    expect(panel.locator(".mh-tuning-note")).to_contain_text(
        "Live tuning is off in this TensorBoard: restart it with --memory_hierarchy_tuning"
    )
    expect(panel.locator("button.mh-tuning-submit")).to_be_hidden()
    assert panel.locator("input").count() == 0
    rows = panel.locator("tr[data-key]")
    expect(rows).to_have_count(7)
    telemetry = panel.locator('tr[data-key="telemetry_every_n_steps"]')
    expect(telemetry.locator(".mh-tuning-bounds")).to_have_text("1 … 1,000,000 (steps)")
    expect(telemetry.locator(".mh-tuning-effect")).to_have_text("next step")
    plan = panel.locator('tr[data-key="persistence_threshold"] .mh-tuning-effect')
    expect(plan).to_have_attribute("data-rebuild", "true")
    expect(plan).to_have_text("rebuild (stage 3's traced plan)")
    expect(telemetry.locator(".mh-tuning-current")).to_have_text("not recorded")
    expect(panel.locator(".mh-tuning-state")).to_have_text("No live-tuning request yet.")


# What the Checkpoints table of a panel shows, row by row.
READ_CHECKPOINTS = """
(rows) => rows.map((r) => ({
  step: r.dataset.step,
  op: r.dataset.op,
  bytes: r.dataset.bytes ?? null,
  mbPerSecond: r.dataset.mbPerSecond ?? null,
  cells: [...r.querySelectorAll('td')].map((td) => td.textContent),
}))
"""


def test_checkpoints_table_and_step_time_markers_in_every_selected_run(views_page):
    page, frame, console, _server = views_page
    expect(frame.locator("section.mh-overlay")).to_be_visible()  # both runs selected
    rows = frame.locator(f'{ALPHA} .mh-section[data-view="checkpoints"] tr.mh-checkpoint')
    expect(rows).to_have_count(2)
    assert rows.evaluate_all(READ_CHECKPOINTS) == [
        {
            "step": "15",
            "op": "save",
            "bytes": str(48 * 2**20),
            "mbPerSecond": "201.326592",  # 48 MiB / 0.25 s in 10^6 B/s
            "cells": ["15", "save", "step00000015", "48 MiB", "250 ms", "201.3"],
        },
        {
            "step": "35",
            "op": "save",
            "bytes": str(48 * 2**20),
            "mbPerSecond": "100.663296",
            "cells": ["35", "save", "step00000035", "48 MiB", "500 ms", "100.7"],
        },
    ]
    # A marker on both step-time charts (breakdown, overlap ratio) at each checkpoint step.
    timing = frame.locator(f'{ALPHA} .mh-section[data-view="timing"]')
    for step in (15, 35):
        expect(timing.locator(f'.mh-marker-checkpoint[data-step="{step}"]')).to_have_count(2)
    marker = timing.locator('.mh-marker[data-kind="checkpoint"][data-step="15"]').first
    assert marker.get_attribute("title") == "step 15: checkpoint save step00000015 (48 MiB)"
    assert marker.bounding_box()["height"] > 80  # a line across the 180-px chart's plot
    # The config markers stay on the step-time charts too; the tier charts get no
    # checkpoint markers.
    expect(timing.locator('.mh-marker[data-step="10"]:not([data-kind])')).to_have_count(2)
    expect(
        frame.locator(f'{ALPHA} .mh-section[data-view="tiers"] .mh-marker-checkpoint')
    ).to_have_count(0)
    # The other selected run: its own records; an HTML tag is shown as text.
    beta_rows = frame.locator(f'{BETA} .mh-section[data-view="checkpoints"] tr.mh-checkpoint')
    expect(beta_rows).to_have_count(2)
    cells = beta_rows.evaluate_all(READ_CHECKPOINTS)
    assert [c["cells"] for c in cells] == [
        ["25", "save", synthetic.HTML_CHECKPOINT_TAG, "12 MiB", "125 ms", "100.7"],
        ["45", "restore", "step00000045", "12 MiB", "62.5 ms", "201.3"],
    ]
    beta_timing = frame.locator(f'{BETA} .mh-section[data-view="timing"]')
    for step in (25, 45):
        expect(beta_timing.locator(f'.mh-marker-checkpoint[data-step="{step}"]')).to_have_count(1)
    assert frame.locator(f"{BETA} .mh-checkpoints b").count() == 0
    assert plugin_frame(page).evaluate("window.__xss") is None
    assert [c for c in console if c.startswith(("error", "pageerror"))] == []


# A restarts table's rows as data: data-* attributes and the cells' text.
READ_RESTARTS = """
(rows) => rows.map((r) => ({
  step: r.dataset.step,
  kind: r.dataset.kind,
  stepsLost: r.dataset.stepsLost ?? null,
  cells: [...r.querySelectorAll('td')].map((c) => c.textContent),
}))
"""


def test_restart_and_resize_markers_and_the_goodput_figure(views_page):
    """The job's restart events file (zero-runtime launch --logdir): a marker on the
    step-time charts at each step the job resumed at, with its cause and what it lost, a
    row per restart or resize, and the goodput figure."""
    page, frame, console, _server = views_page
    timing = frame.locator(f'{ALPHA} .mh-section[data-view="timing"]')
    expect(timing.locator('.mh-marker-restart[data-step="20"]')).to_have_count(2)
    for step in (30, 40):
        expect(timing.locator(f'.mh-marker-resize[data-step="{step}"]')).to_have_count(2)
    marker = timing.locator('.mh-marker[data-kind="restart"][data-step="20"]').first
    assert marker.get_attribute("title") == (
        "step 20: restart: restart 1/3 after rank 1: killed by SIGKILL; lost 2 steps and "
        "15.0 s; 9.0 s to the first new step"
    )
    assert marker.bounding_box()["height"] > 80
    section = frame.locator(f'{ALPHA} .mh-section[data-view="restarts"]')
    goodput = section.locator("p.mh-goodput")
    want = synthetic.goodput(synthetic.RUN_STANDIN)  # 49 of 52 steps, 24.5 of 100 s
    expect(goodput).to_have_attribute("data-steps-ratio", str(want["steps_ratio"]))
    assert goodput.get_attribute("data-time-ratio") == str(want["time_ratio"])
    assert goodput.text_content() == (
        "Goodput: 94.2% of steps (49 kept of 52 run), 24.5% of time (24.5 s on kept steps "
        "of 100 s); 2 restarts, 2 resizes"
    )
    rows = section.locator("tr.mh-restart").evaluate_all(READ_RESTARTS)
    assert [(r["step"], r["kind"], r["stepsLost"]) for r in rows] == [
        ("20", "restart", "2"),
        ("30", "resize", "1"),
        ("40", "resize", "0"),
    ]
    assert rows[1]["cells"][2:] == [
        "1",
        "restart 2/3 after rank 1: killed by SIGKILL; resize 2 -> 1 workers: rank 1 failed 2 "
        "time(s) in a row",
        "1",
        "12.5 s",
        "9 s",
    ]
    # The other run: its cause, which is also HTML, shown as text.
    beta = frame.locator(f'{BETA} .mh-section[data-view="restarts"] td.mh-restart-cause')
    expect(beta).to_have_text(synthetic.HTML_CAUSE)
    assert plugin_frame(page).evaluate("window.__xss") is None
    assert [c for c in console if c.startswith(("error", "pageerror"))] == []
