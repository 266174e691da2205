"""Tests of tb_plugin.plugin through TensorBoard's real WSGI app and real event files.

The app is ``TensorBoardWSGIApp`` with the plugin and a real data provider (the Python
multiplexer); the logdirs are written with the real write API (``tb_plugin.summary``) or,
for malformed data, with TensorBoard's own event writer.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import os
import shutil
import socket
import time
from urllib.parse import quote, urlencode

import numpy as np
import pytest
from helpers import synthetic
from tensorboard import context as tb_context
from tensorboard import errors
from tensorboard.backend.event_processing import data_provider as tb_data_provider
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins import base_plugin
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.util import tensor_util
from werkzeug import test as werkzeug_test

from tb_plugin import export, fast_read, metadata, plugin, reader, routing, run_files, tuning
from tb_plugin.loader import MemoryHierarchyLoader, parse_bool_flag
from tb_plugin.routes import oom as oom_routes
from tb_plugin.routes import runs as runs_routes
from tb_plugin.routes import series as series_routes
from tb_plugin.routes import static as static_routes
from tb_plugin.summary import SummaryWriter
from zero_runtime import control
from zero_runtime.config import ZeroConfig

PREFIX = "/data/plugin/memory_hierarchy"


def get_json(client, route: str, **params) -> tuple[int, dict]:
    """GET a plugin route; returns (status, decoded JSON body)."""
    response = client.get(f"{PREFIX}{route}?{urlencode(params)}" if params else PREFIX + route)
    assert response.headers["Content-Type"].startswith("application/json"), response.data[:200]
    return response.status_code, json.loads(response.get_data(as_text=True))


def get_json_plain(client, path: str) -> tuple[int, dict]:
    """GET any path of the app and decode its JSON body."""
    response = client.get(path)
    return response.status_code, json.loads(response.get_data(as_text=True))


@pytest.fixture(scope="module")
def client(plugin_client, synthetic_logdir):
    """A test client over the session's synthetic logdir."""
    return plugin_client(synthetic_logdir)


# -- plugin listing ------------------------------------------------------------------------


def test_plugins_listing_enables_the_iframe_plugin(client):
    status, listing = get_json_plain(client, "/data/plugins_listing")
    assert status == 200
    entry = listing[metadata.PLUGIN_NAME]
    assert entry["enabled"] is True
    assert entry["loading_mechanism"] == {
        "type": "IFRAME",
        "module_path": f"{PREFIX}/index.js",
    }


def test_is_active_is_instant_and_data_names_enable_the_tab():
    p = plugin.MemoryHierarchyPlugin(base_plugin.TBContext(data_provider=None))
    assert p.is_active() is False
    assert tuple(p.data_plugin_names()) == (metadata.PLUGIN_NAME,)
    assert p.frontend_metadata().es_module_path == "/index.js"


# -- /runs ---------------------------------------------------------------------------------


def test_runs_lists_each_run_with_its_tags(client):
    status, body = get_json(client, "/runs")
    assert status == 200
    assert [r["run"] for r in body["runs"]] == sorted(synthetic.RUNS)
    last = synthetic.NUM_STEPS - 1

    def entry(kind: str, step: int) -> dict:
        return {"kind": kind, "max_step": step, "max_wall_time": synthetic.wall_time(step)}

    for item in body["runs"]:
        run = item["run"]
        want = {
            metadata.TAG_TIERS: entry("matrix", last),
            metadata.TAG_READINGS: entry("vector", last),
            metadata.TAG_TIMING: entry("vector", last),
            metadata.TAG_RUN_INFO: entry("json", 0),
            metadata.TAG_PLACEMENT: entry("json", 0),
            metadata.TAG_CONFIG_EVENT: entry("json", synthetic.CONFIG_EVENT_STEPS[run][-1]),
        }
        for op, tag in metadata.CHECKPOINT_OP_TAGS.items():  # saves and restores: a tag each
            steps = [s for s, o in synthetic.CHECKPOINT_OPS[run].items() if o == op]
            if steps:
                want[tag] = entry("json", max(steps))
        if run == synthetic.RUN_STANDIN:
            want[metadata.TAG_PAGES] = entry("vector", last)
            want[metadata.TAG_ESTIMATE] = entry("json", 0)
            want[metadata.TAG_OOM] = entry("json", synthetic.OOM_STEP)
        assert item["tags"] == want, run


@pytest.mark.parametrize("value", ["abc", "true", "2", ""])
def test_runs_refuses_a_levels_flag_it_does_not_know(client, value):
    """``/runs?levels=abc`` is not a 200 (any value but "1" taken as off): bad input is a
    400 naming the value and what is accepted."""
    status, body = get_json(client, f"/runs?levels={value}")
    assert status == 400, body
    message = body["error"]["message"]
    assert repr(value) in message and "['0', '1']" in message, body


def test_runs_levels_flag_accepts_0_and_1(client):
    on = get_json(client, "/runs?levels=1")
    off = get_json(client, "/runs?levels=0")
    assert on[0] == off[0] == 200
    tiers = lambda body: body["runs"][0]["tags"][metadata.TAG_TIERS]  # noqa: E731
    assert "levels_step" in tiers(on[1]) and "levels_step" not in tiers(off[1])


# -- /series -------------------------------------------------------------------------------


@pytest.mark.parametrize("run", synthetic.RUNS)
def test_series_returns_every_tier_cell_of_every_step(client, run):
    status, body = get_json(client, "/series", run=run, tag=metadata.TAG_TIERS)
    assert status == 200
    steps = list(range(synthetic.NUM_STEPS))
    assert body["run"] == run
    assert body["kind"] == "matrix"
    assert body["rows"] == list(metadata.TIERS)
    assert body["columns"] == list(metadata.TIER_COLUMNS)
    assert body["units"] == ["bytes"] * len(metadata.TIER_COLUMNS)
    assert body["steps"] == steps
    assert body["wall_times"] == [synthetic.wall_time(s) for s in steps]
    assert body["total_steps"] == synthetic.NUM_STEPS
    assert body["downsampled"] is False
    for tier in metadata.TIERS:
        for column in metadata.TIER_COLUMNS:
            expected = [synthetic.tiers(run, s)[tier][column] for s in steps]
            expected = [None if math.isnan(v) else v for v in expected]
            assert body["values"][tier][column] == expected, (tier, column)
    # Spot check in plain numbers: the stand-in run's device tier at the last step.
    if run == synthetic.RUN_STANDIN:
        assert body["values"]["device"]["used_bytes"][-1] == (64 + 49) * 2**20
        assert body["values"]["device"]["capacity_bytes"][-1] == 256 * 2**20
        assert body["values"]["nvme"]["capacity_bytes"] == [None] * synthetic.NUM_STEPS


def test_series_vector_has_null_for_unmeasured_columns(client):
    run = synthetic.RUN_STANDIN
    status, body = get_json(client, "/series", run=run, tag=metadata.TAG_READINGS)
    assert status == 200
    assert body["kind"] == "vector"
    assert body["rows"] == []
    assert body["columns"] == list(metadata.READING_COLUMNS)
    none = [None] * synthetic.NUM_STEPS
    assert body["values"]["nvml_used_bytes"] == none
    assert body["values"]["nvml_total_bytes"] == none
    assert body["values"]["process_rss_bytes"] == [
        synthetic.readings(run, s)["process_rss_bytes"] for s in range(synthetic.NUM_STEPS)
    ]


def test_json_returns_decoded_run_info(client):
    for run in synthetic.RUNS:
        status, body = get_json(client, "/json", run=run, tag=metadata.TAG_RUN_INFO)
        assert status == 200
        assert body == {
            "run": run,
            "tag": metadata.TAG_RUN_INFO,
            "kind": "json",
            "events": [
                {"step": 0, "wall_time": synthetic.wall_time(0), "value": synthetic.run_info(run)}
            ],
        }


def test_series_pages_has_every_direction_and_the_prefetch_counts(client):
    run = synthetic.RUN_STANDIN
    status, body = get_json(client, "/series", run=run, tag=metadata.TAG_PAGES)
    assert status == 200
    assert body["columns"] == list(metadata.PAGE_COLUMNS)
    assert body["units"][body["columns"].index("h2d_bytes")] == "bytes"
    assert body["units"][body["columns"].index("h2d_pages")] == "count"
    assert body["units"][body["columns"].index("stall_seconds")] == "seconds"
    steps = list(range(synthetic.NUM_STEPS))
    assert body["steps"] == steps
    for column in metadata.PAGE_COLUMNS:
        assert body["values"][column] == [synthetic.pages(run, s)[column] for s in steps], column
    # Plain numbers at step 7: 3 pages (3 MiB) host->device, 9 hits and 1 miss.
    assert body["values"]["h2d_bytes"][7] == 3 * 2**20
    assert body["values"]["prefetch_hits"][7] == 9.0
    assert body["values"]["prefetch_misses"][7] == 1.0


def test_pages_absent_for_a_run_that_moved_none(client):
    status, body = get_json(client, "/series", run=synthetic.RUN_HTML_NAME, tag=metadata.TAG_PAGES)
    assert status == 404
    assert "no memory_hierarchy data" in body["error"]["message"]


def test_series_timing_keeps_unmeasured_parts_null(client):
    steps = list(range(synthetic.NUM_STEPS))
    status, body = get_json(client, "/series", run=synthetic.RUN_STANDIN, tag=metadata.TAG_TIMING)
    assert status == 200
    assert body["values"]["overlap_ratio"] == [0.75] * len(steps)
    assert body["values"]["compute_seconds"][10] == 0.06
    units = dict(zip(metadata.TIMING_COLUMNS, body["units"]))
    assert (units["overlap_ratio"], units["traced"], units["io_seconds"]) == (
        "ratio",
        "flag",
        "seconds",
    )
    assert body["values"]["traced"] == [1.0] + [0.0] * (len(steps) - 1)
    status, body = get_json(client, "/series", run=synthetic.RUN_HTML_NAME, tag=metadata.TAG_TIMING)
    assert status == 200
    assert body["values"]["step_seconds"] == [0.1 + 0.001 * s for s in steps]
    for column in ("compute_seconds", "comm_seconds", "overlap_seconds", "overlap_ratio"):
        assert body["values"][column] == [None] * len(steps), column


@pytest.mark.parametrize(
    ("tag", "expected"),
    [
        (metadata.TAG_PLACEMENT, lambda run: [(0, synthetic.placement(run))]),
        (
            metadata.TAG_CONFIG_EVENT,
            lambda run: [
                (s, synthetic.config_event(run, s)) for s in synthetic.CONFIG_EVENT_STEPS[run]
            ],
        ),
    ],
    ids=["placement", "config_event"],
)
@pytest.mark.parametrize("run", synthetic.RUNS)
def test_json_tags_return_every_record(client, run, tag, expected):
    status, body = get_json(client, "/json", run=run, tag=tag)
    assert status == 200
    assert [(e["step"], e["value"]) for e in body["events"]] == expected(run)
    assert [e["wall_time"] for e in body["events"]] == [
        synthetic.wall_time(step) for step, _value in expected(run)
    ]


def test_json_estimate_has_the_per_process_prediction(client):
    status, body = get_json(client, "/json", run=synthetic.RUN_STANDIN, tag=metadata.TAG_ESTIMATE)
    assert status == 200
    (event,) = body["events"]
    assert event["value"]["per_process"] == {
        "device_bytes": 100 * 2**20,
        "host_bytes": 640 * 2**20,
        "nvme_bytes": 0,
    }


# -- exports -------------------------------------------------------------------------------


def test_series_csv_export_of_every_step(client):
    run = synthetic.RUN_STANDIN
    response = client.get(
        f"{PREFIX}/series",
        query_string={"run": run, "tag": metadata.TAG_TIERS, "points": "0", "format": "csv"},
    )
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "text/csv; charset=utf-8"
    disposition = response.headers["Content-Disposition"]
    assert disposition.startswith('attachment; filename="alpha_tiers_full.csv"')
    lines = response.get_data(as_text=True).splitlines()
    header = lines[0].split(",")
    assert header[:4] == ["step", "wall_time", "device/used_bytes", "device/capacity_bytes"]
    assert len(header) == 2 + len(metadata.TIERS) * len(metadata.TIER_COLUMNS)
    assert len(lines) == 1 + synthetic.NUM_STEPS
    row = dict(zip(header, lines[1 + 49].split(",")))
    assert row["step"] == "49"
    assert float(row["wall_time"]) == synthetic.wall_time(49)
    assert float(row["device/used_bytes"]) == (64 + 49) * 2**20
    assert row["nvme/capacity_bytes"] == ""  # not measured: empty, never 0


def test_series_json_export_of_a_thinned_series_is_a_download(spike_client):
    response = spike_client.get(
        f"{PREFIX}/series",
        query_string={"run": "spiky", "tag": metadata.TAG_TIERS, "points": "100", "format": "json"},
    )
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "application/json"
    assert response.headers["Content-Disposition"].startswith(
        'attachment; filename="spiky_tiers_100points.json"'
    )
    body = json.loads(response.data)
    assert body["downsampled"] is True and len(body["steps"]) <= 100
    assert max(body["values"]["device"]["used_bytes"]) == SPIKE_BYTES


def test_points_zero_returns_every_step_unthinned(spike_client):
    status, body = get_json(spike_client, "/series", run="spiky", tag=metadata.TAG_TIERS, points=0)
    assert status == 200
    assert body["steps"] == list(range(SPIKE_STEPS)) and body["downsampled"] is False


def test_placement_csv_export_has_one_row_per_variable(client):
    run = synthetic.RUN_HTML_NAME
    response = client.get(
        f"{PREFIX}/json", query_string={"run": run, "tag": metadata.TAG_PLACEMENT, "format": "csv"}
    )
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "text/csv; charset=utf-8"
    # The run name (HTML) is reduced to a safe ASCII file name, and kept in filename*.
    disposition = response.headers["Content-Disposition"]
    assert 'filename="beta_img_src_x_onerror_window.__xss_1__placement_all.csv"' in disposition
    assert "filename*=UTF-8''beta%20%3Cimg" in disposition
    rows = list(csv.DictReader(io.StringIO(response.get_data(as_text=True))))
    want = synthetic.placement(run)["variables"]
    assert [r["name"] for r in rows] == [v["name"] for v in want]
    assert rows[0]["bytes"] == str(want[0]["bytes"]) and rows[0]["optimizer_tier"] == "host"


def test_export_cells_that_look_like_formulas_are_defused():
    text = export.json_csv(
        {
            "tag": metadata.TAG_CONFIG_EVENT,
            "events": [{"step": 1, "wall_time": 2.0, "value": "=1+1"}],
        }
    )
    assert text.splitlines()[1] == "1,2.0,'=1+1"


def test_a_growing_run_is_read_again_when_its_max_step_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "LISTING_TTL_SECONDS", 0.0)  # no reuse of the listing
    monkeypatch.setattr(reader, "LISTING_STALE_SECONDS", 0.0)
    logdir = str(tmp_path / "growing")
    synthetic.write_run(logdir, synthetic.RUN_STANDIN, range(5))
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        tensor_size_guidance={metadata.PLUGIN_NAME: 0}
    )
    multiplexer.AddRunsFromDirectory(logdir)
    multiplexer.Reload()
    context = base_plugin.TBContext(
        data_provider=tb_data_provider.MultiplexerDataProvider(multiplexer, logdir)
    )
    p = plugin.MemoryHierarchyPlugin(context)
    ctx = tb_context.RequestContext()
    tag = metadata.TAG_TIERS
    assert series_routes.series_impl(p.reader, ctx, "", "alpha", tag)["steps"] == list(range(5))
    assert series_routes.series_impl(p.reader, ctx, "", "alpha", tag)["steps"] == list(
        range(5)
    )  # cached
    synthetic.write_run(logdir, synthetic.RUN_STANDIN, range(5, 8))
    multiplexer.Reload()  # as TensorBoard's reload loop does
    body = series_routes.series_impl(p.reader, ctx, "", "alpha", tag)
    assert body["steps"] == list(range(8)) and body["total_steps"] == 8
    answer = series_routes.series_answer(p.reader, p.answers, ctx, "", "alpha", tag, 100, None)
    assert json.loads(gzip.decompress(answer.gzipped))["steps"] == list(range(8))


def test_a_run_rewritten_into_the_same_directory_is_read_anew(tmp_path, monkeypatch):
    """A TensorBoard left open while the demo reruns into the same logdir answers the
    new run's /series and /oom, not the old run's from its caches."""
    monkeypatch.setattr(reader, "LISTING_TTL_SECONDS", 0.0)  # no reuse of the listing
    monkeypatch.setattr(reader, "LISTING_STALE_SECONDS", 0.0)
    logdir = str(tmp_path / "rerun")
    run = synthetic.RUN_STANDIN

    def write(steps: range, oom_text: str) -> None:
        synthetic.write_run(logdir, run, steps)
        writer = SummaryWriter(os.path.join(logdir, run))
        writer.json(metadata.TAG_OOM, 3, {"message": oom_text}, wall_time=1.0)
        writer.close()

    write(range(10), "384 KiB")

    def loaded() -> tb_data_provider.MultiplexerDataProvider:
        multiplexer = plugin_event_multiplexer.EventMultiplexer(
            tensor_size_guidance={metadata.PLUGIN_NAME: 0}
        )
        multiplexer.AddRunsFromDirectory(logdir)
        multiplexer.Reload()
        return tb_data_provider.MultiplexerDataProvider(multiplexer, logdir)

    class Provider:
        """TensorBoard's data as the Rust data server serves it after the rerun: the
        replaced files' data only. (The Python multiplexer keeps a deleted file's events,
        so the test loads the directory anew; every call goes to a real provider.)"""

        inner = loaded()

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

    context = base_plugin.TBContext(data_provider=Provider(), logdir=logdir)
    p = plugin.MemoryHierarchyPlugin(context)
    ctx = tb_context.RequestContext()
    tag = metadata.TAG_TIERS

    def series_steps() -> list[int]:
        answer = series_routes.series_answer(p.reader, p.answers, ctx, "", run, tag, 100, None)
        return json.loads(gzip.decompress(answer.gzipped))["steps"]

    def oom_text() -> str:
        return oom_routes.oom_impl(p.reader, ctx, "", run)["postmortem"]["message"]

    assert series_steps() == list(range(10)) and oom_text() == "384 KiB"
    shutil.rmtree(os.path.join(logdir, run))  # the rerun empties the run's directory
    write(range(4), "144 KiB")  # the same OOM step, a shorter run
    Provider.inner = loaded()
    assert series_steps() == list(range(4))
    assert series_routes.series_impl(p.reader, ctx, "", run, tag)["total_steps"] == 4
    assert oom_text() == "144 KiB"


def test_run_generations_count_replaced_and_truncated_files_not_appends(tmp_path):
    gens = run_files.RunGenerations()
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    first = run_dir / "events.out.tfevents.0000000002.host.1.0"
    first.write_bytes(b"x" * 100)
    assert gens.generation(str(tmp_path), "r") == 0
    with open(first, "ab") as fh:
        fh.write(b"y" * 10)  # a live run appends
    (run_dir / "events.out.tfevents.0000000003.host.1.1").write_bytes(b"z")  # a newer file
    assert gens.generation(str(tmp_path), "r") == 0
    first.write_bytes(b"x" * 5)  # truncated
    assert gens.generation(str(tmp_path), "r") == 1
    first.unlink()
    first.write_bytes(b"x" * 500)  # replaced: another inode under the same name
    assert gens.generation(str(tmp_path), "r") in (1, 2)  # an inode may be reused at once
    os.replace(first, run_dir / "events.out.tfevents.0000000001.host.1.0")  # older name
    assert gens.generation(str(tmp_path), "r") >= 2
    assert gens.generation("gs://bucket", "r") == 0  # nothing to stat


def test_a_stale_listing_is_answered_at_once_and_refreshed_in_the_background(tmp_path, monkeypatch):
    logdir = str(tmp_path / "stale")
    synthetic.write_run(logdir, synthetic.RUN_STANDIN, range(3))
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        tensor_size_guidance={metadata.PLUGIN_NAME: 0}
    )
    multiplexer.AddRunsFromDirectory(logdir)
    multiplexer.Reload()
    data_provider = tb_data_provider.MultiplexerDataProvider(multiplexer, logdir)
    p = plugin.MemoryHierarchyPlugin(base_plugin.TBContext(data_provider=data_provider))
    ctx = tb_context.RequestContext()

    def max_step() -> int:
        return runs_routes.runs_impl(p.reader, ctx, "")["runs"][0]["tags"][metadata.TAG_TIERS][
            "max_step"
        ]

    assert max_step() == 2
    synthetic.write_run(logdir, synthetic.RUN_STANDIN, range(3, 6))
    multiplexer.Reload()
    assert max_step() == 2  # younger than the TTL: the cached listing
    monkeypatch.setattr(reader, "LISTING_TTL_SECONDS", 0.0)
    assert max_step() == 2  # stale: answered at once, listed again in the background
    deadline = time.monotonic() + 60  # generous: CI shares 2 cores
    while max_step() != 5:
        assert time.monotonic() < deadline, "the background listing never landed"
        time.sleep(0.01)


def test_fast_read_decodes_like_make_ndarray():
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(3, 7)) for _ in range(5)]
    arrays[2][1, 4] = np.nan
    protos = [tensor_util.make_tensor_proto(a) for a in arrays]
    raw = fast_read.decode_points([0, 1, 2, 3, 9], [1.0, 2.0, 3.0, 4.0, 5.5], protos, (3, 7))
    assert raw is not None
    want = np.stack([tensor_util.make_ndarray(p).ravel() for p in protos])
    np.testing.assert_array_equal(raw.cells, want)  # NaN in the same place
    assert raw.steps.tolist() == [0, 1, 2, 3, 9] and raw.wall_times.tolist()[-1] == 5.5
    # Another shape or dtype: not decoded here (the caller uses read_tensors).
    assert fast_read.decode_points([0], [1.0], protos[:1], (21,)) is None
    as_float32 = tensor_util.make_tensor_proto(arrays[0].astype(np.float32))
    assert fast_read.decode_points([0], [1.0], [as_float32], (3, 7)) is None


def test_fast_read_needs_a_grpc_provider():
    assert fast_read.read_series(object(), "", "memory_hierarchy", "r", "t", 10, (3,)) is None


# -- errors --------------------------------------------------------------------------------

LONG = "x" * (routing.MAX_QUERY_VALUE_CHARS + 1)
TIERS_TAG = metadata.TAG_TIERS
INFO_TAG = metadata.TAG_RUN_INFO


@pytest.mark.parametrize(
    ("route", "params", "status", "needle"),
    [
        ("/series", {"tag": TIERS_TAG}, 400, "'run' is required"),
        ("/series", {"run": "alpha"}, 400, "'tag' is required"),
        ("/series", {"run": "", "tag": TIERS_TAG}, 400, "'run' is required"),
        ("/series", {"run": LONG, "tag": TIERS_TAG}, 400, "longer than"),
        ("/series", {"run": "alpha", "tag": LONG}, 400, "longer than"),
        ("/series", {"run": "alpha", "tag": TIERS_TAG, "points": "abc"}, 400, "'points'"),
        ("/series", {"run": "alpha", "tag": TIERS_TAG, "points": "1"}, 400, "'points'"),
        ("/series", {"run": "alpha", "tag": TIERS_TAG, "points": "-5"}, 400, "'points'"),
        ("/series", {"run": "alpha", "tag": TIERS_TAG, "points": "10" * 10}, 400, "'points'"),
        ("/series", {"run": "alpha", "tag": TIERS_TAG, "points": "0" * 10}, 400, "'points'"),
        ("/series", {"run": "alpha", "tag": TIERS_TAG, "points": "2.5"}, 400, "'points'"),
        ("/series", {"run": "alpha", "tag": TIERS_TAG, "points": LONG}, 400, "'points'"),
        ("/series", {"run": "alpha", "tag": TIERS_TAG, "format": "xml"}, 400, "'format'"),
        ("/series", {"run": "alpha", "tag": TIERS_TAG, "format": "CSV"}, 400, "'format'"),
        ("/series", {"run": "alpha", "tag": TIERS_TAG, "format": LONG}, 400, "'format'"),
        ("/series", {"run": "alpha", "tag": TIERS_TAG, "format": ""}, 400, "'format'"),
        ("/series", {"run": "alpha", "tag": INFO_TAG}, 400, "json tag"),
        ("/series", {"run": "nope", "tag": TIERS_TAG}, 404, "no memory_hierarchy data"),
        ("/series", {"run": "alpha", "tag": "memory_hierarchy/nope"}, 404, "no memory_hierarchy"),
        ("/json", {"tag": INFO_TAG}, 400, "'run' is required"),
        ("/json", {"run": "alpha", "tag": TIERS_TAG}, 400, "matrix tag"),
        ("/json", {"run": "nope", "tag": INFO_TAG}, 404, "no memory_hierarchy data"),
        ("/json", {"run": "alpha", "tag": INFO_TAG, "format": "html"}, 400, "'format'"),
        ("/json", {"run": LONG, "tag": INFO_TAG, "format": "csv"}, 400, "longer than"),
        ("/json", {"run": "nope", "tag": INFO_TAG, "format": "csv"}, 404, "no memory_hierarchy"),
    ],
)
def test_bad_requests_get_json_errors(client, route, params, status, needle):
    got, body = get_json(client, route, **params)
    assert got == status
    assert body["error"]["code"] == status
    assert needle in body["error"]["message"]


# -- static assets -------------------------------------------------------------------------


def test_index_js_is_the_built_bundle(client):
    path = os.path.join(plugin.STATIC_DIR, "index.js")
    if not os.path.isfile(path):
        pytest.fail("tb_plugin/static/index.js is missing: run scripts/setup.sh to build it")
    response = client.get(f"{PREFIX}/index.js")
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "text/javascript; charset=utf-8"
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    with open(path, "rb") as f:
        assert response.data == f.read()
    assert b"export" in response.data  # an ES module with render()


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("index.js.map", 200),
        ("../../../setup.py", 400),
        ("..%2F..%2Fsetup.py", 400),
        ("..%2f..%2f..%2fsetup.py", 400),
        ("%2e%2e%2fsetup.py", 400),
        ("%2E%2E/%2E%2E/setup.py", 400),
        ("%252e%252e%252fsetup.py", 400),  # doubly encoded
        ("%252E%252E%252F%252E%252E%252Fsetup.py", 400),
        ("..%5c..%5csetup.py", 400),  # backslashes
        ("..\\..\\setup.py", 400),
        ("/etc/passwd", 400),  # absolute: .../memory_hierarchy//etc/passwd
        ("%2Fetc%2Fpasswd", 400),
        ("static/../../setup.py", 400),
        (".gitignore", 400),
        ("..", 400),
        ("index.js%00.png", 400),
        ("missing.js", 404),
        ("plugin.py", 404),  # not a served type, and not in static/
        ("index.html", 404),
    ],
)
def test_static_route_refuses_anything_but_plain_asset_names(client, path, status):
    if not os.path.isfile(os.path.join(plugin.STATIC_DIR, "index.js")):
        pytest.fail("tb_plugin/static/index.js is missing: run scripts/setup.sh to build it")
    response = client.get(f"{PREFIX}/{path}")
    assert response.status_code == status, response.data[:200]
    if status != 200:
        assert b"setuptools" not in response.data and b"root:" not in response.data
        assert json.loads(response.data)["error"]["code"] == status
    else:
        assert response.headers["Content-Type"].startswith("application/json")


def test_static_impl_does_not_follow_symlinks_out_of_the_static_dir(tmp_path):
    static = tmp_path / "static"
    static.mkdir()
    (static / "ok.js").write_text("export {};")
    secret = tmp_path / "secret.js"
    secret.write_text("secret")
    os.symlink(secret, static / "evil.js")
    assert static_routes.static_impl(str(static), "ok.js") == (b"export {};", "text/javascript")
    with pytest.raises(errors.NotFoundError):
        static_routes.static_impl(str(static), "evil.js")
    # The plugin serves from the static_dir it was given.
    client = werkzeug_test.Client(
        plugin.MemoryHierarchyPlugin(
            base_plugin.TBContext(), static_dir=str(static)
        ).get_plugin_apps()["/*"]
    )
    assert client.get(f"{PREFIX}/ok.js").data == b"export {};"
    assert client.get(f"{PREFIX}/evil.js").status_code == 404


def test_static_assets_carry_an_etag_and_answer_304_when_unchanged(tmp_path):
    static = tmp_path / "static"
    static.mkdir()
    (static / "index.js").write_text("export const a = 1;")
    client = werkzeug_test.Client(
        plugin.MemoryHierarchyPlugin(
            base_plugin.TBContext(), static_dir=str(static)
        ).get_plugin_apps()["/*"]
    )
    first = client.get(f"{PREFIX}/index.js")
    assert first.status_code == 200 and first.data == b"export const a = 1;"
    tag = first.headers["ETag"]
    assert tag == static_routes.etag(b"export const a = 1;") and len(tag) == 34
    assert first.headers["Cache-Control"] == "no-cache, must-revalidate"
    again = client.get(f"{PREFIX}/index.js", headers={"If-None-Match": tag})
    assert (again.status_code, again.data, again.headers["ETag"]) == (304, b"", tag)
    (static / "index.js").write_text("export const a = 2;")  # a new build
    rebuilt = client.get(f"{PREFIX}/index.js", headers={"If-None-Match": tag})
    assert rebuilt.status_code == 200 and rebuilt.data == b"export const a = 2;"
    assert rebuilt.headers["ETag"] != tag


# -- peak-keeping downsampling -------------------------------------------------------------

SPIKE_STEPS = 3000
SPIKE_AT = 2017
SPIKE_BYTES = 7.5 * 2**30  # the device tier's one-step peak
DIP_AT = 1111


@pytest.fixture(scope="module")
def spike_client(plugin_client, tmp_path_factory):
    """A run of SPIKE_STEPS steps whose device use is flat but for one spike and one dip."""
    logdir = str(tmp_path_factory.mktemp("spike_logdir"))
    writer = SummaryWriter(os.path.join(logdir, "spiky"))
    for step in range(SPIKE_STEPS):
        used = 2**30 + (step % 7) * 2**20  # 1 GiB plus a little wobble
        used = SPIKE_BYTES if step == SPIKE_AT else 0.0 if step == DIP_AT else used
        writer.matrix(
            metadata.TAG_TIERS,
            step,
            {"device": {"used_bytes": used, "capacity_bytes": 8 * 2**30}},
            wall_time=synthetic.wall_time(step),
        )
    writer.close()
    return plugin_client(logdir)


def test_downsampling_keeps_a_single_spike_and_the_last_step(spike_client):
    status, body = get_json(
        spike_client, "/series", run="spiky", tag=metadata.TAG_TIERS, points=100
    )
    assert status == 200
    assert body["total_steps"] == SPIKE_STEPS
    assert body["downsampled"] is True
    steps, used = body["steps"], body["values"]["device"]["used_bytes"]
    assert len(steps) <= 100
    assert steps == sorted(steps)
    assert steps[0] == 0 and steps[-1] == SPIKE_STEPS - 1
    assert max(used) == SPIKE_BYTES
    assert used[steps.index(SPIKE_AT)] == SPIKE_BYTES
    assert min(used) == 0.0 and steps.index(DIP_AT) == used.index(0.0)
    assert body["values"]["host"]["used_bytes"] == [None] * len(steps)  # never written


def test_default_budget_thins_and_a_larger_budget_returns_every_step(spike_client):
    tag = metadata.TAG_TIERS
    status, body = get_json(spike_client, "/series", run="spiky", tag=tag)
    assert status == 200
    assert series_routes.DEFAULT_POINTS < SPIKE_STEPS
    assert len(body["steps"]) <= series_routes.DEFAULT_POINTS and body["downsampled"] is True
    assert max(body["values"]["device"]["used_bytes"]) == SPIKE_BYTES
    status, body = get_json(spike_client, "/series", run="spiky", tag=tag, points=SPIKE_STEPS)
    assert status == 200
    assert body["steps"] == list(range(SPIKE_STEPS)) and body["downsampled"] is False


# -- data the reader must refuse -----------------------------------------------------------


def write_raw(logdir: str, tag: str, tensor: np.ndarray, content: dict, step: int = 0) -> None:
    """Write one summary with an arbitrary metadata content (bypassing the write API)."""
    writer = EventFileWriter(logdir)
    value = summary_pb2.Summary.Value(tag=tag, tensor=tensor_util.make_tensor_proto(tensor))
    value.metadata.CopyFrom(
        summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(
                plugin_name=metadata.PLUGIN_NAME, content=json.dumps(content).encode()
            ),
            data_class=summary_pb2.DATA_CLASS_TENSOR,
        )
    )
    writer.add_event(
        event_pb2.Event(wall_time=1.0, step=step, summary=summary_pb2.Summary(value=[value]))
    )
    writer.close()


@pytest.fixture(scope="module")
def refused_client(plugin_client, tmp_path_factory):
    """Runs 'future' (schema version newer than known) and 'bent' (wrong tensor shape)."""
    logdir = tmp_path_factory.mktemp("refused_logdir")
    _kind, rows, columns, units = metadata.LAYOUTS[metadata.TAG_TIERS]
    future = {
        "version": metadata.SCHEMA_VERSION + 1,
        "kind": "matrix",
        "rows": list(rows),
        "columns": list(columns),
        "units": list(units),
    }
    write_raw(str(logdir / "future"), metadata.TAG_TIERS, np.zeros((3, 7)), future)
    future_json = {"version": metadata.SCHEMA_VERSION + 1, "kind": "json"}
    write_raw(str(logdir / "future"), metadata.TAG_RUN_INFO, np.array(b"{}", object), future_json)
    current = json.loads(
        metadata.create_summary_metadata(metadata.TAG_READINGS).plugin_data.content
    )
    write_raw(str(logdir / "bent"), metadata.TAG_READINGS, np.zeros(4), current)
    return plugin_client(str(logdir))


def test_newer_schema_version_is_refused_with_a_clear_message(refused_client):
    newer = metadata.SCHEMA_VERSION + 1
    for route, tag in (("/series", metadata.TAG_TIERS), ("/json", metadata.TAG_RUN_INFO)):
        status, body = get_json(refused_client, route, run="future", tag=tag)
        assert status == 500
        message = body["error"]["message"]
        assert f"schema version {newer}" in message
        assert f"up to {metadata.SCHEMA_VERSION}" in message
        assert "upgrade zero-infinity-tf" in message
    status, body = get_json(refused_client, "/runs")
    assert status == 200
    future = next(r for r in body["runs"] if r["run"] == "future")
    tiers = future["tags"][metadata.TAG_TIERS]
    assert tiers["kind"] is None and f"schema version {newer}" in tiers["error"]


def test_tensor_of_the_wrong_shape_is_refused(refused_client):
    status, body = get_json(refused_client, "/series", run="bent", tag=metadata.TAG_READINGS)
    assert status == 500
    assert "does not match the layout's (6,)" in body["error"]["message"]


def test_run_names_are_passed_through_query_encoding(client):
    run = synthetic.RUN_HTML_NAME
    response = client.get(f"{PREFIX}/series?run={quote(run)}&tag={quote(metadata.TAG_TIERS)}")
    assert response.status_code == 200
    assert json.loads(response.data)["run"] == run


# -- /oom ----------------------------------------------------------------------------------


def test_oom_returns_the_latest_postmortem_as_written(client):
    status, body = get_json(client, "/oom", run=synthetic.OOM_RUN)
    assert status == 200
    want = synthetic.oom_postmortem(synthetic.OOM_RUN)
    assert body["run"] == synthetic.OOM_RUN
    assert (body["step"], body["count"]) == (synthetic.OOM_STEP, 1)
    assert body["wall_time"] == synthetic.wall_time(synthetic.OOM_STEP)
    assert body["postmortem"] == json.loads(json.dumps(want))
    pm = body["postmortem"]
    assert pm["failed_request"]["bytes"] == 96 * 2**20
    assert [a["rank"] for a in pm["advice"]] == [2, 1, 3]  # as written; the view sorts
    assert len(pm["recent_steps"]) == synthetic.OOM_RECENT_STEPS
    # A run that did not run out of memory: 404 naming the runs that did.
    status, body = get_json(client, "/oom", run=synthetic.RUN_HTML_NAME)
    assert status == 404, body
    assert body["error"]["message"] == (
        f"Not found: run {synthetic.RUN_HTML_NAME!r} has no OOM record (it did not run out "
        f"of memory); runs with one: [{synthetic.OOM_RUN!r}]"
    )
    status, body = get_json(client, "/oom", run="no_such_run")
    assert status == 404 and "no memory_hierarchy run 'no_such_run'" in body["error"]["message"]
    status, body = get_json(client, "/oom")
    assert status == 400 and "'run' is required" in body["error"]["message"]


def test_synthetic_oom_file_matches_the_tag(synthetic_logdir):
    with open(os.path.join(synthetic_logdir, synthetic.OOM_RUN, synthetic.OOM_FILE)) as fh:
        assert json.load(fh) == json.loads(json.dumps(synthetic.oom_postmortem(synthetic.OOM_RUN)))


# -- live tuning: /tuning and /tune --------------------------------------------------------

MIB = 2**20
TUNED_RUN = "exp/job"  # a nested run: the run name is a relative path
STARTED = ZeroConfig(device_budget_bytes=512 * MIB)
HEADERS = {tuning.HEADER_NAME: tuning.HEADER_VALUE}


def write_tuned_run(logdir) -> str:
    """A run as the runtime writes it: run_info with its config, tiers, and one applied
    live-tuning decision (telemetry 1 -> 4 from step 3) made by the real ControlChannel."""
    run_dir = os.path.join(str(logdir), TUNED_RUN)
    writer = SummaryWriter(run_dir)
    writer.json(metadata.TAG_RUN_INFO, 0, {"stage": 1, "config": STARTED.to_dict()})
    for step in range(6):
        writer.matrix(metadata.TAG_TIERS, step, synthetic.tiers("alpha", step))
    channel = control.ControlChannel(run_dir, STARTED)
    control.write_request(run_dir, {"telemetry_every_n_steps": 4})
    outcome = channel.poll(3)
    assert outcome.status is control.Status.APPLIED
    writer.json(metadata.TAG_CONFIG_EVENT, 3, outcome.to_dict())
    writer.close()
    # The plugin's tests start from a run directory with no request in it.
    os.remove(os.path.join(run_dir, control.REQUEST_FILE))
    os.remove(os.path.join(run_dir, control.ACK_FILE))
    return run_dir


@pytest.fixture
def tuned(plugin_client, tmp_path):
    """(client with --memory_hierarchy_tuning, run directory) over a fresh logdir."""
    logdir = tmp_path / "logs"
    run_dir = write_tuned_run(logdir)
    return plugin_client(str(logdir), tuning=True), run_dir


def post_tune(client, body, run=TUNED_RUN, headers=HEADERS, content_type="application/json"):
    """POST /tune; returns (status, decoded JSON body)."""
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    response = client.post(
        f"{PREFIX}/tune?{urlencode({'run': run})}" if run is not None else f"{PREFIX}/tune",
        data=data,
        headers=headers,
        content_type=content_type,
    )
    assert response.headers["Content-Type"].startswith("application/json"), response.data[:200]
    return response.status_code, json.loads(response.get_data(as_text=True))


def test_tuning_lists_keys_bounds_and_values_in_effect(tuned):
    client, _run_dir = tuned
    status, body = get_json(client, "/tuning", run=TUNED_RUN)
    assert status == 200
    assert body["enabled"] is True and body["flag"] == "--memory_hierarchy_tuning"
    keys = {k["key"]: k for k in body["keys"]}
    assert list(keys) == list(tuning.TUNABLE_KEYS)
    assert keys["device_budget_bytes"] == {
        "key": "device_budget_bytes",
        "unit": "bytes",
        "min": 64 * 1024,
        "max": 2**50,
        "description": "bytes the runtime may place on the device tier",
        "takes_effect": "next step (budget check; stage 3: device tier capacity, pages move)",
        "acts": True,
        "value": 512 * MIB,
        "recorded": True,
        "since_step": None,
        "version": 0,
    }
    telemetry = keys["telemetry_every_n_steps"]
    assert (telemetry["unit"], telemetry["min"], telemetry["max"]) == ("steps", 1, 1_000_000)
    assert (telemetry["value"], telemetry["since_step"], telemetry["version"]) == (4, 3, 1)
    assert keys["host_budget_bytes"]["value"] is None  # unbounded as started
    assert keys["persistence_threshold"]["takes_effect"].startswith("rebuild")
    assert keys["persistence_threshold"]["acts"] is False  # part of stage 3's traced plan
    assert keys["prefetch_bucket_size"]["acts"] is (STARTED.stage == 3)  # stage 3 + NVMe only
    assert body["config_version"] == 1
    assert body["request"]["state"] == "none"
    assert body["run_dir_error"] is None
    assert body["job_ended"] is None  # no post-mortem: the job may still run
    status, body = get_json(client, "/tuning", run="nope")
    assert status == 404


def test_tuning_states_answers_every_named_run_in_one_request(tuned):
    """The view's poll: one GET /tuning_states for all its runs, each run's answer equal
    to its own GET /tuning; an unknown run gets its 404 inside, not the whole request."""
    client, _run_dir = tuned
    _status, single = get_json(client, "/tuning", run=TUNED_RUN)
    response = client.get(
        f"{PREFIX}/tuning_states?{urlencode([('run', TUNED_RUN), ('run', 'nope')])}"
    )
    assert response.status_code == 200
    body = json.loads(response.get_data(as_text=True))
    assert body["runs"][TUNED_RUN] == single
    assert body["runs"]["nope"]["error"]["code"] == 404
    status, every = get_json(client, "/tuning_states")
    assert status == 200 and every == {"runs": {TUNED_RUN: single}}
    too_many = urlencode([("run", "r")] * 1001)
    assert client.get(f"{PREFIX}/tuning_states?{too_many}").status_code == 400


def test_tune_writes_a_versioned_request_and_tuning_follows_the_runtime(tuned):
    client, run_dir = tuned
    status, body = post_tune(client, {"updates": {"telemetry_every_n_steps": 3}})
    assert status == 200, body
    assert (body["version"], body["updates"]) == (1, {"telemetry_every_n_steps": 3})
    assert body["request"]["state"] == "pending"
    with open(os.path.join(run_dir, control.REQUEST_FILE)) as fh:
        written = json.load(fh)
    assert (written["version"], written["updates"]) == (1, {"telemetry_every_n_steps": 3})
    # A second request before the job decided keeps the first one's change.
    status, body = post_tune(client, {"updates": {"device_budget_bytes": 256 * MIB}})
    assert status == 200
    assert body["version"] == 2
    assert body["updates"] == {"telemetry_every_n_steps": 3, "device_budget_bytes": 256 * MIB}
    _status, view = get_json(client, "/tuning", run=TUNED_RUN)
    assert (view["request"]["state"], view["request"]["version"]) == ("pending", 2)
    # The real runtime channel decides at a step boundary; /tuning reads its ack.
    channel = control.ControlChannel(run_dir, STARTED)
    assert channel.poll(57).status is control.Status.APPLIED
    _status, view = get_json(client, "/tuning", run=TUNED_RUN)
    request = view["request"]
    assert (request["state"], request["version"], request["step"]) == ("applied", 2, 57)
    assert request["changes"] == {
        "telemetry_every_n_steps": {"old": 1, "new": 3},
        "device_budget_bytes": {"old": 512 * MIB, "new": 256 * MIB},
    }
    keys = {k["key"]: k for k in view["keys"]}
    # The ack is newer than the events TensorBoard loaded: its changes are in effect.
    assert (keys["device_budget_bytes"]["value"], keys["device_budget_bytes"]["since_step"]) == (
        256 * MIB,
        57,
    )
    assert keys["telemetry_every_n_steps"]["value"] == 3
    # A value within the key's bounds that the runtime refuses (a budget under one 4 MiB
    # page) is written, then rejected by the job with its reason.
    status, body = post_tune(client, {"updates": {"device_budget_bytes": 64 * 1024}})
    assert (status, body["version"]) == (200, 3)
    assert channel.poll(60).status is control.Status.REJECTED
    _status, view = get_json(client, "/tuning", run=TUNED_RUN)
    request = view["request"]
    assert (request["state"], request["version"], request["step"]) == ("rejected", 3, 60)
    assert "at least one page" in request["reason"]


BIG = json.dumps({"updates": {"telemetry_every_n_steps": 3}, "pad": "x" * 5000})


@pytest.mark.parametrize(
    ("body", "kwargs", "status", "needle"),
    [
        ({"updates": {"telemetry_every_n_steps": 3}}, {"headers": {}}, 403, "X-Memory-Hierarchy"),
        (
            {"updates": {"telemetry_every_n_steps": 3}},
            {"headers": {tuning.HEADER_NAME: "0"}},
            403,
            "X-Memory-Hierarchy",
        ),
        ("updates=3", {"content_type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
        ({"updates": {"telemetry_every_n_steps": 3}}, {"content_type": "text/plain"}, 415, "text"),
        (BIG, {}, 413, "larger than 4096 bytes"),
        ('{"updates": {"telemetry_every_n_steps": 3', {}, 400, "not valid JSON"),
        (b'{"updates": {"telemetry_every_n_steps": "\xff"}}', {}, 400, ""),
        ('{"updates": {"telemetry_every_n_steps": NaN}}', {}, 400, "NaN is not a number"),
        ('{"updates": {"device_budget_bytes": Infinity}}', {}, 400, "Infinity"),
        ('{"updates": {"device_budget_bytes": -Infinity}}', {}, 400, "-Infinity"),
        ({"updates": {"telemetry_every_n_steps": True}}, {}, 400, "got bool"),
        ({"updates": {"telemetry_every_n_steps": 3.0}}, {}, 400, "got float"),
        ({"updates": {"telemetry_every_n_steps": "3"}}, {}, 400, "got str"),
        ({"updates": {"telemetry_every_n_steps": None}}, {}, 400, "got None"),
        ({"updates": {"telemetry_every_n_steps": 0}}, {}, 400, "in [1, 1_000_000]"),
        ({"updates": {"telemetry_every_n_steps": 1_000_001}}, {}, 400, "in [1, 1_000_000]"),
        ({"updates": {"device_budget_bytes": 1}}, {}, 400, "device_budget_bytes=1 is invalid"),
        ({"updates": {"device_budget_bytes": 2**50 + 1}}, {}, 400, "is invalid"),
        ({"updates": {"device_budget": 1}}, {}, 400, "unknown key 'device_budget'"),
        ({"updates": {"stage": 3}}, {}, 400, "cannot be tuned live"),
        ({"updates": {}}, {}, 400, "non-empty"),
        ({"updates": [1]}, {}, 400, "non-empty"),
        ({"updates": {"telemetry_every_n_steps": 3}, "x": 1}, {}, 400, "nothing else"),
        ([1, 2], {}, 400, "nothing else"),
        (
            '{"updates": {"telemetry_every_n_steps": 3, "telemetry_every_n_steps": 5}}',
            {},
            400,
            "duplicate key",
        ),
        ({"updates": {"telemetry_every_n_steps": 3}}, {"run": "../outside"}, 400, "not a path"),
        ({"updates": {"telemetry_every_n_steps": 3}}, {"run": "exp/../exp/job"}, 400, "not a"),
        ({"updates": {"telemetry_every_n_steps": 3}}, {"run": "/tmp"}, 400, "not a path"),
        ({"updates": {"telemetry_every_n_steps": 3}}, {"run": "exp\\job"}, 400, "not a path"),
        ({"updates": {"telemetry_every_n_steps": 3}}, {"run": "exp"}, 404, "no memory_hierarchy"),
        ({"updates": {"telemetry_every_n_steps": 3}}, {"run": None}, 400, "'run' is required"),
    ],
)
def test_refused_tune_requests_write_nothing(tuned, body, kwargs, status, needle):
    client, run_dir = tuned
    logdir = os.path.dirname(os.path.dirname(run_dir))
    before = sorted(os.walk(logdir))
    got, answer = post_tune(client, body, **kwargs)
    assert got == status, answer
    assert answer["error"]["code"] == status
    assert needle in answer["error"]["message"]
    assert sorted(os.walk(logdir)) == before  # no request, no temporary file
    assert not os.path.exists(os.path.join(run_dir, control.REQUEST_FILE))


def test_tune_accepts_only_post(tuned):
    client, run_dir = tuned
    for method in ("GET", "PUT", "DELETE"):
        response = client.open(f"{PREFIX}/tune?run={quote(TUNED_RUN)}", method=method)
        assert response.status_code == 405, method
        assert response.headers["Allow"] == "POST"
    assert not os.path.exists(os.path.join(run_dir, control.REQUEST_FILE))


@pytest.mark.parametrize("flag", [None, False], ids=["flag_absent", "flag_false"])
def test_tuning_off_refuses_to_write_and_says_how_to_enable(plugin_client, tmp_path, flag):
    logdir = tmp_path / "logs"
    run_dir = write_tuned_run(logdir)
    client = plugin_client(str(logdir), tuning=flag)
    before = sorted(os.listdir(run_dir))
    status, body = post_tune(client, {"updates": {"telemetry_every_n_steps": 3}})
    assert status == 403
    assert "start TensorBoard with --memory_hierarchy_tuning" in body["error"]["message"]
    assert sorted(os.listdir(run_dir)) == before
    assert not os.path.exists(os.path.join(run_dir, control.REQUEST_FILE))
    status, view = get_json(client, "/tuning", run=TUNED_RUN)  # still readable
    assert status == 200 and view["enabled"] is False
    assert {k["key"]: k["value"] for k in view["keys"]}["telemetry_every_n_steps"] == 4


def test_symlinked_run_leading_out_of_the_logdir_is_refused(tmp_path):
    logdir, outside = tmp_path / "logs", tmp_path / "outside"
    (logdir / "real").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, logdir / "escape")
    known = ("real", "escape", ".")
    assert tuning.resolve_run_dir(str(logdir), "real", known) == str((logdir / "real").resolve())
    assert tuning.resolve_run_dir(str(logdir), ".", known) == str(logdir.resolve())
    with pytest.raises(errors.InvalidArgumentError, match="outside the logdir"):
        tuning.resolve_run_dir(str(logdir), "escape", known)
    with pytest.raises(errors.NotFoundError):
        tuning.resolve_run_dir(str(logdir), "other", known)
    with pytest.raises(errors.InvalidArgumentError, match="local directory"):
        tuning.resolve_run_dir("gs://bucket/logs", "real", known)
    assert os.listdir(outside) == []


def test_the_loader_defines_the_flag_and_tensorboard_parses_it():
    from tensorboard import program
    from tensorboard.plugins.core import core_plugin

    tb = program.TensorBoard(plugins=[core_plugin.CorePluginLoader, MemoryHierarchyLoader])
    tb.configure(argv=["tensorboard", "--logdir", "/tmp/x"])
    assert tb.flags.memory_hierarchy_tuning is False
    tb.configure(argv=["tensorboard", "--logdir", "/tmp/x", "--memory_hierarchy_tuning"])
    assert tb.flags.memory_hierarchy_tuning is True
    tb.configure(argv=["tensorboard", "--logdir", "/tmp/x", "--memory_hierarchy_tuning=false"])
    assert tb.flags.memory_hierarchy_tuning is False
    assert parse_bool_flag("TRUE") is True and parse_bool_flag("0") is False
    from importlib import metadata as importlib_metadata

    (entry,) = [
        e
        for e in importlib_metadata.entry_points(group="tensorboard_plugins")
        if e.name == metadata.PLUGIN_NAME
    ]
    assert entry.load() is MemoryHierarchyLoader


def test_request_state_pending_applied_rejected_ignored():
    req = {"version": 2, "updates": {"telemetry_every_n_steps": 3}, "requested_at": 100.0}
    assert tuning.request_state(None, None)["state"] == "none"
    assert tuning.request_state(req, None)["state"] == "pending"
    older = {"version": 1, "status": "applied", "step": 5, "changes": {}, "reason": None}
    assert tuning.request_state(req, older)["state"] == "pending"
    done = {**older, "version": 2, "step": 9, "decided_at": 101.0}
    assert (tuning.request_state(req, done)["state"], tuning.request_state(req, done)["step"]) == (
        "applied",
        9,
    )
    unreadable = {"version": -1, "status": "rejected", "step": 9, "reason": "bad", "decided_at": 1}
    assert tuning.request_state(req, unreadable)["state"] == "pending"  # decided before
    unreadable["decided_at"] = 200.0
    assert tuning.request_state(req, unreadable)["state"] == "rejected"
    ignored = {**done, "status": "ignored", "reason": "version 2 is not newer than 2"}
    assert tuning.request_state(req, ignored)["reason"].startswith("version 2")


# -- malformed tuning records -------------------------------------------------------------

APPLIED = {"status": "applied", "reason": None, "decided_at": 1.0}
NINE = {"telemetry_every_n_steps": {"old": 4, "new": 9}}  # a change that must not count


@pytest.mark.parametrize(
    ("event", "ack", "needles"),
    [
        ({**APPLIED, "version": "two", "step": 4, "changes": NINE}, None, ["'version'", "'two'"]),
        ({**APPLIED, "version": None, "step": 4, "changes": NINE}, None, ["'version'", "None"]),
        ({**APPLIED, "version": 1.5, "step": 4, "changes": NINE}, None, ["'version'", "1.5"]),
        ({**APPLIED, "version": True, "step": 4, "changes": NINE}, None, ["'version'", "True"]),
        ({**APPLIED, "version": 2, "step": "four", "changes": NINE}, None, ["'step'", "'four'"]),
        ({**APPLIED, "version": 2, "step": 4.5, "changes": NINE}, None, ["'step'", "4.5"]),
        ([1, 2], None, ["not a JSON object"]),
        (None, {**APPLIED, "version": "two", "step": 4, "changes": NINE}, ["'version'", "'two'"]),
        (None, {**APPLIED, "version": 2, "step": "x", "changes": NINE}, ["'step'", "'x'"]),
        (None, {**APPLIED, "version": 2, "step": None, "changes": NINE}, ["'step'", "None"]),
        (None, {**APPLIED, "version": [2], "step": 4, "changes": NINE}, ["'version'", "[2]"]),
        (None, [2, "applied"], ["not a JSON object"]),
    ],
)
def test_tuning_skips_and_reports_malformed_config_events_and_acks(
    plugin_client, tmp_path, event, ack, needles
):
    logdir = tmp_path / "logs"
    run_dir = write_tuned_run(logdir)
    if event is not None:
        writer = SummaryWriter(run_dir)
        writer.json(metadata.TAG_CONFIG_EVENT, 4, event)
        writer.close()
    if ack is not None:
        with open(os.path.join(run_dir, control.ACK_FILE), "w") as fh:
            json.dump(ack, fh)
    client = plugin_client(str(logdir), tuning=True)
    status, body = get_json(client, "/tuning", run=TUNED_RUN)
    assert status == 200, body
    keys = {k["key"]: k for k in body["keys"]}
    # The malformed record is skipped: the one well-formed decision (1 -> 4) stays in effect.
    assert (keys["telemetry_every_n_steps"]["value"], body["config_version"]) == (4, 1)
    (problem,) = body["data_errors"]
    where = control.ACK_FILE if ack is not None else f"{metadata.TAG_CONFIG_EVENT} at step 4"
    assert where in problem and "skipped" in problem
    for needle in needles:
        assert needle in problem, problem
    if ack is not None:
        assert body["request"]["state"] == "none"


def test_tuning_of_well_formed_records_reports_no_data_errors(tuned):
    client, _run_dir = tuned
    status, body = get_json(client, "/tuning", run=TUNED_RUN)
    assert (status, body["data_errors"]) == (200, [])


@pytest.mark.parametrize("version", ["two", None, [1]])
def test_tune_over_a_malformed_ack_answers_a_json_conflict_and_writes_nothing(tuned, version):
    client, run_dir = tuned
    control.write_request(run_dir, {"telemetry_every_n_steps": 3})
    ack = {**APPLIED, "version": version, "step": 4, "changes": {}}
    with open(os.path.join(run_dir, control.ACK_FILE), "w") as fh:
        json.dump(ack, fh)
    with open(os.path.join(run_dir, control.REQUEST_FILE)) as fh:
        before = fh.read()
    status, body = post_tune(client, {"updates": {"device_budget_bytes": 256 * MIB}})
    assert status == 409, body
    message = body["error"]["message"]
    assert control.ACK_FILE in message and repr(version) in message
    assert "nothing was written" in message
    with open(os.path.join(run_dir, control.REQUEST_FILE)) as fh:
        assert fh.read() == before
    # The server is still up and the run still readable.
    status, view = get_json(client, "/tuning", run=TUNED_RUN)
    assert status == 200 and view["data_errors"]


def test_a_job_that_ran_out_of_memory_is_not_offered_tuning(plugin_client, tmp_path):
    """A run whose last record is its OOM post-mortem is dead: GET /tuning says so and
    POST /tune answers 409 and writes nothing."""
    logdir = tmp_path / "logs"
    run_dir = write_tuned_run(logdir)
    writer = SummaryWriter(run_dir)
    writer.json(metadata.TAG_OOM, 5, {"summary": "Step 5 ran out of memory on the device tier"})
    writer.close()
    client = plugin_client(str(logdir), tuning=True)
    status, body = get_json(client, "/tuning", run=TUNED_RUN)
    assert status == 200
    assert body["job_ended"] == {
        "reason": "oom",
        "step": 5,
        "summary": "Step 5 ran out of memory on the device tier",
    }
    status, body = post_tune(client, {"updates": {"telemetry_every_n_steps": 3}})
    assert status == 409, body
    assert "out-of-memory failure at step 5" in body["error"]["message"]
    assert not os.path.exists(os.path.join(run_dir, control.REQUEST_FILE))


def test_a_job_that_closed_is_not_offered_tuning_until_a_job_starts_again(plugin_client, tmp_path):
    """A run whose job closed normally (the runtime's close marker) is ended too: GET
    /tuning says so, POST /tune answers 409 naming the last step and writes nothing; a
    job starting again in the run directory (a new ControlChannel) takes the marker away."""
    logdir = tmp_path / "logs"
    run_dir = write_tuned_run(logdir)
    control.ControlChannel(run_dir, STARTED).mark_closed(12)
    client = plugin_client(str(logdir), tuning=True)
    status, body = get_json(client, "/tuning", run=TUNED_RUN)
    assert status == 200
    assert body["job_ended"] == {"reason": "closed", "step": 12, "summary": None}
    status, body = post_tune(client, {"updates": {"telemetry_every_n_steps": 3}})
    assert status == 409, body
    assert "has ended (closed after step 11)" in body["error"]["message"]
    assert not os.path.exists(os.path.join(run_dir, control.REQUEST_FILE))
    for flag in (None, False):  # tuning off: 409 too, not 403 "start TensorBoard with ..."
        status, body = post_tune(
            plugin_client(str(logdir), tuning=flag), {"updates": {"telemetry_every_n_steps": 3}}
        )
        assert status == 409, body
        assert "has ended (closed after step 11)" in body["error"]["message"], body
    assert not os.path.exists(os.path.join(run_dir, control.REQUEST_FILE))
    control.ControlChannel(run_dir, STARTED)  # a job starts again here
    status, body = get_json(client, "/tuning", run=TUNED_RUN)
    assert status == 200 and body["job_ended"] is None
    status, body = post_tune(client, {"updates": {"telemetry_every_n_steps": 3}})
    assert status == 200, body


# -- DNS rebinding: POST /tune checks Host and Origin --------------------------------------

FQDN = socket.getfqdn()
LOCAL = {"SERVER_NAME": "127.0.0.1", "SERVER_PORT": "6006"}  # as werkzeug's server sets them
WILDCARD = {"SERVER_NAME": "::", "SERVER_PORT": "6006"}  # --bind_all
NAMED = {"SERVER_NAME": "10.0.0.5", "SERVER_PORT": "6006"}  # --host myhost.example


@pytest.mark.parametrize(
    ("flags", "server", "host", "origin", "accepted"),
    [
        ({}, LOCAL, "127.0.0.1:6006", "http://127.0.0.1:6006", True),
        ({}, LOCAL, "localhost:6006", "http://localhost:6006", True),
        ({}, LOCAL, "LocalHost:6006", "http://localhost:6006", True),
        ({}, LOCAL, "127.0.0.1:6006", None, True),  # curl, urllib: no Origin
        ({}, LOCAL, "localhost:16006", "http://localhost:16006", True),  # ssh -L 16006:...:6006
        ({}, LOCAL, "[::1]:6006", "http://[::1]:6006", True),
        ({}, LOCAL, "evil.example:6006", "http://evil.example:6006", False),  # rebinding
        ({}, LOCAL, "evil.example:6006", None, False),
        ({}, LOCAL, "localhost.evil.example:6006", "http://localhost.evil.example:6006", False),
        ({}, LOCAL, "127.0.0.1.nip.io:6006", "http://127.0.0.1.nip.io:6006", False),
        ({}, LOCAL, "127.0.0.1:6006", "http://evil.example:6006", False),  # cross-origin
        ({}, LOCAL, "127.0.0.1:6006", "http://127.0.0.1:7007", False),
        ({}, LOCAL, "127.0.0.1:6006", "null", False),  # sandboxed frame, file:
        ({}, LOCAL, "127.0.0.1:6006", "ftp://127.0.0.1:6006", False),
        ({}, LOCAL, "192.168.1.20:6006", "http://192.168.1.20:6006", False),  # not bound there
        ({}, LOCAL, "", None, False),
        ({}, LOCAL, "127.0.0.1:6006@evil.example", None, False),
        ({"bind_all": True}, WILDCARD, "192.168.1.20:6006", "http://192.168.1.20:6006", True),
        ({"bind_all": True}, WILDCARD, "[fe80::1]:6006", "http://[fe80::1]:6006", True),
        ({"bind_all": True}, WILDCARD, f"{FQDN}:6006", f"http://{FQDN}:6006", True),
        ({"bind_all": True}, WILDCARD, "evil.example:6006", "http://evil.example:6006", False),
        ({"bind_all": True}, WILDCARD, "192.168.1.20:7007", None, False),  # not the bound port
        ({"host": "myhost.example"}, NAMED, "myhost.example:6006", None, True),
        ({"host": "myhost.example"}, NAMED, "10.0.0.5:6006", "http://10.0.0.5:6006", True),
        ({"host": "myhost.example"}, NAMED, "myhost.example:7007", None, False),
        ({"host": "myhost.example"}, NAMED, "evil.example:6006", None, False),
    ],
)
def test_tune_checks_host_and_origin_against_the_served_address(
    plugin_client, tmp_path, flags, server, host, origin, accepted
):
    logdir = tmp_path / "logs"
    run_dir = write_tuned_run(logdir)
    client = plugin_client(str(logdir), tuning=True, flags=flags)
    headers = {**HEADERS, "Host": host}
    if origin is not None:
        headers["Origin"] = origin
    response = client.post(
        f"{PREFIX}/tune?{urlencode({'run': TUNED_RUN})}",
        data=json.dumps({"updates": {"telemetry_every_n_steps": 3}}),
        headers=headers,
        content_type="application/json",
        environ_overrides=server,
    )
    body = json.loads(response.get_data(as_text=True))
    written = os.path.exists(os.path.join(run_dir, control.REQUEST_FILE))
    if accepted:
        assert (response.status_code, body["version"], written) == (200, 1, True), body
    else:
        assert (response.status_code, written) == (403, False), body
        assert body["error"]["code"] == 403
        assert "DNS rebinding" in body["error"]["message"]


@pytest.mark.slow
def test_a_real_tensorboard_refuses_a_rebinding_host_and_accepts_its_own(
    tensorboard_server, tmp_path
):
    """The guard reads the bound address from werkzeug's real server (``SERVER_NAME``,
    ``SERVER_PORT``): a real ``tensorboard --host 127.0.0.1 --memory_hierarchy_tuning``."""
    import urllib.error
    import urllib.request

    logdir = tmp_path / "logs"
    run_dir = write_tuned_run(logdir)
    server = tensorboard_server(
        str(logdir), load_fast=False, reload_interval=1, extra_args=("--memory_hierarchy_tuning",)
    )
    deadline = time.monotonic() + 60.0  # s; TensorBoard loads the logdir in the background
    while True:
        with urllib.request.urlopen(f"{server.url}{PREFIX}/runs", timeout=30) as response:
            if TUNED_RUN in [r["run"] for r in json.loads(response.read())["runs"]]:
                break
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.5)

    def post(host: str) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"{server.url}{PREFIX}/tune?{urlencode({'run': TUNED_RUN})}",
            data=json.dumps({"updates": {"telemetry_every_n_steps": 3}}).encode(),
            headers={
                **HEADERS,
                "Content-Type": "application/json",
                "Host": host,
                "Origin": f"http://{host}",
            },
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, body = post(f"evil.example:{server.port}")
    assert status == 403 and "DNS rebinding" in body["error"]["message"], body
    assert f"on port {server.port}: 127.0.0.1" in body["error"]["message"]
    assert not os.path.exists(os.path.join(run_dir, control.REQUEST_FILE))
    status, body = post(f"127.0.0.1:{server.port}")
    assert (status, body["version"]) == (200, 1), body
    status, body = post(f"localhost:{server.port}")
    assert (status, body["version"]) == (200, 2), body
