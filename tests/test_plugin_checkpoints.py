"""GET /checkpoints of tb_plugin.plugin: a run's checkpoint saves and restores.

Through TensorBoard's real WSGI app (``plugin_client``) over (a) the session's synthetic
logdir, whose saves (``memory_hierarchy/checkpoint``) and restores
(``memory_hierarchy/checkpoint_restore``) are written by the real summary writer
(``helpers.synthetic.checkpoint``), and (b) the event files of a tiny real job (2 replicas,
stage 1) that saved through the real ``ZeroInfinityStrategy.save_checkpoint``
(CheckpointManager) and, resumed in the same run directory, restored at that step through
``load_checkpoint``; (b) also through a real ``tensorboard --load_fast=true`` process.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
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


def _close(strategy, model) -> None:
    """Close a tiny job's model (a stage-3 ShardedModel has ``close``) and its strategy."""
    if hasattr(model, "close"):
        model.close()
    strategy.close()


@pytest.fixture(scope="module")
def real_job(tmp_path_factory):
    """A tiny stage-1 job on 2 replicas that trained 2 steps and saved
    (strategy.save_checkpoint), then the job resumed like ``demo/train.py --resume``: a new
    strategy (so a second event file) in the same run directory ``<logdir>/job`` restored
    that checkpoint, at step 2, into a fresh model (load_checkpoint).
    Returns (logdir, save result, restore info)."""
    from helpers import checkpoint_job as job

    import zero_runtime

    base = tmp_path_factory.mktemp("ckpt_plugin")
    logdir = base / "logs"
    cfg = job.config(1, "cpu", str(base))
    strategy = zero_runtime.ZeroInfinityStrategy(cfg, logdir=str(logdir / "job"))
    model = job.build(strategy)
    try:
        job.train(model, 0, 2)
        result = strategy.save_checkpoint(str(base / "ckpt"), model)
    finally:
        _close(strategy, model)
    resumed = zero_runtime.ZeroInfinityStrategy(cfg, logdir=str(logdir / "job"))
    model = job.build(resumed, seed=5)
    try:
        info = resumed.load_checkpoint(str(base / "ckpt"), model)
    finally:
        _close(resumed, model)
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


def _get_tensorboard(server, route: str, **params) -> dict:
    """GET a plugin route of a real TensorBoard process; returns the decoded JSON body."""
    url = f"{server.url}{PREFIX}{route}?{urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return json.loads(response.read())


def test_load_fast_tensorboard_keeps_a_save_and_a_restore_at_one_step(tensorboard_server, real_job):
    """The Rust data server (``--load_fast=true``) keeps one value per (run, tag, step): the
    resumed job's restore at step 2 (second event file) would hide the first process's save
    at step 2 if both had one tag. Restores have their own tag, so /checkpoints has both.

    Control in the same logdir: run ``one_tag`` holds a save and then a restore at step 7,
    both under ``memory_hierarchy/checkpoint`` (as runs were written before the restore
    tag), one event file each like a resume; that TensorBoard serves only the restore."""
    from tb_plugin.summary import SummaryWriter

    logdir, result, info = real_job
    for op, wall in (("save", 1000.0), ("restore", 2000.0)):
        writer = SummaryWriter(f"{logdir}/one_tag")  # a writer (event file) per process
        record = {"op": op, "tag": "step00000007", "step": 7, "bytes": 4096, "seconds": 0.5}
        writer.json(metadata.TAG_CHECKPOINT, 7, record, wall_time=wall)
        writer.close()
        # Name the file by its wall time, as a later process's file would sort: written in
        # one second by one process, the names differ only in TensorBoard's per-process
        # writer counter, and ".../pid.10" sorts before ".../pid.9" (the order the data
        # server reads them in), which depends on how many writers earlier tests made.
        (written,) = [n for n in os.listdir(f"{logdir}/one_tag") if n.endswith(".memory_hierarchy")]
        os.rename(
            f"{logdir}/one_tag/{written}",
            f"{logdir}/one_tag/events.out.tfevents.{int(wall):010d}.{op}",
        )
    server = tensorboard_server(logdir, load_fast=True)
    deadline = time.monotonic() + 60.0  # s; the data server loads in the background
    while True:
        tags = {r["run"]: r["tags"] for r in _get_tensorboard(server, "/runs")["runs"]}
        loaded = (
            metadata.TAG_CHECKPOINT in tags.get("job", {})
            and metadata.TAG_CHECKPOINT_RESTORE in tags["job"]
            and tags.get("one_tag", {}).get(metadata.TAG_CHECKPOINT, {}).get("max_wall_time")
            == 2000.0  # the control's second event file is loaded too
        )
        if loaded:
            break
        assert time.monotonic() < deadline, (tags, server.log_tail())
        time.sleep(0.5)
    rows = _get_tensorboard(server, "/checkpoints", run="job")["checkpoints"]
    assert [(r["step"], r["op"], r["tag"]) for r in rows] == [
        (2, "save", "step00000002"),
        (2, "restore", "step00000002"),
    ]
    save, restore = rows
    assert save["bytes"] == result.bytes_written > 0 and save["path"] == result.path
    assert save["bytes_per_second"] == pytest.approx(result.bytes_written / result.seconds)
    assert restore["bytes"] == info.bytes_read > 0 and restore["seconds"] == info.seconds
    assert restore["saved_replicas"] == 2 and restore["wall_time"] > save["wall_time"]
    control = _get_tensorboard(server, "/checkpoints", run="one_tag")["checkpoints"]
    assert [(r["step"], r["op"], r["wall_time"]) for r in control] == [(7, "restore", 2000.0)]


def test_checkpoints_merges_both_tags_save_before_restore(plugin_client, tmp_path):
    """Records of both tags in one list by (step, op): a restore written before the save of
    its step still comes after it; a restore under the save tag (a run written before the
    restore tag existed) is kept."""
    from tb_plugin.summary import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "merged"))
    for tag, op, step in [
        (metadata.TAG_CHECKPOINT_RESTORE, "restore", 3),
        (metadata.TAG_CHECKPOINT, "restore", 1),  # the old single-tag layout
        (metadata.TAG_CHECKPOINT, "save", 3),
        (metadata.TAG_CHECKPOINT, "save", 5),
    ]:
        record = {"op": op, "tag": f"t{step}", "step": step, "bytes": 1000 * step, "seconds": 2.0}
        writer.json(tag, step, record, wall_time=100.0 + step)
    writer.close()
    status, body = get_json(plugin_client(str(tmp_path)), "/checkpoints", run="merged")
    assert status == 200
    assert [(r["step"], r["op"], r["tag"], r["bytes_per_second"]) for r in body["checkpoints"]] == [
        (1, "restore", "t1", 500.0),
        (3, "save", "t3", 1500.0),
        (3, "restore", "t3", 1500.0),
        (5, "save", "t5", 2500.0),
    ]
