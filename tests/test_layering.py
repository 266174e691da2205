"""Import layering of ``zero_runtime/``: no import circle, and each package imports only
from the layers below it (the table in ``zero_runtime/__init__.py``, :data:`LAYERS`).

The imports are read with ``ast`` from the source (nothing is imported), including
imports inside functions (a lazy import is still a dependency: it only moves the circle
to run time). Importing ``zero_runtime.a.b`` also runs ``zero_runtime/a/__init__.py``, so
an import of a module counts as an import of each package above it too (the package
root excepted: it only imports ``config`` eagerly, checked separately).
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re

import pytest

import zero_runtime

ROOT = pathlib.Path(zero_runtime.__file__).parent
PKG = "zero_runtime"
#: What the runtime may import from the TensorBoard plugin (its data contract and writer).
TB_PLUGIN_ALLOWED = {"tb_plugin", "tb_plugin.metadata", "tb_plugin.summary"}
#: What the TensorBoard plugin may import from the runtime (live tuning's channel, config,
#: and the what-if simulator: pure Python over the recorded trace, no TensorFlow).
RUNTIME_FOR_PLUGIN = {
    "zero_runtime",
    "zero_runtime.control",
    "zero_runtime.config",
    "zero_runtime.memory.simulate",
}


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (package ``PKG``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PKG, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level)`` for every import in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from pkg import mod`` imports the module ``pkg.mod`` when there is one.
            targets = [
                f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                for a in node.names
            ]
        else:
            continue
        found.extend((t, node.lineno, id(node) in top_level) for t in targets)
    return found


def import_graph(root: pathlib.Path) -> tuple[dict[str, set[str]], dict, dict]:
    """The module graph of ``root``: ``(edges, external imports, root's eager imports)``.

    ``edges[a]`` holds every ``zero_runtime`` module ``a`` imports, plus the packages above
    each (their ``__init__`` runs first), except ``a``'s own packages and the root.
    """
    modules = _modules(root)
    edges: dict[str, set[str]] = collections.defaultdict(set)
    external: dict[str, set[str]] = collections.defaultdict(set)
    root_eager: set[str] = set()
    for name, path in modules.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        for target, _line, top in _imports(name, path, modules):
            if target.split(".")[0] == "tb_plugin":
                external[name].add(target)
            if target.split(".")[0] != PKG:
                continue
            if name == PKG:
                if top:
                    root_eager.add(target)
                continue
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix not in own:
                    edges[name].add(prefix)
    return edges, external, root_eager


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(edges):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(edges.get(start, ())))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges.get(nxt, ()))))
    return None


def unit_of(module: str) -> str:
    """The layering unit of a module: its top-level module or package under the root."""
    return module.split(".")[1]


def layer_violations(edges: dict[str, set[str]], layers) -> list[str]:
    """Every import of a unit that is not in a lower layer, as readable lines."""
    rank = {unit: i for i, (_name, units) in enumerate(layers) for unit in units}
    bad = []
    for src, targets in sorted(edges.items()):
        for dst in sorted(targets):
            a, b = unit_of(src), unit_of(dst)
            if a != b and rank[b] >= rank[a]:
                bad.append(f"{src} ({layers[rank[a]][0]}) imports {dst} ({layers[rank[b]][0]})")
    return bad


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT)


def test_every_module_has_a_layer(graph):
    placed = {unit for _name, units in zero_runtime.LAYERS for unit in units}
    units = {unit_of(m) for m in _modules(ROOT) if m != PKG}
    assert units - placed == set(), "modules missing from zero_runtime.LAYERS"
    assert placed - units == set(), "zero_runtime.LAYERS names modules that do not exist"


def test_no_import_circle(graph):
    edges, _, _ = graph
    assert find_cycle(edges) is None, f"import circle: {' -> '.join(find_cycle(edges))}"


def test_each_package_imports_only_lower_layers(graph):
    edges, _, _ = graph
    assert layer_violations(edges, zero_runtime.LAYERS) == []


def test_root_imports_only_foundations_eagerly(graph):
    _, _, root_eager = graph
    foundations = set(zero_runtime.LAYERS[0][1])
    assert {unit_of(m) for m in root_eager} <= foundations, root_eager


def test_runtime_imports_only_the_plugins_contract_and_writer(graph):
    _, external, _ = graph
    bad = {m: sorted(t - TB_PLUGIN_ALLOWED) for m, t in external.items() if t - TB_PLUGIN_ALLOWED}
    assert bad == {}


def test_the_plugin_imports_only_the_control_channel_config_and_simulator():
    plugin_root = ROOT.parent / "tb_plugin"
    bad = {}
    for path in sorted(plugin_root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [
                    f"{node.module}.{a.name}" if node.module == PKG else node.module
                    for a in node.names
                ]
            else:
                continue
            used = {n for n in names if n.split(".")[0] == PKG} - RUNTIME_FOR_PLUGIN
            if used:
                bad[str(path.relative_to(plugin_root))] = sorted(used)
    assert bad == {}


def test_the_docstring_table_is_the_checked_table():
    doc = zero_runtime.__doc__
    for name, units in zero_runtime.LAYERS:
        assert re.search(rf"^\s+{re.escape(name)}\s+{re.escape(', '.join(units))}$", doc, re.M), (
            name,
            units,
        )


def test_the_checker_finds_a_lazy_circle_and_an_upward_import(tmp_path):
    """The checks can fail: a function-level import closing a circle through a package's
    ``__init__``, and an import of a higher layer, are both reported."""
    (tmp_path / "low").mkdir()
    (tmp_path / "low" / "__init__.py").write_text("from zero_runtime.low import a\n")
    (tmp_path / "low" / "a.py").write_text(
        "def f():\n    from zero_runtime.high import b  # lazy\n"
    )
    (tmp_path / "high").mkdir()
    (tmp_path / "high" / "__init__.py").write_text("")
    (tmp_path / "high" / "b.py").write_text("from zero_runtime.low import something\n")
    edges, _, _ = import_graph(tmp_path)
    cycle = find_cycle(edges)
    assert cycle is not None and "zero_runtime.high.b" in cycle and "zero_runtime.low" in cycle
    layers = (("bottom", ("low",)), ("top", ("high",)))
    assert layer_violations(edges, layers) == [
        "zero_runtime.low.a (bottom) imports zero_runtime.high (top)",
        "zero_runtime.low.a (bottom) imports zero_runtime.high.b (top)",
    ]
