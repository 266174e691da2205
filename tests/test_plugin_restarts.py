"""GET /restarts of tb_plugin.plugin: a job's restarts, resizes and goodput from the
events file ``zero-runtime launch --logdir`` writes.

Through TensorBoard's real WSGI app (``plugin_client``) over (a) the session's synthetic
logdir (``helpers.synthetic.restart_events``) and (b) a logdir where a real launcher ran
workers without TensorFlow that shrink and grow (tests/test_launch_restarts.py's
``elastic`` mode) beside a multi-worker run ``job/worker_0``.
"""

from __future__ import annotations

import io
import json
import os
import sys

import pytest
from helpers import synthetic
from test_launch_restarts import WORKER
from test_plugin_checkpoints import get_json

from tb_plugin import metadata
from zero_runtime import launch
from zero_runtime.launch import restarts as launch_restarts


@pytest.fixture(scope="module")
def client(plugin_client, synthetic_logdir):
    """A test client over the session's synthetic logdir."""
    return plugin_client(synthetic_logdir)


def test_the_file_the_launcher_writes_is_the_file_the_plugin_reads():
    assert metadata.RESTARTS_FILE == launch_restarts.LOGDIR_EVENTS_FILE


def test_restarts_are_markers_with_what_each_lost_and_the_goodput(client):
    status, body = get_json(client, "/restarts", run=synthetic.RUN_STANDIN)
    assert status == 200, body
    assert body["file"] == f"{synthetic.RUN_STANDIN}/{metadata.RESTARTS_FILE}"
    assert body["events"] == synthetic.restart_events(synthetic.RUN_STANDIN)
    markers = body["markers"]
    assert [(m["step"], m["kind"], m["attempt"], m["nproc"]) for m in markers] == [
        (20, "restart", 1, 2),
        (30, "resize", 2, 1),
        (40, "resize", 3, 2),
    ]
    assert [(m["steps_lost"], m["seconds_lost"], m["restart_seconds"]) for m in markers] == [
        (2, 15.0, 9.0),
        (1, 12.5, 9.0),
        (0, 10.0, 9.0),
    ]
    assert markers[0]["label"] == (
        "restart: restart 1/3 after rank 1: killed by SIGKILL; lost 2 steps and 15.0 s; "
        "9.0 s to the first new step"
    )
    assert markers[2]["label"].startswith("resize: resize 1 -> 2 workers: asked (SIGUSR1);")
    assert body["goodput"] == synthetic.goodput(synthetic.RUN_STANDIN)
    assert (body["restarts"], body["resizes"], body["finished"], body["status"]) == (2, 2, True, 0)


def test_a_cause_is_returned_as_written(client):
    status, body = get_json(client, "/restarts", run=synthetic.RUN_HTML_NAME)
    assert status == 200
    (only,) = body["markers"]
    assert only["cause"] == synthetic.HTML_CAUSE and only["step"] == 10


def _launched_logdir(tmp_path) -> str:
    """A logdir ``logs`` with a run ``job/worker_0`` (two synthetic steps) and the events
    file a real launcher wrote into ``logs/job`` (TF-free workers: rank 1 killed twice,
    2 -> 1 workers, SIGUSR1 -> 2 workers)."""
    logs = tmp_path / "logs"
    synthetic.write_run(str(logs), "job/worker_0", range(2))
    script, marks = tmp_path / "worker.py", tmp_path / "marks"
    script.write_text(WORKER)
    marks.mkdir()
    out = io.StringIO()
    status = launch.launch(
        2,
        [sys.executable, str(script), "elastic", str(marks)],
        out=out,
        max_restarts=3,
        checkpoint_dir=str(tmp_path / "ckpt"),
        min_nproc=1,
        logdir=str(logs / "job"),
    )
    assert status == 0, out.getvalue()[-3000:]
    return str(logs)


def test_a_worker_run_reads_its_jobs_file_from_the_directory_above(plugin_client, tmp_path):
    client = plugin_client(_launched_logdir(tmp_path))
    status, body = get_json(client, "/restarts", run="job/worker_0")
    assert status == 200, body
    assert body["file"] == f"job/{metadata.RESTARTS_FILE}"
    assert [m["kind"] for m in body["markers"]] == ["restart", "resize", "resize"]
    assert [m["nproc"] for m in body["markers"]] == [2, 1, 2]
    exit_event = body["events"][-1]
    assert exit_event["event"] == "exit" and body["goodput"] == exit_event["goodput"]
    assert body["goodput"]["useful_steps"] > 0 and 0 < body["goodput"]["time_ratio"] < 1
    assert (body["restarts"], body["resizes"], body["finished"]) == (2, 2, True)


def test_a_line_being_written_is_left_and_a_bad_line_is_named(plugin_client, tmp_path):
    logs = tmp_path / "logs"
    synthetic.write_run(str(logs), "run", range(2))
    path = logs / "run" / metadata.RESTARTS_FILE
    client = plugin_client(str(logs))
    status, body = get_json(client, "/restarts", run="run")
    assert status == 200 and body["file"] is None and body["markers"] == []
    assert (body["goodput"], body["restarts"], body["finished"]) == (None, 0, False)
    first = synthetic.restart_events(synthetic.RUN_STANDIN)[:4]
    lines = "".join(json.dumps(e) + "\n" for e in first)
    path.write_text(lines + '{"event": "sta')  # the launcher is writing the next line
    status, body = get_json(client, "/restarts", run="run")
    assert status == 200 and len(body["events"]) == 4 and body["markers"] == []
    path.write_text(lines + "not json\n")
    status, body = get_json(client, "/restarts", run="run")
    assert status == 500
    assert f"{metadata.RESTARTS_FILE} line 5 is not JSON" in body["error"]["message"]
    os.remove(path)
