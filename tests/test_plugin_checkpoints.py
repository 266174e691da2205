"""GET /checkpoints of tb_plugin.plugin: a run's checkpoint saves and restores.

Through TensorBoard's real WSGI app (``plugin_client``) over (a) the session's synthetic
logdir, whose ``memory_hierarchy/checkpoint`` records are written by the real summary
writer (``helpers.synthetic.checkpoint``), and (b) the event file of a tiny real job
(2 replicas, stage 1) that saved and restored through the real
``ZeroInfinityStrategy.save_checkpoint`` / ``load_checkpoint`` (CheckpointManager).
"""

from __future__ import annotations

import json
from urllib.parse import urlencode

import pytest
from helpers import synthetic

from tb_plugin import metadata

PREFIX = "/data/plugin/memory_hierarchy"
MIB = 2**20


def get_json(client, route: str, **params) -> tuple[int, dict]:
    """GET a plugin route; returns (status, decoded JSON body)."""
    response = client.get(f"{PREFIX}{route}?{urlencode(params)}" if params else PREFIX + route)
    assert response.headers["Content-Type"].startswith("application/json"), response.data[:200]
    return response.status_code, json.loads(response.get_data(as_text=True))


@pytest.fixture(scope="module")
def client(plugin_client, synthetic_logdir):
    """A test client over the session's synthetic logdir."""
    return plugin_client(synthetic_logdir)


def test_checkpoints_lists_each_record_with_bandwidth(client):
    status, body = get_json(client, "/checkpoints", run=synthetic.RUN_STANDIN)
    assert status == 200
    assert body["run"] == synthetic.RUN_STANDIN
    rows = body["checkpoints"]
    assert [(r["step"], r["op"], r["tag"]) for r in rows] == [
        (15, "save", "step00000015"),
        (35, "save", "step00000035"),
    ]
    assert [r["wall_time"] for r in rows] == [synthetic.wall_time(15), synthetic.wall_time(35)]
    assert [r["bytes"] for r in rows] == [48 * MIB, 48 * MIB]
    assert [r["seconds"] for r in rows] == [0.25, 0.5]
    # bytes / seconds: 48 MiB in 0.25 s = 201,326,592 B/s; in 0.5 s half of it.
    assert [r["bytes_per_second"] for r in rows] == [201_326_592.0, 100_663_296.0]
    assert rows[0]["path"] == "/ckpt/alph/step00000015"
    assert (rows[0]["replicas"], rows[0]["rank"], rows[0]["saved_replicas"]) == (2, 0, None)


def test_checkpoints_of_the_html_run_keep_text_and_restore_fields(client):
    status, body = get_json(client, "/checkpoints", run=synthetic.RUN_HTML_NAME)
    assert status == 200
    rows = body["checkpoints"]
    assert [(r["step"], r["op"], r["tag"]) for r in rows] == [
        (25, "save", synthetic.HTML_CHECKPOINT_TAG),
        (45, "restore", "step00000045"),
    ]
    assert rows[1]["saved_replicas"] == 2
    assert [r["bytes_per_second"] for r in rows] == [12 * MIB / 0.125, 12 * MIB / 0.0625]
    want = [synthetic.checkpoint(synthetic.RUN_HTML_NAME, s) for s in (25, 45)]
    for row, record in zip(rows, want, strict=True):
        assert {k: row[k] for k in record} == record


@pytest.mark.parametrize(
    ("params", "status", "message"),
    [
        ({}, 400, "'run' is required"),
        ({"run": ""}, 400, "'run' is required"),
        ({"run": "x" * 1025}, 400, "longer than 1024"),
        ({"run": "../alpha"}, 400, "not a path inside the logdir"),
        ({"run": "alpha/../../etc"}, 400, "not a path inside the logdir"),
        ({"run": "/etc/passwd"}, 400, "not a path inside the logdir"),
        ({"run": "..\\alpha"}, 400, "not a path inside the logdir"),
        ({"run": "alpha\0"}, 400, "not a path inside the logdir"),
        ({"run": "gamma"}, 404, "no memory_hierarchy run 'gamma'"),
        ({"run": "alpha/.."}, 400, "not a path inside the logdir"),
    ],
)
def test_checkpoints_refuses_bad_runs(client, params, status, message):
    got, body = get_json(client, "/checkpoints", **params)
    assert got == status
    assert body["error"]["code"] == status
    assert message in body["error"]["message"]


def test_checkpoints_of_a_run_without_records_is_empty(plugin_client, tmp_path):
    from tb_plugin.summary import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "plain"))
    writer.matrix(metadata.TAG_TIERS, 0, synthetic.tiers("alpha", 0))
    writer.close()
    status, body = get_json(plugin_client(str(tmp_path)), "/checkpoints", run="plain")
    assert (status, body) == (200, {"run": "plain", "checkpoints": []})


@pytest.fixture(scope="module")
def real_job(tmp_path_factory):
    """A tiny stage-1 job on 2 replicas that trained 2 steps, saved (strategy.save_checkpoint)
    and restored into a fresh model (load_checkpoint), logging to ``<logdir>/job``.
    Returns (logdir, save result, restore info)."""
    from helpers import checkpoint_job as job

    import zero_runtime

    base = tmp_path_factory.mktemp("ckpt_plugin")
    logdir = base / "logs"
    strategy = zero_runtime.ZeroInfinityStrategy(
        job.config(1, "cpu", str(base)), logdir=str(logdir / "job")
    )
    model = job.build(strategy)
    try:
        job.train(model, 0, 2)
        result = strategy.save_checkpoint(str(base / "ckpt"), model)
        info = strategy.load_checkpoint(str(base / "ckpt"), job.build(strategy, seed=5))
    finally:
        if hasattr(model, "close"):
            model.close()
        strategy.close()
    return str(logdir), result, info


def test_checkpoints_from_a_real_checkpoint_manager(plugin_client, real_job):
    logdir, result, info = real_job
    status, body = get_json(plugin_client(logdir), "/checkpoints", run="job")
    assert status == 200
    rows = body["checkpoints"]
    assert [(r["step"], r["op"], r["tag"]) for r in rows] == [
        (2, "save", "step00000002"),
        (2, "restore", "step00000002"),
    ]
    save, restore = rows
    assert save["bytes"] == result.bytes_written > 0
    assert save["seconds"] == result.seconds > 0
    assert save["bytes_per_second"] == pytest.approx(result.bytes_written / result.seconds)
    assert save["path"] == result.path
    assert restore["bytes"] == info.bytes_read > 0 and restore["seconds"] == info.seconds
    assert (save["replicas"], save["rank"], restore["saved_replicas"]) == (2, 0, 2)
