"""The performance table (bench/headlines.py, docs/performance.md at site build): every
results file under bench/results/ has rows, the rows carry the files' own figures, dates
and machines, and a results file the table cannot read fails with its name. Pure Python:
no TensorFlow, no site build (tests/test_docs_site.py builds the site)."""

from __future__ import annotations

import datetime
import json
import math
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO / "scripts"))

import docs_hooks  # noqa: E402  (scripts/ is not a package)

headlines = docs_hooks.load_headlines()


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def table() -> dict[str, list[dict[str, str]]]:
    """The Markdown table of bench/results/, parsed back: ``{results file: [row as
    {column: cell text}]}``."""
    text = headlines.markdown_table(headlines.headline_rows())
    lines = text.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split(" | ")]
    out: dict[str, list[dict[str, str]]] = {}
    for line in lines[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\) \| ", line.strip()[2:-2])]
        assert len(cells) == len(header), line
        row = dict(zip(header, cells))
        name = re.search(r"\(`([^`]+\.json)`\)$", row["benchmark"]).group(1)
        out.setdefault(name, []).append(row)
    return out


def _value(cell: str) -> float:
    """The number a value cell starts with: ``"1,048,315,392 parameters"`` -> 1048315392.0,
    ``"0.955×"`` -> 0.955."""
    return float(cell.split()[0].rstrip("×").replace(",", ""))


def _shown(expected: float, rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The rows whose value is ``expected`` as the table rounds it (3 significant
    digits)."""
    return [r for r in rows if math.isclose(_value(r["value"]), expected, rel_tol=5e-3)]


def _utc(text: str) -> str:
    when = datetime.datetime.fromisoformat(text).astimezone(datetime.timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M UTC")


def test_every_results_file_has_rows(table):
    names = {path.name for path in RESULTS.glob("*.json")}
    assert len(names) >= 19
    assert set(table) == names
    assert set(headlines.EXTRACTORS) == names, "an extractor without its results file"
    for name, rows in table.items():
        for row in rows:
            assert row["date"].endswith(" UTC"), (name, row)
            assert re.match(r"\d+ cores", row["machine"]), (name, row)
            assert row["met"] in ("yes", "no", "–"), (name, row)


def test_step_time_rows_are_the_files_ratios_and_goals(table):
    d, rows = _json("step_time.json"), table["step_time.json"]
    for key, goal in d["goals"].items():
        (row,) = [r for r in _shown(d["ratios_vs_mirrored"][key], rows) if r["goal"] != "–"]
        assert row["goal"] == f"≤ {goal:g}×", row
        assert row["met"] == ("yes" if d["goals_met"][key] else "no"), row
    for key, config in d["stage3"]["configs"].items():
        measure, _ = config["goal"].split(" <= ")
        assert _shown(config["ratios"][measure], rows), key
    assert {r["date"] for r in rows} == {_utc(d["date"])}
    assert {r["load (1 min)"] for r in rows} == {
        f"{d['load_average_before'][0]:.2f} → {d['load_average_after'][0]:.2f}"
    }
    assert {r["machine"] for r in rows} == {f"{d['nproc']} cores"}


def test_max_model_rows_are_the_files_figures(table):
    d, rows = _json("max_model.json"), table["max_model.json"]
    values = [r["value"] for r in rows]
    for side in ("stage3_nvme", "mirrored"):
        assert f"{d['max_params'][side]:,} parameters" in values, side
    states = d["model_states_device_ratio"]
    (row,) = _shown(states["ratio_params_grads_optimizer"], rows)
    assert row["goal"] == f"≤ {states['goal']:g}×"
    assert row["met"] == ("yes" if states["goal_met"] else "no")
    (row,) = _shown(d["largest_stage3_io"]["step_over_bound"], rows)
    assert row["met"] == ("yes" if d["largest_stage3_io"]["goal_met"] else "no")
    assert {r["machine"] for r in rows} == {
        f"{d['nproc']} cores, {d['cpu']}, {d['ram_bytes'] / 2**30:.1f} GiB"
    }
    assert {r["load (1 min)"] for r in rows} == {"not recorded"}


def test_whatif_and_oom_rows_are_the_files_figures(table):
    d, rows = _json("whatif.json"), table["whatif.json"]
    for figure in ("moves", "device_peak"):
        (row, *_) = _shown(100 * d["median_error"][figure], rows)
        assert row["value"].endswith(" %") and row["goal"] == "≤ 20 %", row
    d, rows = _json("oom_advice.json"), table["oom_advice.json"]
    assert [r["value"] for r in rows] == [f"{100 * d['precision']:g} %", f"{100 * d['recall']:g} %"]
    assert rows[0]["met"] == ("yes" if d["precision_met"] else "no")


def test_a_file_without_top_level_date_is_dated_by_its_runs(table):
    d, rows = _json("step_time_ab.json"), table["step_time_ab.json"]
    assert "date" not in d
    assert {r["date"] for r in rows} == {_utc(max(run["date"] for run in d["runs"]))}
    for key, ratio in d["b_over_a"].items():
        assert _shown(ratio, rows), key


def test_a_results_file_without_an_extractor_fails_with_its_name(tmp_path):
    shutil.copy(RESULTS / "restart.json", tmp_path)
    (tmp_path / "new_bench.json").write_text('{"date": "2026-01-01T00:00:00+00:00"}')
    with pytest.raises(headlines.ResultsFormatError, match=r"new_bench\.json: no extractor"):
        headlines.headline_rows(tmp_path)
    with pytest.raises(docs_hooks.PluginError, match=r"new_bench\.json"):
        docs_hooks.performance_page(tmp_path)


def test_a_results_file_of_unknown_shape_fails_with_its_name(tmp_path):
    d = _json("step_time.json")
    del d["goals"]
    (tmp_path / "step_time.json").write_text(json.dumps(d))
    with pytest.raises(headlines.ResultsFormatError, match=r"step_time\.json: .*'goals'"):
        headlines.headline_rows(tmp_path)
    (tmp_path / "step_time.json").write_text("[1, 2]")
    with pytest.raises(docs_hooks.PluginError, match=r"step_time\.json: .*step_time\(\)"):
        docs_hooks.performance_page(tmp_path)
    (tmp_path / "step_time.json").write_text("{")
    with pytest.raises(headlines.ResultsFormatError, match=r"step_time\.json"):
        headlines.headline_rows(tmp_path)


def test_the_script_prints_the_page():
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "headlines.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert proc.stdout == docs_hooks.performance_page()
    assert proc.stdout.startswith("# Performance\n")
