"""Live tuning of a multi-worker job from the view (tb_plugin.tuning.job_chief_run).

A multi-worker job writes one run per worker (``<job>/worker_<rank>``) and its chief writes
``<job>/cluster.json``; only the chief reads control requests and decides for every worker
(docs/multiworker/index.md). A request POSTed for a non-chief worker's run is therefore written
into the chief's run and the answer says so (``tuning_run``, ``redirected``,
``tuning_note``); ``GET /tuning`` on a worker's run shows the job's request and decision.
When the chief's run is not listed by this TensorBoard the POST is refused with 409 and
nothing is written. Driven through TensorBoard's real WSGI app (``plugin_client``) over
run directories written by the real summary writer and the real control channel.
"""

from __future__ import annotations

import json
import os
from urllib.parse import urlencode

import pytest
from helpers import synthetic

from tb_plugin import metadata, tuning
from tb_plugin.summary import SummaryWriter
from zero_runtime import control, multiworker
from zero_runtime.config import ZeroConfig

PREFIX = "/data/plugin/memory_hierarchy"
HEADERS = {tuning.HEADER_NAME: tuning.HEADER_VALUE}
STARTED = ZeroConfig(telemetry_every_n_steps=1)
JOB = "exp/gpt_2workers"


def _write_worker_run(logdir: str, run: str) -> str:
    run_dir = os.path.join(logdir, run)
    writer = SummaryWriter(run_dir)
    writer.json(metadata.TAG_RUN_INFO, 0, {"stage": 2, "config": STARTED.to_dict()})
    writer.close()
    return run_dir


def _write_cluster(logdir: str, job: str, workers: int) -> None:
    """``<job>/cluster.json`` as MultiWorkerZeroInfinityStrategy's chief writes it."""
    record = {
        "num_workers": workers,
        "addresses": [f"127.0.0.1:{20000 + r}" for r in range(workers)],
        "runs": [f"worker_{r}" for r in range(workers)],
        "num_replicas_in_sync": workers,
    }
    with open(os.path.join(logdir, job, multiworker.CLUSTER_FILE), "w") as fh:
        json.dump(record, fh)


@pytest.fixture
def job(plugin_client, tmp_path):
    """(client with --memory_hierarchy_tuning, logdir) with: a two-worker job ``JOB``; a
    job ``lost`` whose chief run was never written (only ``lost/worker_1``); and a plain
    run named ``solo/worker_1`` (no cluster.json: not a multi-worker job)."""
    logdir = str(tmp_path / "logs")
    for rank in (0, 1):
        _write_worker_run(logdir, f"{JOB}/worker_{rank}")
    _write_cluster(logdir, JOB, 2)
    _write_worker_run(logdir, "lost/worker_1")
    _write_cluster(logdir, "lost", 2)
    _write_worker_run(logdir, "solo/worker_1")
    return plugin_client(logdir, tuning=True), logdir


def _post(client, run: str, updates: dict) -> tuple[int, dict]:
    response = client.post(
        f"{PREFIX}/tune?{urlencode({'run': run})}",
        data=json.dumps({"updates": updates}),
        headers=HEADERS,
        content_type="application/json",
    )
    return response.status_code, json.loads(response.get_data(as_text=True))


def _get(client, run: str) -> tuple[int, dict]:
    response = client.get(f"{PREFIX}/tuning?{urlencode({'run': run})}")
    return response.status_code, json.loads(response.get_data(as_text=True))


def _request_file(logdir: str, run: str) -> str:
    return os.path.join(logdir, run, control.REQUEST_FILE)


def test_cluster_file_name_matches_the_runtime():
    assert tuning.CLUSTER_FILE == multiworker.CLUSTER_FILE


def test_a_worker_runs_request_goes_to_the_chief_and_the_answer_says_so(job):
    client, logdir = job
    chief, worker = f"{JOB}/worker_0", f"{JOB}/worker_1"
    status, body = _post(client, worker, {"telemetry_every_n_steps": 3})
    assert status == 200, body
    assert body["run"] == worker and body["tuning_run"] == chief and body["redirected"] is True
    assert chief in body["tuning_note"] and "whole job" in body["tuning_note"]
    assert (body["version"], body["request"]["state"]) == (1, "pending")
    with open(_request_file(logdir, chief)) as fh:
        written = json.load(fh)
    assert (written["version"], written["updates"]) == (1, {"telemetry_every_n_steps": 3})
    assert not os.path.exists(_request_file(logdir, worker))  # never read by the job

    # Both runs' panels show the job's request: pending, then the chief's decision.
    for run in (worker, chief):
        status, view = _get(client, run)
        assert status == 200 and view["tuning_run"] == chief
        assert view["request"]["state"] == "pending" and view["request"]["version"] == 1
    assert _get(client, worker)[1]["tuning_note"] == body["tuning_note"]
    assert _get(client, chief)[1]["tuning_note"] is None
    outcome = control.ControlChannel(os.path.join(logdir, chief), STARTED).poll(7)
    assert outcome.status is control.Status.APPLIED
    _, view = _get(client, worker)
    assert (view["request"]["state"], view["request"]["step"]) == ("applied", 7)
    assert view["request"]["changes"] == {"telemetry_every_n_steps": {"old": 1, "new": 3}}

    # The chief's own run is written as before, merged with nothing pending (decided).
    status, body = _post(client, chief, {"prefetch_bucket_size": 1000})
    assert status == 200
    assert (body["tuning_run"], body["redirected"], body["tuning_note"]) == (chief, False, None)
    assert body["version"] == 2


def test_a_run_named_worker_without_a_cluster_file_is_tuned_itself(job):
    client, logdir = job
    status, body = _post(client, "solo/worker_1", {"telemetry_every_n_steps": 2})
    assert status == 200
    assert (body["tuning_run"], body["redirected"]) == ("solo/worker_1", False)
    assert os.path.exists(_request_file(logdir, "solo/worker_1"))
    assert _get(client, "solo/worker_1")[1]["tuning_note"] is None


def test_a_worker_whose_chief_run_is_not_listed_is_refused_with_409(job):
    client, logdir = job
    status, body = _post(client, "lost/worker_1", {"telemetry_every_n_steps": 2})
    assert status == 409
    message = body["error"]["message"]
    assert "lost/worker_0" in message and "nothing was written" in message
    assert not os.path.exists(_request_file(logdir, "lost/worker_1"))
    assert not os.path.exists(os.path.join(logdir, "lost", "worker_0"))
    status, view = _get(client, "lost/worker_1")
    assert status == 200 and view["tuning_run"] == "lost/worker_0"
    assert "does not list that run" in view["tuning_note"]


@pytest.mark.parametrize(
    ("run", "chief"),
    [
        ("job/worker_1", "job/worker_0"),
        ("job/worker_0", None),  # the chief itself
        ("job/worker_7", None),  # not listed in cluster.json
        ("job/worker_x", None),
        ("job/../job/worker_1", None),  # never reads outside the logdir
        ("worker_1", "worker_0"),  # a job written straight into the logdir
    ],
)
def test_job_chief_run_table(tmp_path, run, chief):
    logdir = str(tmp_path)
    for job_dir in ("job", ""):
        os.makedirs(os.path.join(logdir, job_dir), exist_ok=True)
        _write_cluster(logdir, job_dir, 2)
    assert tuning.job_chief_run(logdir, run) == chief
    assert tuning.job_chief_run("gs://bucket/logs", run) is None


def test_the_tab_says_a_worker_is_tuned_through_its_chief(
    browser, tensorboard_server, tmp_path_factory
):
    """Chromium: the worker run's tuning panel shows the note naming the chief's run; a
    change submitted there is written to the chief's run and the panel says so."""
    from playwright.sync_api import expect
    from test_browser import open_view, require_built_frontend

    require_built_frontend()
    logdir = str(tmp_path_factory.mktemp("mw_tab"))
    for rank in (0, 1):
        run_dir = _write_worker_run(logdir, f"{JOB}/worker_{rank}")
        writer = SummaryWriter(run_dir)
        for step in range(3):
            writer.matrix(metadata.TAG_TIERS, step, synthetic.tiers("alpha", step))
        writer.close()
    _write_cluster(logdir, JOB, 2)
    server = tensorboard_server(logdir, extra_args=("--memory_hierarchy_tuning",))
    page, frame, _console = open_view(browser, server)
    chief, worker = f"{JOB}/worker_0", f"{JOB}/worker_1"
    try:
        panel = frame.locator(f'section.mh-run[data-run="{worker}"] .mh-tuning')
        note = panel.locator(".mh-tuning-job")
        expect(note).to_be_visible(timeout=60_000)
        expect(note).to_contain_text("live tuning applies to the whole job")
        expect(note).to_have_attribute("data-tuning-run", chief)
        chief_note = frame.locator(f'section.mh-run[data-run="{chief}"] .mh-tuning-job')
        expect(chief_note).to_be_hidden()
        panel.locator('tr[data-key="telemetry_every_n_steps"] input').fill("5")
        panel.locator("button.mh-tuning-submit").click()
        expect(panel.locator(".mh-tuning-message")).to_have_text(
            f"Request v1 written to the chief\u2019s run {chief} (it decides for every worker "
            "of the job); waiting for the job."
        )
        with open(_request_file(logdir, chief)) as fh:
            assert json.load(fh)["updates"] == {"telemetry_every_n_steps": 5}
        assert not os.path.exists(_request_file(logdir, worker))
    finally:
        page.context.close()
