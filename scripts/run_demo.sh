#!/usr/bin/env bash
# The main job: set up, then train the same demo GPT twice under the same device budget
# (demo/compare.py) and serve TensorBoard with the Memory Hierarchy tab on 127.0.0.1:
#   1. mirrored_oom   plain data parallelism (ZeRO stage 0): runs out of the budget at its
#                     first step and leaves an OOM post-mortem (the tab shows it first);
#   2. zero_infinity  ZeRO stage 3, parameters and optimizer states offloaded to NVMe
#                     (real files) through the host's paged pool: trains, loss falling.
# Environment: PORT (default 6006), STEPS (default 100: the ZeRO-Infinity run's steps),
# LOGDIR (default logs/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT="${PORT:-6006}"
STEPS="${STEPS:-100}"
LOGDIR="${LOGDIR:-logs/demo}"
.venv/bin/python -m demo.compare --logdir "$LOGDIR" --steps "$STEPS"
echo
echo "Memory Hierarchy View: http://127.0.0.1:${PORT}/#memory_hierarchy   (Ctrl-C stops TensorBoard)"
echo
# TensorBoard loads TensorFlow too: the same start-up lines are dropped (demo/compare.py).
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec .venv/bin/tensorboard --logdir "$LOGDIR" --host 127.0.0.1 --port "$PORT" \
  --samples_per_plugin=memory_hierarchy=0 \
  2> >(grep --line-buffered -Ev '^(WARNING: All log messages before absl::InitializeLog|[IW][0-9]{4} [0-9:. ]+ +[0-9]+ [a-z_]+\.cc:[0-9]+\])' >&2)
