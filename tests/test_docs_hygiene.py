"""No development history in the tracked files, and docs pages a reader can take in.

Development history belongs in ``git log`` and measured results in ``bench/results/``;
docs, docstrings and comments say what the code does and why, without an issue number, a
"session N" or a dated run. This greps every tracked text file (``git ls-files``) except
``bench/results/`` for :data:`PATTERNS` and fails listing ``file:line`` for each hit.
pytest's ``scope="session"`` and TensorBoard or HTTP sessions match none of them.

Every tracked Markdown page under ``docs/`` has at most :data:`MAX_DOC_LINES` lines: a
longer topic is split into pages (a section of the site's nav), not grown.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Paths not scanned: measured results (dated by design) and this file, which spells out
#: the patterns.
SKIPPED = ("bench/results/", "tests/test_docs_hygiene.py")

#: Files let through the history check while another change cleans them (none now). An
#: entry must still have hits: ``test_allowlist_names_only_files_with_history`` fails for a
#: clean one, so this tuple only shrinks back to empty.
ALLOWLIST: tuple[str, ...] = ()

#: Lines a tracked ``docs/**/*.md`` page may have at most.
MAX_DOC_LINES = 500

#: (what it finds, regex matched case-insensitively against each line).
PATTERNS = (
    ("issue number", r"\bissues? #?\d+"),
    ("session number", r"\bsessions? \d+"),
    ("session in time", r"\b(?:this|last|previous|earlier|next) session\b"),
    ("wave", r"\bwave\b"),
    ("dated run", r"\(20\d\d-\d\d-\d\d\)"),
    (
        "dated run",
        r"\b(?:measured|re-?measured|re-?run|ran|checked|fixed|added|since)\b"
        r"[^\n]{0,40}?\b20\d\d-\d\d-\d\d\b",
    ),
    (
        "what the code used to do",
        r"\bused to (?:pass|fail|raise|read|wait|give|die|stay|add|wake)\b",
    ),
)
_COMPILED = tuple((name, re.compile(rx, re.IGNORECASE)) for name, rx in PATTERNS)


@functools.cache
def _hits() -> dict[str, tuple[str, ...]]:
    """Tracked path -> its hits, ``"path:line: [pattern] text"`` (paths in ``SKIPPED``,
    binary files and tracked files missing from the working tree are not read)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    out: dict[str, tuple[str, ...]] = {}
    for path in filter(None, listed.split("\0")):
        file = ROOT / path
        if path.startswith(SKIPPED) or not file.is_file():
            continue
        data = file.read_bytes()
        if b"\0" in data:
            continue
        found = [
            f"{path}:{n}: [{name}] {line.strip()[:120]}"
            for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1)
            for name, rx in _COMPILED
            if rx.search(line)
        ]
        if found:
            out[path] = tuple(found)
    return out


def test_no_development_history_in_tracked_files():
    """No tracked file outside ``ALLOWLIST`` names an issue, a session or a dated run:
    each hit is listed as ``file:line``; rewrite the sentence to say what the code does
    and why (the history is in git log, the figures in bench/results/)."""
    hits = [h for path, found in _hits().items() if path not in ALLOWLIST for h in found]
    assert not hits, "development history in docs or code:\n" + "\n".join(hits)


def test_allowlist_names_only_files_with_history():
    """Every ``ALLOWLIST`` entry is a tracked file that still has a hit: a cleaned file
    leaves the allowlist, so the check then guards it."""
    clean = [path for path in ALLOWLIST if path not in _hits()]
    assert not clean, f"clean now, remove from ALLOWLIST in {SKIPPED[1]}: {clean}"


def test_docs_pages_are_at_most_max_doc_lines_long():
    """Every tracked ``docs/**/*.md`` (``git ls-files``) has at most ``MAX_DOC_LINES``
    lines; each longer page is listed with its count. Split such a page by topic into
    pages of its own (and add them to mkdocs.yml's nav) rather than raising the bound."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", "docs/*.md"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    pages = [p for p in listed.split("\0") if p and (ROOT / p).is_file()]
    assert pages, "git ls-files found no docs/**/*.md"
    long = {}
    for path in pages:
        n = len((ROOT / path).read_text(encoding="utf-8").splitlines())
        if n > MAX_DOC_LINES:
            long[path] = n
    assert not long, f"docs pages over {MAX_DOC_LINES} lines (split them by topic): {long}"
