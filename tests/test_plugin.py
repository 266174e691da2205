"""Tests of tb_plugin.plugin through TensorBoard's real WSGI app and real event files.

The app is ``TensorBoardWSGIApp`` with the plugin and a real data provider (the Python
multiplexer); the logdirs are written with the real write API (``tb_plugin.summary``) or,
for malformed data, with TensorBoard's own event writer.
"""

from __future__ import annotations

import json
import math
import os
from urllib.parse import quote, urlencode

import numpy as np
import pytest
from helpers import synthetic
from tensorboard import errors
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins import base_plugin
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.util import tensor_util

from tb_plugin import metadata, plugin
from tb_plugin.summary import SummaryWriter

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
    for entry in body["runs"]:
        assert entry["tags"] == {
            metadata.TAG_TIERS: {
                "kind": "matrix",
                "max_step": last,
                "max_wall_time": synthetic.wall_time(last),
            },
            metadata.TAG_READINGS: {
                "kind": "vector",
                "max_step": last,
                "max_wall_time": synthetic.wall_time(last),
            },
            metadata.TAG_RUN_INFO: {
                "kind": "json",
                "max_step": 0,
                "max_wall_time": synthetic.wall_time(0),
            },
        }


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


# -- errors --------------------------------------------------------------------------------

LONG = "x" * (plugin.MAX_QUERY_VALUE_CHARS + 1)
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
        ("/series", {"run": "alpha", "tag": INFO_TAG}, 400, "json tag"),
        ("/series", {"run": "nope", "tag": TIERS_TAG}, 404, "no memory_hierarchy data"),
        ("/series", {"run": "alpha", "tag": "memory_hierarchy/nope"}, 404, "no memory_hierarchy"),
        ("/json", {"tag": INFO_TAG}, 400, "'run' is required"),
        ("/json", {"run": "alpha", "tag": TIERS_TAG}, 400, "matrix tag"),
        ("/json", {"run": "nope", "tag": INFO_TAG}, 404, "no memory_hierarchy data"),
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
    p = plugin.MemoryHierarchyPlugin(base_plugin.TBContext(), static_dir=str(static))
    assert p.static_impl("ok.js") == (b"export {};", "text/javascript")
    with pytest.raises(errors.NotFoundError):
        p.static_impl("evil.js")


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
    assert plugin.DEFAULT_POINTS < SPIKE_STEPS
    assert len(body["steps"]) <= plugin.DEFAULT_POINTS and body["downsampled"] is True
    assert max(body["values"]["device"]["used_bytes"]) == SPIKE_BYTES
    status, body = get_json(spike_client, "/series", run="spiky", tag=tag, points=SPIKE_STEPS)
    assert status == 200
    assert body["steps"] == list(range(SPIKE_STEPS)) and body["downsampled"] is False


@pytest.mark.parametrize("budget", [2, 3, 10, 64, 999])
def test_peak_keeping_indices_keeps_every_series_extremes(budget):
    rng = np.random.default_rng(budget)
    values = rng.normal(size=(5000, 3))  # [N, S]
    values[::97, 2] = np.nan  # partly unmeasured
    values[:, 1] = np.nan  # never measured: ignored
    keep = peak_keeping_indices_checked(values, budget)
    for s in (0, 2):
        assert np.nanargmax(values[:, s]) in keep
        assert np.nanargmin(values[:, s]) in keep
    assert len(keep) <= max(budget, 2 * 2 + 2)
    assert keep[0] == 0 and keep[-1] == 4999


def peak_keeping_indices_checked(values: np.ndarray, budget: int) -> list[int]:
    """Run peak_keeping_indices and check its indices are sorted, unique and in range."""
    keep = plugin.peak_keeping_indices(values, budget).tolist()
    assert keep == sorted(set(keep))
    assert all(0 <= i < len(values) for i in keep)
    return keep


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
