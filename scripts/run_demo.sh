#!/usr/bin/env bash
# The main job: set up, train the demo GPT under ZeRO stage 1 (a few minutes on 2 CPU
# cores), then serve TensorBoard with the Memory Hierarchy tab on 127.0.0.1.
# Environment: PORT (default 6006), STEPS (default 300), LOGDIR (default logs/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT="${PORT:-6006}"
STEPS="${STEPS:-300}"
LOGDIR="${LOGDIR:-logs/demo}"
TF_CPU_ALLOCATOR_USE_BFC=true .venv/bin/python -m demo.train --logdir "$LOGDIR" --steps "$STEPS"
echo
echo "Memory Hierarchy View: http://127.0.0.1:${PORT}/#memory_hierarchy   (Ctrl-C stops TensorBoard)"
echo
exec .venv/bin/tensorboard --logdir "$LOGDIR" --host 127.0.0.1 --port "$PORT" \
  --samples_per_plugin=memory_hierarchy=0
