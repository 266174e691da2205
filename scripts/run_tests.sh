#!/usr/bin/env bash
# Set up, then run every check: ruff lint and format (on the tracked Python and Markdown
# files), the frontend's unit tests and the pytest suite (unit, parity, plugin, real
# TensorBoard + headless Chromium end-to-end, the documentation site's strict build:
# tests/test_docs_site.py). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z -- '*.py' | xargs -0 .venv/bin/ruff check
  git ls-files -z -- '*.py' '*.md' | xargs -0 .venv/bin/ruff format --check --force-exclude
else
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
fi
(cd frontend && npm test --silent)
# Two xdist workers (ZERO_TEST_WORKERS; 0 runs in this process), tests grouped by file and
# the server files in one group: tests/conftest.py's pytest_collection_modifyitems.
.venv/bin/python -m pytest -q -n "${ZERO_TEST_WORKERS:-2}" --dist loadgroup "$@"
