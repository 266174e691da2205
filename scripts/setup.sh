#!/usr/bin/env bash
# Set up zero-infinity-tf on a fresh machine; safe to run again (idempotent).
#  - Debian's chromium for the browser tests and fio for bench/bench_paging.py (each
#    when missing; needs root or sudo),
#  - the frontend built from frontend/ with npm into tb_plugin/static/ (before pip:
#    setup.py ships that directory as the package tb_plugin.static),
#  - a virtual environment in .venv with the package (editable) and its test and docs
#    extras (pytest, hypothesis, playwright, ruff, tbparse; MkDocs, Material and
#    mkdocstrings for the documentation site: setup.py).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[setup] %s\n' "$*"; }

# Debian packages, each only when its command is missing: chromium (browser tests) and
# fio (bench/bench_paging.py measures the disk with it).
MISSING=()
command -v chromium >/dev/null 2>&1 || MISSING+=(chromium)
command -v fio >/dev/null 2>&1 || MISSING+=(fio)
if [ "${#MISSING[@]}" -gt 0 ]; then
  log "installing Debian's ${MISSING[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${MISSING[@]}" >/dev/null
fi

# The frontend first: setup.py lists tb_plugin/static (built here, not in git) as a
# package, so pip fails on a fresh clone when it does not exist yet.
log "building the frontend (npm)"
if [ ! -f frontend/node_modules/.package-lock.json ] \
   || [ frontend/package-lock.json -nt frontend/node_modules/.package-lock.json ]; then
  (cd frontend && npm ci --no-audit --no-fund --loglevel=error)
fi
(cd frontend && npm run --silent build)
test -f tb_plugin/static/index.js

if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  python3 -m venv .venv
fi
# A GPU host takes tensorflow[and-cuda]; everything else the smaller tensorflow-cpu.
EXTRA=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then EXTRA=gpu; fi
# Installed once per version of the package's metadata: a warm run skips pip entirely.
STAMP=".venv/.zero-infinity-setup"
WANT="${EXTRA} $(cat setup.py pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || ! .venv/bin/python -c "import zero_runtime" 2>/dev/null; then
  log "installing Python packages (.[${EXTRA},test,docs])"
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[${EXTRA},test,docs]"
  echo "$WANT" > "$STAMP"
else
  log "Python packages up to date (.[${EXTRA},test,docs])"
fi

log "ready"
