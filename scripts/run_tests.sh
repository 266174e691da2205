#!/usr/bin/env bash
# Set up, then run every check: ruff, the frontend's unit tests and the pytest suite
# (unit, parity, plugin, real TensorBoard + headless Chromium end-to-end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
(cd frontend && npm test --silent)
.venv/bin/python -m pytest -q "$@"
