"""``GET /diff`` over two real training runs (``two_stage_logdir``: ZeRO stage 0 and
stage 3 with the optimizer states on the host): every figure is checked against the
runs' own records read through ``/series`` and ``/json``."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest

from tb_plugin import metadata

pytestmark = [pytest.mark.slow]

ROUTE = "/data/plugin/memory_hierarchy"


@pytest.fixture(scope="module")
def client(plugin_client, two_stage_logdir):
    return plugin_client(two_stage_logdir)


def get(client, route, **params):
    resp = client.get(f"{ROUTE}/{route}", query_string=params)
    return resp.status_code, resp


def body(client, route, **params):
    status, resp = get(client, route, **params)
    assert status == 200, resp.get_data(as_text=True)
    return json.loads(resp.get_data(as_text=True))


def series(client, run, tag):
    return body(client, "series", run=run, tag=tag, points=0)


def latest(client, run, tag):
    return body(client, "json", run=run, tag=tag)["events"][-1]["value"]


def finite_max(values):
    measured = [v for v in values if v is not None]
    return max(measured) if measured else None


@pytest.fixture(scope="module")
def diff(client):
    return body(client, "diff", a="stage0", b="stage3", points=0)


def test_steps_are_aligned_by_step_and_differenced_b_minus_a(client, diff):
    tiers_a = series(client, "stage0", metadata.TAG_TIERS)
    tiers_b = series(client, "stage3", metadata.TAG_TIERS)
    assert tiers_a["steps"] == [0, 1, 2, 3] and tiers_b["steps"] == list(range(6))
    assert diff["steps"] == [0, 1, 2, 3]  # only the steps both runs recorded
    assert diff["alignment"]["common_steps"] == 4
    assert (diff["alignment"]["only_a"], diff["alignment"]["only_b"]) == (0, 2)
    assert diff["alignment"]["a_steps"] == [0, 3] and diff["alignment"]["b_steps"] == [0, 5]
    assert diff["total_steps"] == 4 and diff["downsampled"] is False
    for tier in metadata.TIERS:
        for field in ("used_bytes", "peak_bytes"):
            want = [
                tiers_b["values"][tier][field][i] - tiers_a["values"][tier][field][i]
                for i in range(4)
            ]
            assert diff["values"][f"{tier}/{field}"] == want, (tier, field)
    # Stage 3 keeps the Adam moments of its shards on the host; stage 0 has none there.
    assert all(v > 0 for v in diff["values"]["host/used_bytes"])
    timing_a = series(client, "stage0", metadata.TAG_TIMING)["values"]["step_seconds"]
    timing_b = series(client, "stage3", metadata.TAG_TIMING)["values"]["step_seconds"]
    assert diff["values"]["step_seconds"] == [timing_b[i] - timing_a[i] for i in range(4)]
    # Stage 0 runs no paged pool: its page moves are not measured, so neither is B - A.
    assert all(v is None for v in diff["values"]["h2d_pages"])
    assert diff["units"][diff["columns"].index("step_seconds")] == "seconds"


def test_summary_deltas_are_over_each_runs_own_steps(client, diff):
    for tier in metadata.TIERS:
        peaks = [
            finite_max(series(client, run, metadata.TAG_TIERS)["values"][tier]["peak_bytes"])
            for run in ("stage0", "stage3")
        ]
        got = diff["summary"]["tiers"][tier]["peak_bytes"]
        assert (got["a"], got["b"], got["delta"]) == (peaks[0], peaks[1], peaks[1] - peaks[0])
        last_b = series(client, "stage3", metadata.TAG_TIERS)["values"][tier]["used_bytes"][-1]
        assert diff["summary"]["tiers"][tier]["last_used_bytes"]["b"] == last_b  # step 5
    host = diff["summary"]["tiers"]["host"]["last_used_bytes"]
    assert host["a"] == 0 and host["delta"] > 0
    pages = diff["summary"]["pages"]["h2d_pages"]
    assert pages["a"] is None and pages["b"] is not None and pages["delta"] is None
    assert diff["stage"] == {"a": 0, "b": 3, "delta": 3}
    timing = series(client, "stage3", metadata.TAG_TIMING)["values"]
    untraced = sorted(s for s, t in zip(timing["step_seconds"], timing["traced"]) if t == 0)
    median = diff["summary"]["median_step_seconds"]["b"]
    mid = len(untraced) // 2
    want = untraced[mid] if len(untraced) % 2 else (untraced[mid - 1] + untraced[mid]) / 2
    assert math.isclose(median, want)


def test_placement_diff_stage0_vs_stage3(client, diff):
    place_a = {v["name"]: v for v in latest(client, "stage0", metadata.TAG_PLACEMENT)["variables"]}
    place_b = {v["name"]: v for v in latest(client, "stage3", metadata.TAG_PLACEMENT)["variables"]}
    assert set(place_a) == set(place_b) and len(place_a) > 5
    placement = diff["placement"]
    rows = {r["name"]: r for r in placement["rows"]}
    assert placement["equal"] + placement["differ"] == len(place_a)
    assert placement["only_a"] == placement["only_b"] == 0
    # Every variable moved: stage 0 replicates it with its optimizer state on the device,
    # stage 3 shards it and keeps the optimizer state on the host.
    assert set(rows) == set(place_a) and placement["equal"] == 0
    for name, row in rows.items():
        a, b = place_a[name], place_b[name]
        assert row["status"] == "differ" and row["stage_a"] == 0 and row["stage_b"] == 3
        assert "partitioning" in row["changed"] and "optimizer_tier" in row["changed"]
        assert "replicated" in row["a"]["partitioning"] and "ZeRO-3" in row["b"]["partitioning"]
        assert (row["a"]["optimizer_tier"], row["b"]["optimizer_tier"]) == ("device", "host")
        assert row["bytes_a"] == a["shard_bytes_per_replica"] == a["bytes"]
        assert row["bytes_b"] == b["shard_bytes_per_replica"] < b["bytes"]
        assert row["bytes_delta"] == row["bytes_b"] - row["bytes_a"] < 0
    total = sum(r["bytes_delta"] for r in rows.values())
    want = sum(v["shard_bytes_per_replica"] for v in place_b.values()) - sum(
        v["bytes"] for v in place_a.values()
    )
    assert total == want


def test_a_run_compared_with_itself_has_no_differences(client):
    same = body(client, "diff", a="stage3", b="stage3")
    assert same["placement"]["rows"] == [] and same["placement"]["differ"] == 0
    assert same["placement"]["equal"] == len(
        latest(client, "stage3", metadata.TAG_PLACEMENT)["variables"]
    )
    assert all(v == 0 for v in same["values"]["device/used_bytes"])
    assert same["alignment"]["only_a"] == same["alignment"]["only_b"] == 0


def test_points_thin_the_steps_keeping_the_first_and_last(client, diff):
    thin = body(client, "diff", a="stage0", b="stage3", points=2)
    assert thin["steps"][0] == 0 and thin["steps"][-1] == 3
    assert set(thin["steps"]) <= set(diff["steps"])
    for i, step in enumerate(thin["steps"]):
        j = diff["steps"].index(step)
        assert thin["values"]["device/used_bytes"][i] == diff["values"]["device/used_bytes"][j]


def test_csv_and_json_downloads(client, diff):
    status, resp = get(client, "diff", a="stage0", b="stage3", points=0, format="csv")
    assert status == 200 and resp.headers["Content-Type"].startswith("text/csv")
    assert 'filename="stage0_vs_stage3_diff_steps.csv"' in resp.headers["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(resp.get_data(as_text=True))))
    assert [int(r["step"]) for r in rows] == diff["steps"]
    assert [float(r["host/used_bytes"]) for r in rows] == diff["values"]["host/used_bytes"]
    assert all(r["h2d_pages"] == "" for r in rows)  # not measured: empty, never 0
    status, resp = get(client, "diff", a="stage0", b="stage3", format="csv", part="placement")
    assert status == 200
    rows = list(csv.DictReader(io.StringIO(resp.get_data(as_text=True))))
    by_name = {r["name"]: r for r in diff["placement"]["rows"]}
    assert {r["name"] for r in rows} == set(by_name)
    for r in rows:
        assert int(r["held_bytes_delta"]) == by_name[r["name"]]["bytes_delta"]
        assert (r["optimizer_tier_a"], r["optimizer_tier_b"]) == ("device", "host")
    status, resp = get(client, "diff", a="stage0", b="stage3", points=0, format="json")
    assert status == 200 and "attachment" in resp.headers["Content-Disposition"]
    assert json.loads(resp.get_data(as_text=True)) == diff


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"b": "stage3"}, "'a' is required"),
        ({"a": "stage0"}, "'b' is required"),
        ({"a": "", "b": "stage3"}, "'a' is required"),
        ({"a": "nope", "b": "stage3"}, "run a='nope' has no memory_hierarchy data"),
        ({"a": "stage0", "b": "missing"}, "run b='missing' has no memory_hierarchy data"),
        ({"a": "stage0", "b": "stage3", "points": "-1"}, "'points'"),
        ({"a": "stage0", "b": "stage3", "format": "xml"}, "'format'"),
        ({"a": "stage0", "b": "stage3", "format": "csv", "part": "x"}, "'part'"),
    ],
)
def test_bad_requests_are_400_naming_the_argument(client, params, needle):
    status, resp = get(client, "diff", **params)
    answer = json.loads(resp.get_data(as_text=True))
    assert status == 400 and answer["error"]["code"] == 400
    assert needle in answer["error"]["message"], answer
