"""The user guide's code runs: every ```python and ```bash block of docs/guide/.

Per page, the ``python`` blocks are joined in page order into one script, which runs in a
fresh interpreter (this one's ``sys.executable``) in a temporary working directory, so a
later block sees what an earlier one defined, as a reader running the page top to bottom
does. Then the page's ``bash`` blocks run, each with ``bash -euo pipefail``, in the same
directory (they may read what the script wrote: a checkpoint, a log directory). Either
must exit 0.

A block opts out with a first line ``# guide: not run (<why>)``: a set-up that installs
packages, a server that keeps running, a job of several processes. Every other block
runs. A ``text`` block that directly follows a block that runs (nothing but blank lines
between them) is its output: each of its lines that does not contain ``...`` must be a
line of what that bash command printed, or of what the page's script printed for a
python block (whitespace runs compared as one space), so shown output cannot drift from
what the code prints. A line with ``...`` is elided or varies (timings) and is not
compared.

The environment is the one the other subprocess tests use: ``TF_CPP_MIN_LOG_LEVEL=2``;
``NVME_DIR`` names an empty directory under the test's temporary directory (pages read
it as ``os.environ.get("NVME_DIR", ...)``); ``.venv/bin/`` in a bash command is replaced
by this interpreter's ``bin`` directory, and that directory leads ``PATH``. A page whose
script imports TensorFlow or Keras must import ``zero_runtime`` first (it configures the
replicas before TensorFlow starts).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "guide"
PAGES = sorted(GUIDE.glob("*.md"))
#: Languages a guide block may have; only python and bash run.
LANGUAGES = frozenset({"python", "bash", "text", "diff", "json"})
RUNNABLE = frozenset({"python", "bash"})
NOT_RUN = re.compile(r"# guide: not run \((?P<why>[^)]+)\)\s*$")
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.M | re.S,
)
_VENV_BIN = re.compile(r"(?<![\w/.])\.venv/bin/")
#: Seconds one page's script may take (a page trains a tiny model for 2-4 steps).
TIMEOUT = 300


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a page.

    Attributes:
        lang: the fence's language (``python``, ``bash``, ``text``, ...).
        body: the block's text, dedented to the fence's indentation.
        line: 1-based line of the page where the block's first body line is.
        follows_block: only blank lines separate it from the previous block.
    """

    lang: str
    body: str
    line: int
    follows_block: bool

    @property
    def runs(self) -> bool:
        """A python or bash block without the not-run marker on its first line."""
        first = self.body.splitlines()[0] if self.body.strip() else ""
        return self.lang in RUNNABLE and not NOT_RUN.fullmatch(first.strip())


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order."""
    text = page.read_text(encoding="utf-8")
    found, end = [], None
    for m in _FENCE.finditer(text):
        indent = len(m.group("indent"))
        body = "".join(line[indent:] for line in m.group("body").splitlines(keepends=True))
        between = text[end : m.start()] if end is not None else "x"
        found.append(
            Block(
                lang=m.group("lang"),
                body=body,
                line=text.count("\n", 0, m.start("body")) + 1,
                follows_block=not between.strip(),
            )
        )
        end = m.end()
    return found


def script_of(page: Path) -> tuple[str, list[tuple[int, int]]]:
    """The page's python blocks that run, joined; and per block ``(first script line,
    page line)`` to map a traceback's line back to the page."""
    parts, where, n = [], [], 1
    for block in blocks(page):
        if block.lang == "python" and block.runs:
            header = f"# --- {page.name}, line {block.line} ---\n"
            where.append((n + 1, block.line))
            parts.append(header + block.body)
            n += (header + block.body).count("\n") + 1
    return "\n".join(parts), where


def _page_line(stderr: str, script: Path, where: list[tuple[int, int]]) -> str:
    """``page.md:LINE`` of the last traceback frame in ``script``, or ''."""
    frames = re.findall(rf'File "{re.escape(str(script))}", line (\d+)', stderr)
    if not frames:
        return ""
    line = int(frames[-1])
    start, page_line = max((w for w in where if w[0] <= line), default=(1, 1))
    return f" (page line {page_line + line - start})"


def _env(tmp_path: Path) -> dict[str, str]:
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    bindir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "NVME_DIR": str(nvme),
        "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``args`` run in ``cwd`` with ``env``, output captured as text, within ``TIMEOUT``."""
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def _same_line(a: str) -> str:
    return " ".join(a.split())


def _check_output(page: Path, block: Block, stdout: str) -> None:
    """Every line of the text ``block`` without ``...`` is a line of ``stdout``."""
    printed = {_same_line(line) for line in stdout.splitlines()}
    missing = [
        line
        for line in block.body.splitlines()
        if line.strip() and "..." not in line and _same_line(line) not in printed
    ]
    assert not missing, (
        f"{page.name}:{block.line}: output shown on the page but not printed by the "
        f"code above it: {missing}\n--- printed:\n{stdout[-4000:]}"
    )


def test_guide_pages_exist_and_are_in_the_nav():
    """Every guide page is listed in mkdocs.yml's nav (the strict build requires it)."""
    assert PAGES, f"no pages under {GUIDE}"
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    missing = [p.name for p in PAGES if f"guide/{p.name}" not in nav]
    assert not missing, f"guide pages missing from mkdocs.yml's nav: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_blocks_are_well_formed(page):
    """Every fence names a known language; the not-run marker is only on python and bash
    blocks, first line, with a reason; a script that imports TensorFlow or Keras imports
    zero_runtime before them."""
    for block in blocks(page):
        where = f"{page.name}:{block.line}"
        assert block.lang in LANGUAGES, f"{where}: fence language {block.lang!r}"
        marked = [line for line in block.body.splitlines() if "# guide: not run" in line]
        if marked:
            assert block.lang in RUNNABLE and not block.runs, f"{where}: misplaced marker"
    script, _ = script_of(page)
    imports = re.findall(r"^(?:import|from) (\w+)", script, flags=re.M)
    framework = [i for i, name in enumerate(imports) if name in ("tensorflow", "keras")]
    if framework:
        first = imports.index("zero_runtime") if "zero_runtime" in imports else len(imports)
        assert first < framework[0], f"{page.name}: import zero_runtime before {imports}"


RUN_PAGES = [p for p in PAGES if any(b.runs for b in blocks(p))]


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.stem)
def test_page_runs(page, tmp_path):
    """The page's python blocks, as one script, then its bash blocks exit 0; shown output
    matches (module docstring)."""
    env = _env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    script, where = script_of(page)
    printed = ""
    if script:
        path = tmp_path / f"{page.stem}.py"
        path.write_text(script, encoding="utf-8")
        run = _run([sys.executable, str(path)], work, env)
        assert run.returncode == 0, (
            f"{page.name}: its python blocks failed{_page_line(run.stderr, path, where)}:\n"
            + run.stderr[-4000:]
        )
        printed = run.stdout
    bindir = str(Path(sys.executable).parent) + "/"
    last = None
    for block in blocks(page):
        if block.lang == "python" and block.runs:
            last = printed
        elif block.lang == "bash" and block.runs:
            run = _run(
                ["bash", "-euo", "pipefail", "-c", _VENV_BIN.sub(bindir, block.body)], work, env
            )
            assert run.returncode == 0, (
                f"{page.name}:{block.line}: exit {run.returncode}\n{run.stdout[-2000:]}"
                f"\n{run.stderr[-3000:]}"
            )
            last = run.stdout
        elif block.lang == "text" and block.follows_block and last is not None:
            _check_output(page, block, last)
            last = None
        else:
            last = None
