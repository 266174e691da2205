"""Imported by every bench before ``zero_runtime``: puts this checkout's repository root
first on ``sys.path``, so that a bench run from a git worktree measures that worktree's
code, not the editable install's (``pip install -e`` points at one checkout)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path[:1] != [str(ROOT)]:
    sys.path.insert(0, str(ROOT))
