#!/usr/bin/env bash
# The main job: set up, then train the same demo GPT twice on the same device (demo/compare.py:
# TensorFlow's CPU allocator capped at 36 MiB; both runs judged by its in-step peak) and
# serve TensorBoard with the Memory Hierarchy tab on 127.0.0.1:
#   1. mirrored_oom   plain data parallelism (ZeRO stage 0): runs out of the device in its
#                     first steps and leaves an OOM post-mortem (the tab shows it first);
#   2. zero_infinity  ZeRO stage 3, offload_param=nvme and offload_optimizer=nvme (real
#                     files) through the host's paged pool (no host budget: parameter
#                     pages stay cached on the host tier): trains, loss falling.
# Environment: PORT (default 6006), STEPS (default 100: the ZeRO-Infinity run's steps),
# LOGDIR (default logs/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT="${PORT:-6006}"
STEPS="${STEPS:-100}"
LOGDIR="${LOGDIR:-logs/demo}"
# Checked before setup and the minutes of training, not when TensorBoard starts.
if ! [[ "$PORT" =~ ^[0-9]+$ ]] || [ "$PORT" -lt 1 ] || [ "$PORT" -gt 65535 ]; then
  echo "run_demo.sh: PORT must be an integer in [1, 65535], got '$PORT'" >&2; exit 2
fi
if ! [[ "$STEPS" =~ ^[0-9]+$ ]] || [ "$STEPS" -lt 1 ]; then
  echo "run_demo.sh: STEPS must be an integer >= 1, got '$STEPS'" >&2; exit 2
fi
if python3 -c "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', int(sys.argv[1])))" "$PORT" 2>/dev/null; then :; else
  echo "run_demo.sh: port $PORT on 127.0.0.1 is already in use (another TensorBoard?); stop it or pick another, e.g. PORT=6007" >&2; exit 2
fi
bash scripts/setup.sh
.venv/bin/python -m demo.compare --logdir "$LOGDIR" --steps "$STEPS"
echo
echo "Memory Hierarchy View: http://127.0.0.1:${PORT}/#memory_hierarchy   (Ctrl-C stops TensorBoard)"
echo
# No --memory_hierarchy_tuning: both jobs have ended when TensorBoard starts, so nothing
# could apply a change; the zero_infinity run's Predict effect replays its recorded access
# trace without the flag (docs/tuning.md).
# TensorBoard loads TensorFlow too: the same start-up lines are dropped (demo/compare.py).
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec .venv/bin/tensorboard --logdir "$LOGDIR" --host 127.0.0.1 --port "$PORT" \
  --samples_per_plugin=memory_hierarchy=0 \
  2> >(grep --line-buffered -Ev '^(WARNING: All log messages before absl::InitializeLog|[IW][0-9]{4} [0-9:. ]+ +[0-9]+ [a-z_]+\.cc:[0-9]+\])' >&2)
