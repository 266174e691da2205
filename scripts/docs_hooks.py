"""MkDocs hook (``hooks:`` in mkdocs.yml): writes the reference pages when the site is built,
from the code they describe, so that they cannot drift from it.

- ``reference/config.md``: every ``ZeroConfig`` key, from the dataclass's fields and its
  docstring's ``Attributes:`` section, the per-key specs (``config.specs.SPECS``), the
  live-tuning table (``config.tunables.TUNABLE_KEYS``) and the DeepSpeed key mapping
  (``config.deepspeed_keys``; each mapping is checked here by importing a DeepSpeed config
  through ``ZeroConfig.from_deepspeed``).
- ``reference/cli.md``: every ``zero-runtime`` subcommand, from its argparse parser
  (``zero_runtime.cli.build_parser``).
- ``reference/api/*.md``: one page per public package (:data:`API_PACKAGES`), a
  mkdocstrings block per name of the package's ``__all__`` (read from its source, without
  importing TensorFlow), rendered from the docstrings.
- ``performance.md``: the headline figures of every results file under ``bench/results/``,
  one table written by ``bench/headlines.py`` (its extractor per file).

A key without a docstring entry, a DeepSpeed mapping that does not map, a public name
that does not resolve to a definition, or a results file without an extractor (or that
its extractor does not read) raises :class:`mkdocs.exceptions.PluginError` and
fails the build. Nothing here is committed as generated Markdown.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import logging
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from docs_griffe import rst_to_md  # scripts/ is on sys.path while MkDocs loads a hook
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

from zero_runtime.cli import build_parser
from zero_runtime.config import TUNABLE_KEYS, DeepSpeedKeyIgnoredWarning, ZeroConfig
from zero_runtime.config.deepspeed_keys import DS_TOP_SCALARS, DS_ZERO_SCALARS
from zero_runtime.config.specs import SPECS

log = logging.getLogger("mkdocs.hooks.docs_hooks")  # under "mkdocs": --strict counts it

REPO = Path(__file__).resolve().parents[1]

API_PACKAGES: tuple[tuple[str, str, str], ...] = (
    # (package, page under reference/api/, title)
    ("zero_runtime", "strategy.md", "Strategy: `zero_runtime`"),
    ("zero_runtime.config", "config.md", "Configuration: `zero_runtime.config`"),
    ("zero_runtime.checkpoint", "checkpoint.md", "Checkpoints: `zero_runtime.checkpoint`"),
    ("zero_runtime.estimator", "estimator.md", "Memory estimate: `zero_runtime.estimator`"),
)
"""The packages whose ``__all__`` makes the Python API reference, in page order."""

# DeepSpeed keys that the import maps through its offload sections rather than the scalar
# tables of config.deepspeed_keys: (ZeroConfig key, DeepSpeed key path, a value to set
# there, the rest of a DeepSpeed config that makes the path take effect). Each row is
# checked by importing that config (_check_deepspeed_counterpart).
_ZO = "zero_optimization"
_DS_SECTION_KEYS: tuple[tuple[str, str, Any, dict[str, Any]], ...] = (
    ("stage", f"{_ZO}.stage", 2, {}),
    ("offload_optimizer", f"{_ZO}.offload_optimizer.device", "cpu", {_ZO: {"stage": 1}}),
    ("offload_param", f"{_ZO}.offload_param.device", "cpu", {_ZO: {"stage": 3}}),
    (
        "nvme_path",
        f"{_ZO}.offload_optimizer.nvme_path",
        "/nvme",
        {_ZO: {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
    ),
    (
        "nvme_path",
        f"{_ZO}.offload_param.nvme_path",
        "/nvme",
        {_ZO: {"stage": 3, "offload_param": {"device": "nvme"}}},
    ),
    (
        "pin_memory",
        f"{_ZO}.offload_optimizer.pin_memory",
        True,
        {_ZO: {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
    ),
    (
        "pin_memory",
        f"{_ZO}.offload_param.pin_memory",
        True,
        {_ZO: {"stage": 3, "offload_param": {"device": "cpu"}}},
    ),
    (
        "offload_optimizer_ratio",
        f"{_ZO}.offload_optimizer.ratio",
        0.5,
        {_ZO: {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    ),
)


# -- Markdown helpers ------------------------------------------------------------------


def _code(value: Any) -> str:
    """A Python value as an inline code span (ints of 6+ digits with ``_`` separators, as
    the config's error messages print them)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 100_000:
        return f"`{value:_}`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    """Plain text made safe for one Markdown table cell."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _human_bytes(n: int) -> str:
    for unit, size in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n // 1024} KiB" if n >= 1024 and n % 1024 == 0 else f"{n} bytes"


def _amount(value: Any, unit: str) -> str:
    """A value as code, with its binary size for a whole number of KiB and more of bytes."""
    text = _code(value)
    if unit == "bytes" and isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        text += f" ({_human_bytes(value)})"
    return text


# -- config keys -----------------------------------------------------------------------


def key_descriptions(doc: str | None) -> dict[str, str]:
    """Each key's text in a Google-style docstring's ``Attributes:`` section, joined into
    one paragraph (``{key: text}``, in the docstring's order)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    try:
        start = lines.index("Attributes:") + 1
    except ValueError:
        raise PluginError("the docstring has no 'Attributes:' section") from None
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines[start:]:
        if line and not line.startswith(" "):  # the next section
            break
        entry = re.match(r"^    (\w+): (.*)$", line)
        if entry:
            current = out.setdefault(entry.group(1), [entry.group(2)])
        elif current is not None and line.strip():
            current.append(line.strip())
    return {key: _sentence(rst_to_md(" ".join(text))) for key, text in out.items()}


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _nested(path: str, value: Any) -> dict[str, Any]:
    head, _, rest = path.partition(".")
    return {head: _nested(rest, value) if rest else value}


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and k in out else v
    return out


def _scalar_probe(key: str) -> Any:
    """A valid value of ``key`` other than its stage-3 DeepSpeed default."""
    default = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}[key]
    return not default if isinstance(default, bool) else default + 1


def _check_deepspeed_counterpart(key: str, path: str, value: Any, rest: dict[str, Any]) -> None:
    """Import ``rest`` with ``path`` set to ``value`` and check that ``key`` took it.

    Raises:
        PluginError: the import failed or ``key`` did not take ``value``.
    """
    ds = _merge(rest, _nested(path, value))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeepSpeedKeyIgnoredWarning)
            got = getattr(ZeroConfig.from_deepspeed(ds), key)
    except ValueError as e:
        raise PluginError(f"DeepSpeed key {path!r} (-> {key}) does not import: {e}") from e
    if got != value:
        raise PluginError(
            f"DeepSpeed key {path!r} is documented as {key}'s counterpart, but importing "
            f"{ds} gave {key}={got!r}, not {value!r} (scripts/docs_hooks.py _DS_SECTION_KEYS)"
        )


def deepspeed_counterparts() -> dict[str, list[str]]:
    """ZeroConfig key -> the DeepSpeed key paths ``ZeroConfig.from_deepspeed`` maps to it,
    each checked by an import.

    Raises:
        PluginError: a mapping that does not map (see _check_deepspeed_counterpart).
    """
    rows = list(_DS_SECTION_KEYS)
    rows += [
        (k, f"{_ZO}.{ds}", _scalar_probe(k), {_ZO: {"stage": 3}})
        for ds, k in DS_ZERO_SCALARS.items()
    ]
    rows += [(k, ds, _scalar_probe(k), {}) for ds, k in DS_TOP_SCALARS.items()]
    out: dict[str, list[str]] = {}
    for key, path, value, rest in rows:
        _check_deepspeed_counterpart(key, path, value, rest)
        out.setdefault(key, []).append(path)
    return out


def _tunable_text(key: str) -> str:
    t = TUNABLE_KEYS[key]
    text = f"{_amount(t.minimum, t.unit)} to {_amount(t.maximum, t.unit)} {t.unit}, ints only"
    text += f"; takes effect: {t.takes_effect}"
    return text + (f"; acts only on runs with {_acts_when(t.acts_when)}" if t.acts_when else "")


def _acts_when(pairs: tuple[tuple[str, Any], ...]) -> str:
    return ", ".join(f"`{k}={v!r}`" for k, v in pairs)


def config_reference() -> str:
    """The Markdown of ``reference/config.md``.

    Raises:
        PluginError: a key without a docstring entry, or a docstring entry without a key.
    """
    fields = dataclasses.fields(ZeroConfig)
    keys = [f.name for f in fields]
    described = key_descriptions(ZeroConfig.__doc__)
    if set(described) != set(keys) or set(SPECS) != set(keys):
        raise PluginError(
            "ZeroConfig's fields, its docstring's Attributes and config.specs.SPECS differ: "
            f"undocumented {sorted(set(keys) - set(described))}, "
            f"not fields {sorted(set(described) - set(keys))}, "
            f"without a spec {sorted(set(keys) - set(SPECS))}"
        )
    ds = deepspeed_counterparts()

    def ds_short(key: str) -> str:
        return ", ".join(f"`{p.replace(_ZO + '.', 'zo.')}`" for p in ds.get(key, [])) or "–"

    rows = [
        (
            f"[`{f.name}`](#{f.name})",
            f"`{f.type}`",
            _amount(f.default, SPECS[f.name].unit),
            _cell(SPECS[f.name].accepted()),
            "yes" if f.name in TUNABLE_KEYS else "no",
            ds_short(f.name),
        )
        for f in fields
    ]
    out = [
        "# Config keys",
        "",
        "Every key of `zero_runtime.ZeroConfig`, in declaration order. This page is written "
        "from the code when the site is built: the types and defaults from the dataclass, "
        "the accepted values from the per-key specs (`zero_runtime/config/specs.py`, the "
        "same text as the errors), the descriptions from the class's docstring, the live "
        "tuning bounds from `TUNABLE_KEYS` and the DeepSpeed keys from the import's key "
        "mapping (each checked by importing a DeepSpeed config). "
        "[Configuration](../config.md) explains units, loading and the DeepSpeed import.",
        "",
        "*Tunable*: the key may be changed on a running job (see [Live tuning](#live-tuning)). "
        "*DeepSpeed*: the keys `ZeroConfig.from_deepspeed` maps from (`zo.` = "
        "`zero_optimization.`); – means none.",
        "",
        *_table(("key", "type", "default", "accepted", "tunable", "DeepSpeed"), rows),
        "",
        "## Keys",
        "",
    ]
    for f in fields:
        out += [f"### `{f.name}`", "", described[f.name], ""]
        out.append(f"- Type `{f.type}`, default {_amount(f.default, SPECS[f.name].unit)}.")
        out.append(f"- Accepted: {SPECS[f.name].accepted()}.")
        if f.name in TUNABLE_KEYS:
            out.append(f"- Tunable on a running job: {_tunable_text(f.name)}.")
        if f.name in ds:
            paths = ", ".join(f"`{p}`" for p in ds[f.name])
            out.append(f"- DeepSpeed: {paths}.")
        out.append("")
    out += [
        "## Live tuning",
        "",
        "The keys a running job accepts from its control file (`TUNABLE_KEYS`, "
        "`zero_runtime/config/tunables.py`); bounds are inclusive and values are ints (not "
        "bool, float or null). The resulting config must also pass `ZeroConfig`'s own "
        "validation. [Live tuning](../tuning.md) describes the channel.",
        "",
        *_table(
            ("key", "unit", "minimum", "maximum", "takes effect", "acts only on runs with"),
            [
                (
                    f"[`{t.key}`](#{t.key})",
                    t.unit,
                    _amount(t.minimum, t.unit),
                    _amount(t.maximum, t.unit),
                    _cell(t.takes_effect),
                    _acts_when(t.acts_when) or "–",
                )
                for t in TUNABLE_KEYS.values()
            ],
        ),
        "",
    ]
    return "\n".join(out)


# -- command line ----------------------------------------------------------------------


def _option_rows(parser: argparse.ArgumentParser) -> list[tuple[str, ...]]:
    rows = []
    for action in parser._actions:  # argparse keeps no public list of its arguments
        if isinstance(action, argparse._HelpAction):
            continue
        name = ", ".join(action.option_strings) or action.metavar or action.dest
        if action.nargs == 0:  # a flag
            value = ""
        elif action.choices:
            value = ", ".join(str(c) for c in action.choices)
        elif action.option_strings:
            value = str(action.metavar or action.dest.upper())
        else:
            value = "..." if action.nargs == argparse.REMAINDER else ""
        default = action.default
        if action.required and action.nargs != argparse.REMAINDER:  # REMAINDER takes none too
            shown = "required"
        elif default in (None, False, argparse.SUPPRESS) or default == []:
            shown = "–"
        else:
            shown = _code(default)
        help_text = action.help or ""
        if "%" in help_text:  # argparse's own expansion of %(default)s and the like
            help_text = help_text % {**vars(action), "prog": parser.prog}
        rows.append((f"`{name}`", f"`{value}`" if value else "", shown, _cell(help_text)))
    return rows


def cli_reference() -> str:
    """The Markdown of ``reference/cli.md``: each subcommand's usage and options."""
    parser, subparsers = build_parser()
    out = [
        "# Command line: `zero-runtime`",
        "",
        "Written from the command's argparse parsers (`zero_runtime/cli/`) when the site is "
        "built. Exit codes: 0 success; 2 bad arguments or an invalid config file (the "
        "message is argparse's one line, `zero-runtime NAME: error: ...`); `oom-report` "
        "exits 1 when the directory holds no post-mortem. `zero-runtime` imports neither "
        "TensorFlow nor Keras until a subcommand needs them.",
        "",
        *_table(
            ("subcommand", "what it does"),
            [
                (f"[`{name}`](#{name})", _cell(p.description or ""))
                for name, p in subparsers.items()
            ],
        ),
        "",
    ]
    for name, sub in subparsers.items():
        sub.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=88)
        usage = sub.format_usage().strip()
        out += [
            f"## `{name}`",
            "",
            _cell(sub.description or ""),
            "",
            "```text",
            usage,
            "```",
            "",
            *_table(("argument", "value", "default", "description"), _option_rows(sub)),
            "",
        ]
    del parser
    return "\n".join(out)


# -- Python API ------------------------------------------------------------------------


def _module_file(module: str) -> Path:
    """The source file of ``module``, found without importing anything (importing a
    subpackage would run its parents, and ``zero_runtime.checkpoint`` imports TensorFlow).

    Raises:
        PluginError: no such module.
    """
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)  # a top-level package: nothing is run
    if spec is None or not spec.submodule_search_locations:
        raise PluginError(f"no package {top!r} on the path")
    for root in spec.submodule_search_locations:
        base = Path(root).joinpath(*rest)
        for path in (base / "__init__.py", base.with_suffix(".py")):
            if path.is_file():
                return path
    raise PluginError(f"no Python source for module {module!r}")


_TREES: dict[str, ast.Module] = {}


def _tree(module: str) -> ast.Module:
    if module not in _TREES:
        _TREES[module] = ast.parse(_module_file(module).read_text(encoding="utf-8"))
    return _TREES[module]


def public_names(module: str) -> list[str]:
    """The module's ``__all__``, read from its source (nothing is imported).

    Raises:
        PluginError: the module has no literal ``__all__``.
    """
    for node in _tree(module).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise PluginError(f"{module} has no literal __all__")


def _imports(module: str) -> Iterator[tuple[str, str, str]]:
    """``(bound name, source module, source name)`` of each absolute ``from X import Y`` in
    the module, at any depth (a lazy ``__getattr__`` imports inside a function). The
    package uses absolute imports only."""
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                yield alias.asname or alias.name, node.module, alias.name


def resolve(module: str, name: str) -> str:
    """The dotted path where ``module.name`` is defined, following ``from X import``
    re-exports through the sources (``zero_runtime.ZeroConfig`` ->
    ``zero_runtime.config.zero_config.ZeroConfig``)."""
    for bound, source, original in _imports(module):
        if bound == name and source.startswith("zero_runtime"):
            return resolve(source, original)
    return f"{module}.{name}"


def api_pages() -> dict[str, str]:
    """``{page path under docs/: Markdown}`` for every package of :data:`API_PACKAGES`.

    Each public name is rendered once, on the page of the most specific package that
    exports it (``ZeroConfig`` under ``zero_runtime.config``); other pages link there.
    """
    owner: dict[str, str] = {}  # definition path -> the package whose page renders it
    for package, _page, _title in API_PACKAGES:
        for name in public_names(package):
            target = resolve(package, name)
            if len(package) > len(owner.get(target, "")):
                owner[target] = package
    pages = {}
    for package, page, title in API_PACKAGES:
        out = [
            f"# {title}",
            "",
            f"The public names of `{package}` (its `__all__`), from their docstrings.",
            "",
        ]
        names = public_names(package)  # rendered here first, then links to other pages
        names.sort(key=lambda name: owner[resolve(package, name)] != package)
        for name in names:
            target = resolve(package, name)
            if owner[target] != package:
                out += [
                    f"## `{package}.{name}`",
                    "",
                    f"The same object as [`{owner[target]}.{name}`][{target}].",
                    "",
                ]
                continue
            out += [
                f"::: {target}",
                "    options:",
                f'      heading: "{package}.{name}"',
                f'      toc_label: "{name}"',
                "",
            ]
        pages[f"reference/api/{page}"] = "\n".join(out)
    return pages


# -- performance -----------------------------------------------------------------------


def load_headlines() -> ModuleType:
    """``bench/headlines.py`` as a module (``bench/`` is not a package; loaded by path, once,
    under the name ``bench_headlines``)."""
    name = "bench_headlines"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / "headlines.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while defining
        spec.loader.exec_module(module)
    return sys.modules[name]


def performance_page(results_dir: Path | None = None) -> str:
    """The Markdown of ``performance.md``: ``bench/headlines.py``'s page over
    ``results_dir`` (default ``bench/results/``).

    Raises:
        PluginError: a results file without an extractor, or that its extractor does not
            read (the message names the file).
    """
    headlines = load_headlines()
    try:
        return headlines.markdown_page(results_dir or headlines.RESULTS_DIR)
    except headlines.ResultsFormatError as e:
        raise PluginError(str(e)) from e


# -- the hook --------------------------------------------------------------------------


def generated_pages() -> dict[str, str]:
    """Every generated page: ``{path under docs/: Markdown}``."""
    return {
        "reference/config.md": config_reference(),
        "reference/cli.md": cli_reference(),
        **api_pages(),
        "performance.md": performance_page(),
    }


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """MkDocs event: add the generated pages to the site's files."""
    for path, markdown in generated_pages().items():
        if files.get_file_from_path(path) is not None:
            raise PluginError(f"docs/{path} is generated by scripts/docs_hooks.py: remove it")
        files.append(File.generated(config, path, content=markdown))
    log.debug("generated %d reference pages", len(files))
    return files
