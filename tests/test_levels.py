"""The precomputed min/max levels (tb_plugin.levels) and the streamed every-step exports.

Levels are checked against brute force on random data (NaN gaps, never-measured series,
one-step spikes) for every way of appending the same steps; the streamed exports against
the in-memory answers of the same series through TensorBoard's real WSGI app.
"""

from __future__ import annotations

import csv
import gzip
import io
import json

import numpy as np
import pytest
from helpers import synthetic

from tb_plugin import export, metadata
from tb_plugin.layout import Layout
from tb_plugin.levels import BASE, LevelStore, SeriesLevels
from tb_plugin.routes import series as series_routes

PREFIX = "/data/plugin/memory_hierarchy"
TIERS_LAYOUT = Layout(metadata.SCHEMA_VERSION, *metadata.LAYOUTS[metadata.TAG_TIERS])
WIDTH = len(metadata.TIERS) * len(metadata.TIER_COLUMNS)


def random_cells(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    cells = rng.normal(size=(n, WIDTH))  # [N, S]
    cells[:, 4] = np.nan  # never measured
    cells[::7, 3] = np.nan  # partly measured
    cells[rng.integers(n), 0] = 1e12  # a one-step spike
    cells[rng.integers(n), 0] = -1e12  # a one-step dip
    return cells


def built(cells: np.ndarray, chunk: int) -> SeriesLevels:
    levels = SeriesLevels(TIERS_LAYOUT)
    for start in range(0, len(cells), chunk):
        part = cells[start : start + chunk]
        steps = np.arange(start, start + len(part)) * 3  # steps need not be consecutive
        levels.append(steps, 1000.0 + steps, part)
    return levels


@pytest.mark.parametrize("n", [1, BASE - 1, BASE * 8 + 5, 20_011])
@pytest.mark.parametrize("budget", [2, 10, 100, 1000])
def test_indices_keep_every_series_extremes_within_budget(n, budget):
    cells = random_cells(n, seed=n + budget)
    keep = built(cells, chunk=n).indices(budget)
    assert keep.tolist() == sorted(set(keep.tolist())) and 0 <= keep[0] and keep[-1] < n
    assert keep[0] == 0 and keep[-1] == n - 1
    measured = [s for s in range(WIDTH) if not np.isnan(cells[:, s]).all()]
    assert len(keep) <= max(budget, 2 * len(measured) + 2)
    if n <= budget:
        assert keep.tolist() == list(range(n))
    for s in measured:
        assert np.nanargmax(cells[:, s]) in keep and np.nanargmin(cells[:, s]) in keep


def test_appending_in_any_chunks_gives_the_same_levels_and_answers():
    cells = random_cells(5_003, seed=7)
    whole = built(cells, chunk=5_003)
    for chunk in (1, 15, 16, 17, 999):
        part = built(cells, chunk=chunk)
        assert part.n == whole.n == 5_003 and part.last_step == 3 * 5_002
        for budget in (2, 50, 600):
            assert part.indices(budget).tolist() == whole.indices(budget).tolist()
        steps, walls, got = part.rows(part.indices(600))
        np.testing.assert_array_equal(got, cells[steps // 3])
        np.testing.assert_array_equal(walls, 1000.0 + steps)


def test_append_refuses_steps_that_do_not_increase_and_rows_of_another_width():
    levels = built(random_cells(10, seed=1), chunk=10)
    with pytest.raises(ValueError, match="steps must increase past 27"):
        levels.append(np.array([27]), np.zeros(1), np.zeros((1, WIDTH)))
    with pytest.raises(ValueError, match="width 3"):
        levels.append(np.array([40]), np.zeros(1), np.zeros((1, 3)))


def test_store_evicts_the_least_recently_used_beyond_its_budget():
    a, b, c = (built(random_cells(2_000, seed=s), chunk=2_000) for s in (1, 2, 3))
    store = LevelStore(max_bytes=a.nbytes + b.nbytes + c.nbytes // 2)
    store.put("a", a)
    store.put("b", b)
    assert store.get("a") is a  # a is now more recent than b
    store.put("c", c)
    assert store.get("b") is None and store.get("a") is a and store.get("c") is c
    assert store.nbytes == a.nbytes + c.nbytes


@pytest.fixture(scope="module")
def long_client(plugin_client, tmp_path_factory):
    """One run of LONG_STEPS steps of the tier matrix (a ramp with a spike), written with the
    real writer and served by TensorBoard's WSGI app."""
    logdir = tmp_path_factory.mktemp("long_logdir")
    from tb_plugin.summary import SummaryWriter

    writer = SummaryWriter(str(logdir / "long"))
    for step in range(LONG_STEPS):
        used = 1e9 + step + (5e9 if step == LONG_SPIKE else 0.0)
        writer.matrix(
            metadata.TAG_TIERS,
            step,
            {"device": {"used_bytes": used, "capacity_bytes": 8e9}, "host": {"used_bytes": 0.5}},
            wall_time=synthetic.wall_time(step),
        )
    writer.close()
    return plugin_client(str(logdir))


LONG_STEPS = 5_001
LONG_SPIKE = 4_123


def full_answer(client, fmt=None, gz=False):
    query = {"run": "long", "tag": metadata.TAG_TIERS, "points": "0"}
    if fmt:
        query["format"] = fmt
    headers = {"Accept-Encoding": "gzip"} if gz else {}
    response = client.get(f"{PREFIX}/series", query_string=query, headers=headers)
    assert response.status_code == 200
    assert response.is_streamed
    data = response.get_data()
    return response, gzip.decompress(data) if gz else data


def test_every_step_json_is_streamed_and_equals_the_in_memory_answer(long_client, monkeypatch):
    monkeypatch.setattr(export, "STREAM_ROWS", 1_000)  # several chunks
    response, data = full_answer(long_client)
    assert response.headers.get("Content-Length") is None  # chunked, not one body
    body = json.loads(data)
    assert body["steps"] == list(range(LONG_STEPS)) and body["total_steps"] == LONG_STEPS
    used = body["values"]["device"]["used_bytes"]
    assert used[LONG_SPIKE] == 1e9 + LONG_SPIKE + 5e9 and used[7] == 1e9 + 7
    assert body["values"]["nvme"]["used_bytes"][:3] == [None] * 3  # not measured: null
    thinned = json.loads(
        long_client.get(
            f"{PREFIX}/series", query_string={"run": "long", "tag": metadata.TAG_TIERS}
        ).get_data()
    )
    assert len(thinned["steps"]) <= series_routes.DEFAULT_POINTS
    assert max(thinned["values"]["device"]["used_bytes"]) == max(used)
    _resp, gz = full_answer(long_client, "json", gz=True)
    assert json.loads(gz) == body
    assert _resp.headers["Content-Disposition"].startswith('attachment; filename="long_tiers_full')


def test_every_step_csv_is_streamed_and_equals_the_csv_of_the_answer(long_client, monkeypatch):
    monkeypatch.setattr(export, "STREAM_ROWS", 1_000)  # several chunks
    response, data = full_answer(long_client, "csv", gz=True)
    assert response.headers["Content-Encoding"] == "gzip"
    assert response.headers["Content-Type"] == "text/csv; charset=utf-8"
    _r, plain = full_answer(long_client)
    expected = export.series_csv(json.loads(plain))
    assert data.decode() == expected
    rows = list(csv.reader(io.StringIO(expected)))
    assert len(rows) == 1 + LONG_STEPS
    row = dict(zip(rows[0], rows[1 + LONG_SPIKE]))
    assert float(row["device/used_bytes"]) == 1e9 + LONG_SPIKE + 5e9
    assert float(row["wall_time"]) == synthetic.wall_time(LONG_SPIKE)
    assert row["nvme/used_bytes"] == ""


def test_the_background_indexer_builds_every_series_levels_without_a_series_request(
    plugin_client, synthetic_logdir
):
    """A listing (GET /runs) wakes the indexer: every matrix and vector series of every run
    gets its levels up to max_step, reported by /runs?levels=1, with no /series request."""
    import time

    client = plugin_client(synthetic_logdir)
    deadline = time.monotonic() + 60
    while True:
        body = json.loads(client.get(f"{PREFIX}/runs?levels=1").get_data(as_text=True))
        per_step = [
            info
            for run in body["runs"]
            for info in run["tags"].values()
            if info["kind"] in (metadata.KIND_MATRIX, metadata.KIND_VECTOR)
        ]
        if per_step and all(i["levels_step"] == i["max_step"] for i in per_step):
            break
        assert time.monotonic() < deadline, per_step
        time.sleep(0.2)
    assert {run["run"] for run in body["runs"]} == set(synthetic.RUNS)
    assert all(i["max_step"] == synthetic.NUM_STEPS - 1 for i in per_step)
    plain = json.loads(client.get(f"{PREFIX}/runs").get_data(as_text=True))
    assert all("levels_step" not in i for r in plain["runs"] for i in r["tags"].values())
