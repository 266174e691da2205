"""``GET /whatif`` and the predictions of ``POST /tune`` / ``GET /tuning``.

Over the log directory of a real stage-3 job (device budget 64 pages, nothing moves):
the route predicts a 16-page budget's page moves and device peak from the job's access
trace without writing anything; checks the proposal as ``POST /tune`` does (400); says
why it cannot predict for a run without a trace. ``POST /tune`` keeps its prediction;
``GET /tuning`` shows it, then beside what was measured once the job applied it.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from test_whatif import HIGH, LOW, PAGE, _stage3_job

from zero_runtime import config as zconfig
from zero_runtime import control
from zero_runtime.memory.trace import TRACE_DIR

pytestmark = pytest.mark.slow
URL = "/data/plugin/memory_hierarchy"


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("whatif")
    _stage3_job(str(root / "high"), HIGH)
    _stage3_job(str(root / "low"), LOW)
    shutil.copytree(root / "high", root / "notrace")
    shutil.rmtree(root / "notrace" / TRACE_DIR)
    return root


def _whatif(client, run, updates):
    text = updates if isinstance(updates, str) else json.dumps(updates)
    return client.get(f"{URL}/whatif", query_string={"run": run, "updates": text})


def test_a_lower_budget_is_predicted_before_it_is_applied(plugin_client, logdir):
    client = plugin_client(str(logdir))
    before = sorted(os.listdir(logdir / "high"))
    answer = _whatif(client, "high", {"device_budget_bytes": LOW})
    assert answer.status_code == 200, answer.get_data(as_text=True)
    body = answer.get_json()
    assert body["available"] is True and body["reason"] is None
    assert body["replay_exact"] is True
    assert body["recorded"]["moves_per_step"] == {
        "d2h": 0,
        "h2d": 0,
        "h2n": 0,
        "n2h": 0,
        "h2n_clean": 0,
    }
    steady = body["predicted"]["steady"]
    assert steady["moves_per_step"]["h2d"] > 0 and steady["moves_per_step"]["d2h"] > 0
    assert steady["peak_bytes"]["device"] <= LOW < body["recorded"]["peak_bytes"]["device"]
    assert body["oom"] is None and body["page_size"] == PAGE
    assert sorted(os.listdir(logdir / "high")) == before  # nothing written
    # What the replay covers, and the whole run's figures over the same steps (the Page
    # moves panel's): this job has no other pool, so they are the pool's.
    assert "optimizer-state store" in body["scope"] and "not replayed" in body["scope"]
    whole = body["run_recorded"]
    assert whole["steps"] == len(body["steps"])
    assert whole["moves_per_step"] == body["recorded"]["moves_per_step"]
    assert whole["prefetch_misses"] == body["recorded"]["prefetch_misses"]
    # The unchanged budget predicts what was recorded; a non-paging key says so.
    same = _whatif(client, "high", {"device_budget_bytes": HIGH}).get_json()
    assert same["predicted"]["steady"]["moves_per_step"] == same["recorded"]["moves_per_step"]
    rebuild = _whatif(client, "high", {"max_reuse_distance": 0}).get_json()
    assert any("max_reuse_distance" in n for n in rebuild["notes"])


def test_whatif_refuses_bad_proposals_and_says_why_it_cannot_predict(plugin_client, logdir):
    client = plugin_client(str(logdir))
    for bad, needle in (
        ({"nope": 1}, "unknown key"),
        ({"device_budget_bytes": 1.5}, "device_budget_bytes"),
        ('{"device_budget_bytes": NaN}', "not a number"),
        ("[1]", "non-empty JSON object"),
        ({"stage": 2}, "cannot be tuned live"),
        ("notjson", "the updates parameter is not valid JSON"),  # a query parameter
    ):
        answer = _whatif(client, "high", bad)
        assert answer.status_code == 400, bad
        assert needle in answer.get_json()["error"]["message"], (bad, answer.get_json())
    assert client.get(f"{URL}/whatif", query_string={"run": "high"}).status_code == 400
    assert _whatif(client, "absent", {"device_budget_bytes": LOW}).status_code == 404
    body = _whatif(client, "notrace", {"device_budget_bytes": LOW}).get_json()
    assert body["available"] is False and "no access trace" in body["reason"]
    tiny = _whatif(client, "high", {"device_budget_bytes": PAGE - 1})
    assert tiny.status_code == 400  # below the key's bounds (64 KiB)
    small = _whatif(client, "high", {"device_budget_bytes": 2 * PAGE}).get_json()
    assert small["available"] is True and small["oom"] is not None  # two pages: too small


def test_tune_keeps_its_prediction_and_tuning_shows_it_beside_measured(plugin_client, logdir):
    run_dir = logdir / "high"
    client = plugin_client(str(logdir), tuning=True)
    # The fixture's job closed (POST /tune would answer 409): a job running in the run
    # directory again, whose control channel reads the request below.
    channel = control.ControlChannel(
        str(run_dir), zconfig.ZeroConfig(stage=3, page_size_bytes=PAGE)
    )
    posted = client.post(
        f"{URL}/tune",
        query_string={"run": "high"},
        data=json.dumps({"updates": {"device_budget_bytes": LOW}}),
        headers={"Content-Type": "application/json", "X-Memory-Hierarchy-Tuning": "1"},
    )
    assert posted.status_code == 200, posted.get_data(as_text=True)
    predicted = posted.get_json()["prediction"]["predicted"]["steady"]
    assert predicted["moves_per_step"]["h2d"] > 0
    tuning = client.get(f"{URL}/tuning", query_string={"run": "high"}).get_json()
    [pending] = tuning["predictions"]
    assert pending["version"] == 1 and pending["applied_step"] is None
    assert pending["measured"] is None
    assert pending["predicted"]["moves_total"] == pytest.approx(
        sum(predicted["moves_per_step"].values())
    )
    # The job applies it at step 8 and runs at the low budget: its trace steps 8.. are
    # the second real job's (recorded at 16 pages), renumbered.
    assert channel.poll(8).status is control.Status.APPLIED
    low_steps = sorted((logdir / "low" / TRACE_DIR).iterdir())
    for i, path in enumerate(low_steps[-4:]):
        record = json.loads(path.read_text())
        record["step"] = 8 + i
        (run_dir / TRACE_DIR / f"step_{8 + i:09d}.json").write_text(json.dumps(record))
    tuning = client.get(f"{URL}/tuning", query_string={"run": "high"}).get_json()
    [done] = tuning["predictions"]
    assert done["applied_step"] == 8 and done["measured_steps"] == [8, 9, 10, 11]
    measured = done["measured"]
    assert measured["moves_total"] > 0
    assert done["predicted"]["moves_total"] == pytest.approx(measured["moves_total"], rel=0.2)
    assert done["predicted"]["device_peak_bytes"] == measured["device_peak_bytes"]
    # Kept in the plugin's file, so the ring's rotation does not lose them.
    stored = json.loads((run_dir / "memory_hierarchy_whatif.json").read_text())
    assert stored["predictions"]["1"]["measured_steps"] == [8, 9, 10, 11]


def test_tuning_lists_the_trace_steps_and_the_page_size_that_make_predict_reachable(
    plugin_client, logdir
):
    """GET /tuning says what the panel needs to offer Predict effect without Apply (a
    TensorBoard without --memory_hierarchy_tuning, a job that ended): the
    recorded trace's steps, and the pool's page size for the device budget's bounds."""
    client = plugin_client(str(logdir))
    body = client.get(f"{URL}/tuning", query_string={"run": "high"}).get_json()
    assert body["enabled"] is False
    steps = body["trace_steps"]
    assert steps and steps == sorted(steps) and all(isinstance(s, int) for s in steps)
    assert set(steps) == {int(n[5:-5]) for n in os.listdir(logdir / "high" / TRACE_DIR)}
    assert body["page_size_bytes"] == PAGE
    none = client.get(f"{URL}/tuning", query_string={"run": "notrace"}).get_json()
    assert none["trace_steps"] == [] and none["page_size_bytes"] == PAGE
