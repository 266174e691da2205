"""The documentation site (mkdocs.yml): the strict build passes, and the reference pages
it writes from the code (scripts/docs_hooks.py) list every config key, every subcommand
and option, and every public name of the documented packages."""

from __future__ import annotations

import html
import os
import pathlib
import re
import subprocess
import sys

import pytest

from zero_runtime.cli import build_parser
from zero_runtime.config import TUNABLE_KEYS, ZeroConfig
from zero_runtime.config.deepspeed_keys import DS_TOP_SCALARS, DS_ZERO_SCALARS
from zero_runtime.config.specs import SPECS

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import docs_hooks  # noqa: E402  (scripts/ is not a package)
from docs_griffe import rst_to_md  # noqa: E402


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """The site built once by ``mkdocs build --strict`` (a warning fails it)."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _page(site: pathlib.Path, path: str) -> str:
    return (site / path / "index.html").read_text(encoding="utf-8")


def _rows(page: str) -> dict[str, list[str]]:
    """``{first cell: the row's cells}`` of every table row of a page, as text."""
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", page, flags=re.S):
        cells = re.findall(r"<td>(.*?)</td>", row, flags=re.S)
        cells = [html.unescape(re.sub(r"<[^>]+>", "", cell)).strip() for cell in cells]
        if cells:
            rows.setdefault(cells[0], cells)
    return rows


def test_config_reference_lists_every_key(site):
    page = _page(site, "reference/config")
    rows = _rows(page)
    for field in ZeroConfig.__dataclass_fields__.values():
        key = field.name
        assert f'<h3 id="{key}">' in page, key
        row = rows[key]
        assert row[3] == SPECS[key].accepted(), row
        assert row[4] == ("yes" if key in TUNABLE_KEYS else "no"), row
    assert rows["stage"][1:3] == ["int", "1"]
    assert rows["nvme_path"][1:3] == ["str | None", "None"]
    assert rows["page_size_bytes"][2] == "4_194_304 (4 MiB)"
    for ds_key, key in DS_ZERO_SCALARS.items():
        assert f"zo.{ds_key}" in rows[key][5].split(", "), (ds_key, rows[key])
    for ds_key, key in DS_TOP_SCALARS.items():
        assert ds_key in rows[key][5].split(", ")
    assert rows["offload_optimizer_ratio"][5] == "zo.offload_optimizer.ratio"
    tuning = _rows(page[page.index('id="live-tuning"') :])
    assert set(tuning) == set(TUNABLE_KEYS)
    for key, tunable in TUNABLE_KEYS.items():
        cells = tuning[key]
        assert cells[1] == tunable.unit
        assert (_number(cells[2]), _number(cells[3])) == (tunable.minimum, tunable.maximum)
        assert cells[4] == tunable.takes_effect


def _number(cell: str) -> int:
    """The int a cell starts with (``65_536 (64 KiB)`` -> 65536)."""
    return int(cell.split()[0].replace("_", ""))


def test_cli_reference_lists_every_subcommand_and_option(site):
    page = _page(site, "reference/cli")
    _parser, subparsers = build_parser()
    assert subparsers, "no subcommand registered"
    for name, sub in subparsers.items():
        assert f'<h2 id="{name}">' in page, name
        section = page[page.index(f'<h2 id="{name}">') :]
        options = {o for a in sub._actions for o in a.option_strings} - {"-h", "--help"}
        for option in options:
            assert f"<code>{option}" in section, (name, option)


def test_api_reference_renders_every_public_name(site):
    pages = {}
    for package, page_name, _title in docs_hooks.API_PACKAGES:
        pages[package] = _page(site, "reference/api/" + page_name.removesuffix(".md"))
    everything = "".join(pages.values())
    for package, page in pages.items():
        for name in docs_hooks.public_names(package):
            assert f"{package}.{name}" in page, (package, name)  # its heading or link
            assert f'id="{docs_hooks.resolve(package, name)}"' in everything, (package, name)
    strategy = pages["zero_runtime"]
    for method in ("scope", "zero_init", "save_checkpoint", "load_checkpoint", "close"):
        assert f'id="zero_runtime.strategy.ZeroInfinityStrategy.{method}"' in strategy, method
    # reST markup in docstrings is rendered as code, not shown raw.
    for page in pages.values():
        assert not re.search(r":(class|func|meth|attr|data|mod):", page)


def test_performance_page_has_rows_of_every_results_file(site):
    """The generated performance page (bench/headlines.py; tests/test_performance_table.py
    checks its figures) is in the built site with each bench/results/ file's rows."""
    rows = _rows(_page(site, "performance"))
    results = sorted(p.name for p in (REPO / "bench" / "results").glob("*.json"))
    assert results
    for name in results:
        assert any(first.endswith(f"({name})") for first in rows), name


def test_a_wrong_deepspeed_counterpart_fails_the_build():
    docs_hooks._check_deepspeed_counterpart("stage", "zero_optimization.stage", 2, {})
    with pytest.raises(docs_hooks.PluginError, match="not 5"):
        docs_hooks._check_deepspeed_counterpart(
            "reduce_bucket_size", "zero_optimization.allgather_bucket_size", 5, {}
        )


def test_an_undocumented_key_fails_the_build(monkeypatch):
    described = docs_hooks.key_descriptions(ZeroConfig.__doc__)
    assert set(described) == set(ZeroConfig.keys())
    assert described["stage"].startswith("ZeRO stage, int in [0, 3]. Default 1.")
    described.pop("tile_size")
    monkeypatch.setattr(docs_hooks, "key_descriptions", lambda doc: described)
    with pytest.raises(docs_hooks.PluginError, match="undocumented \\['tile_size'\\]"):
        docs_hooks.config_reference()


def test_rst_inline_markup_becomes_markdown():
    assert rst_to_md("a :class:`~zero_runtime.config.ZeroConfig` and ``x``") == (
        "a `ZeroConfig` and `x`"
    )
    assert rst_to_md(":func:`zero_runtime.estimator.estimate`") == (
        "`zero_runtime.estimator.estimate`"
    )
    assert rst_to_md("```python\nx\n```") == "```python\nx\n```"
    assert rst_to_md("A loop::\n\n    step()\n") == "A loop:\n\n    step()\n"
    assert rst_to_md("a: b :: c") == "a: b :: c"
