"""``GET /first_view``: the /runs listing and the first panels' answers in one request,
through TensorBoard's real WSGI app over real event files (the synthetic logdir)."""

from __future__ import annotations

import json
import time
from urllib.parse import urlencode

import pytest
from helpers import synthetic
from tensorboard import context as tb_context
from tensorboard.backend.event_processing import data_provider as tb_data_provider
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.plugins import base_plugin

from tb_plugin import metadata, plugin
from tb_plugin.routes import first_view

PREFIX = "/data/plugin/memory_hierarchy"
POINTS = 1000  # the view's CHART_POINTS


def get(client, route: str, params: list[tuple[str, str]] | dict) -> tuple[int, dict]:
    response = client.get(f"{PREFIX}{route}?{urlencode(params)}")
    assert response.headers["Content-Type"].startswith("application/json")
    return response.status_code, json.loads(response.get_data(as_text=True))


@pytest.fixture(scope="module")
def client(plugin_client, synthetic_logdir):
    return plugin_client(synthetic_logdir)


def test_default_answer_is_runs_and_each_first_runs_own_answers(client):
    status, body = get(client, "/first_view", {"points": POINTS})
    assert status == 200
    _, listing = get(client, "/runs", {})
    assert body["runs"] == listing["runs"]
    # Both synthetic runs share their wall times: the most recent ties, by name.
    assert body["first_runs"] == sorted(synthetic.RUNS)
    assert body["points"] == POINTS
    for run in synthetic.RUNS:
        assert sorted(body["series"][run]) == sorted(first_view.SERIES_TAGS)
        for tag in first_view.SERIES_TAGS:
            _, own = get(client, "/series", {"run": run, "tag": tag, "points": POINTS})
            assert body["series"][run][tag] == own
            assert len(own["steps"]) == synthetic.NUM_STEPS
        assert sorted(body["json"][run]) == sorted(first_view.JSON_TAGS)
        for tag in first_view.JSON_TAGS:
            _, own = get(client, "/json", {"run": run, "tag": tag})
            assert body["json"][run][tag] == own
    config = body["json"][synthetic.RUN_STANDIN][metadata.TAG_CONFIG_EVENT]["events"]
    assert [e["step"] for e in config] == list(synthetic.CONFIG_EVENT_STEPS[synthetic.RUN_STANDIN])


def test_named_runs_are_used_and_unknown_names_left_out(client):
    params = [("run", "no such run"), ("run", synthetic.RUN_HTML_NAME), ("eager", "1")]
    status, body = get(client, "/first_view", params)
    assert status == 200
    assert body["first_runs"] == [synthetic.RUN_HTML_NAME]
    assert list(body["series"]) == [synthetic.RUN_HTML_NAME]
    assert list(body["json"]) == [synthetic.RUN_HTML_NAME]
    assert body["points"] == first_view.VIEW_POINTS  # the view's budget when absent


def test_eager_bounds_the_runs_answered(client):
    _, body = get(client, "/first_view", {"eager": 1})
    assert body["first_runs"] == [sorted(synthetic.RUNS)[0]]
    assert len(body["runs"]) == len(synthetic.RUNS)  # the listing is whole


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"limit": "0"}, "'limit' must be an integer in [1, 1000], got '0'"),
        ({"eager": "17"}, "'eager' must be an integer in [1, 16], got '17'"),
        ({"eager": "-1"}, "'eager' must be an integer in [1, 16], got '-1'"),
        ({"points": "0"}, "'points' must not be 0 here"),
        ({"points": "1"}, "'points' must be 0 (every step) or an integer in [2, 50000]"),
        ({"run": "x" * 1025}, "at most 1024 characters"),
    ],
)
def test_bad_arguments_are_400_naming_the_value(client, params, needle):
    status, body = get(client, "/first_view", params)
    assert status == 400
    assert needle in body["error"]["message"]


def _entry(run: str, *walls: float) -> dict:
    return {"run": run, "tags": {f"t{i}": {"max_wall_time": w} for i, w in enumerate(walls)}}


def test_default_runs_are_the_most_recent_then_first_by_name():
    listed = [
        _entry("a", 5.0),
        _entry("b", 1.0, 9.0),  # newest over its tags: 9
        _entry("c", 7.0),
        _entry("d", 7.0),  # ties with c: by name
        _entry("e"),  # no wall time: 0
    ]
    assert first_view.default_runs(listed, limit=3, eager=4) == ["b", "c", "d"]
    assert first_view.default_runs(listed, limit=3, eager=2) == ["b", "c"]
    assert first_view.default_runs(listed, limit=10, eager=10) == ["a", "b", "c", "d", "e"]


def test_the_indexer_encodes_the_first_answers_before_any_request(synthetic_logdir):
    """A listing wakes the indexer; besides the levels it encodes each run's tiers and
    readings answers at the view's point budget and reads run_info and config events, so
    a first visit's /first_view computes nothing (the caches only hit)."""
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        tensor_size_guidance={metadata.PLUGIN_NAME: 0}
    )
    multiplexer.AddRunsFromDirectory(synthetic_logdir)
    multiplexer.Reload()
    provider = tb_data_provider.MultiplexerDataProvider(multiplexer, synthetic_logdir)
    p = plugin.MemoryHierarchyPlugin(base_plugin.TBContext(data_provider=provider))
    ctx = tb_context.RequestContext()
    p.reader.listing(ctx, "")  # what every request does first: wakes the indexer
    last = synthetic.NUM_STEPS - 1
    keys = [
        ("series", "", run, tag, last, p.reader.generation(run), first_view.VIEW_POINTS, None)
        for run in synthetic.RUNS
        for tag in first_view.SERIES_TAGS
    ]
    deadline = time.monotonic() + 60
    while not all(p.answers.get(k) is not None for k in keys):
        assert time.monotonic() < deadline, "the indexer did not encode the first answers"
        time.sleep(0.1)
    while p.reader._indexing:  # noqa: SLF001 - wait for its json tags too
        assert time.monotonic() < deadline
        time.sleep(0.1)
    answers_before = (p.answers.hits, p.answers.misses)
    records_misses = p.reader._records_cache.misses  # noqa: SLF001
    text = first_view.first_view_text(p.reader, p.answers, ctx, "", None)
    body = json.loads(text)
    assert body["first_runs"] == sorted(synthetic.RUNS)
    assert p.answers.misses == answers_before[1]  # every series answer was there
    assert p.answers.hits == answers_before[0] + len(keys)
    assert p.reader._records_cache.misses == records_misses  # noqa: SLF001
    steps = body["series"][synthetic.RUN_STANDIN][metadata.TAG_TIERS]["steps"]
    assert steps == list(range(synthetic.NUM_STEPS))
