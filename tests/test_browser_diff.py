"""End-to-end: "Compare runs" in a real TensorBoard and a real headless Chromium, over two
real training runs (``two_stage_logdir``: ZeRO stage 0 and stage 3). The test picks the
two runs, reads the placement diff table and the tier-difference charts, and checks them
against the plugin's own ``/diff`` answer; it also writes docs/screenshot_diff.png."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect
from test_browser import LOAD_TIMEOUT_MS, open_view, plugin_frame, require_built_frontend

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "screenshot_diff.png"
DIFF = "details.mh-diff"

READ_PLACEMENT = """
(rows) => rows.map((r) => ({
  name: r.dataset.name,
  status: r.dataset.status,
  delta: r.dataset.bytesDelta ?? null,
  optimizerA: r.querySelector('.mh-col-optimizer-a').textContent,
  optimizerB: r.querySelector('.mh-col-optimizer-b').textContent,
  shardingB: r.querySelector('.mh-col-sharding-b').textContent,
}))
"""

READ_TIERS = """
(cells) => cells.map((c) => ({
  tier: c.dataset.tier,
  points: c.dataset.points,
  last: c.dataset.lastUsedDelta ?? null,
  canvases: c.querySelectorAll('canvas').length,
  legend: c.querySelector('.u-legend')?.textContent ?? '',
}))
"""


def fetch_diff(server, a: str, b: str) -> dict:
    query = urllib.parse.urlencode({"a": a, "b": b, "points": 1000})
    url = f"{server.url}/data/plugin/memory_hierarchy/diff?{query}"
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def last_measured(values):
    measured = [v for v in values if v is not None]
    return measured[-1] if measured else None


def test_compare_runs_shows_placement_diff_and_tier_difference_chart(
    browser, tensorboard_server, two_stage_logdir
):
    require_built_frontend()
    server = tensorboard_server(two_stage_logdir, load_fast=True)
    page, frame, console = open_view(browser, server)
    try:
        expect(frame.locator("section.mh-run[data-drawn='1']")).to_have_count(
            2, timeout=LOAD_TIMEOUT_MS
        )
        diff = frame.locator(DIFF)
        assert diff.get_attribute("data-state") is None  # lazy: nothing fetched while closed
        diff.locator("summary").click()
        diff.locator("select.mh-diff-a").select_option("stage0")
        diff.locator("select.mh-diff-b").select_option("stage3")
        drawn = frame.locator(f'{DIFF}[data-state="drawn"][data-a="stage0"][data-b="stage3"]')
        expect(drawn).to_have_count(1, timeout=LOAD_TIMEOUT_MS)
        want = fetch_diff(server, "stage0", "stage3")

        # The placement diff: one row per differing variable, as the route answers.
        rows = diff.locator(".mh-diff-table tbody tr").evaluate_all(READ_PLACEMENT)
        assert [r["name"] for r in rows] == [r["name"] for r in want["placement"]["rows"]]
        assert len(rows) == want["placement"]["differ"] > 5
        for row, w in zip(rows, want["placement"]["rows"]):
            assert row["status"] == "differ"
            assert int(row["delta"]) == w["bytes_delta"] < 0  # sharded: less per replica
            assert (row["optimizerA"], row["optimizerB"]) == ("device", "host")
            assert "ZeRO-3" in row["shardingB"]
        counts = diff.locator(".mh-diff-placement-counts")
        assert counts.get_attribute("data-differ") == str(want["placement"]["differ"])
        assert counts.get_attribute("data-equal") == "0"

        # The tier-difference chart: one uPlot chart per tier, B - A over the common steps.
        tiers = diff.locator(".mh-diff-tier").evaluate_all(READ_TIERS)
        assert [t["tier"] for t in tiers] == ["device", "host", "nvme"]
        for t in tiers:
            assert t["canvases"] >= 1 and t["points"] == str(len(want["steps"]))
            assert "Δ used (stage3 − stage0)" in t["legend"]
            expected = last_measured(want["values"][f"{t['tier']}/used_bytes"])
            assert float(t["last"]) == expected
        host = next(t for t in tiers if t["tier"] == "host")
        assert float(host["last"]) > 0  # stage 3's optimizer states on the host
        total = diff.locator('.mh-diff-totals tr[data-metric="host/peak_bytes"]')
        assert (
            float(total.get_attribute("data-delta"))
            == (want["summary"]["tiers"]["host"]["peak_bytes"]["delta"])
        )
        exports = diff.locator("a.mh-export")
        expect(exports).to_have_count(3)
        assert "part=placement" in exports.nth(1).get_attribute("href")

        SCREENSHOT.parent.mkdir(exist_ok=True)
        diff.screenshot(path=str(SCREENSHOT))

        # Swapped: A is stage 3, every byte delta changes sign.
        diff.locator("button.mh-diff-swap").click()
        swapped = frame.locator(f'{DIFF}[data-state="drawn"][data-a="stage3"][data-b="stage0"]')
        expect(swapped).to_have_count(1, timeout=LOAD_TIMEOUT_MS)
        again = diff.locator(".mh-diff-table tbody tr").evaluate_all(READ_PLACEMENT)
        assert [int(r["delta"]) for r in again] == [-int(r["delta"]) for r in rows]

        violations = plugin_frame(page).evaluate("window.__cspViolations")
        assert violations == [], violations
        assert not [m for m in console if m.startswith(("pageerror", "error"))], console
    finally:
        page.context.close()
