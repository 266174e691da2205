"""The main job's two runs: plain data parallelism runs out of a device budget, and
ZeRO-Infinity trains the same model under the same budget.

``scripts/run_demo.sh`` calls this, then serves TensorBoard on the log directory::

    python -m demo.compare --logdir logs/demo --steps 100

Runs (subdirectories of ``--logdir``, emptied first):

- ``mirrored_oom``: ZeRO stage 0 (every replica holds all parameters, gradients and
  Adam states, as ``tf.distribute.MirroredStrategy`` does) under ``--device-budget``
  bytes. Expected to stop at its first step with exit status 1 and an OOM post-mortem
  (``memory_hierarchy_oom.json``), which the tab shows first for that run.
- ``zero_infinity``: ZeRO stage 3, parameters and optimizer states offloaded to NVMe
  (real files under ``--nvme-dir``) through the host's paged pool, same budget, trained
  for ``--steps`` steps.

Each run is ``python -m demo.train`` in its own process (a run that fails leaves the
other untouched). TensorFlow's start-up lines that ignore ``TF_CPP_MIN_LOG_LEVEL`` are
dropped from their stderr; everything else is passed through.

Exit status: 0 when the mirrored run ran out of memory (status 1) and the ZeRO-Infinity
run finished (status 0); 1 otherwise (the message says which run did what); 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: find `demo` and `zero_runtime`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zero_runtime.cli import positive_int  # noqa: E402  (no TensorFlow import)

#: Run directory names, in the order they run (and the tab lists them).
MIRRORED_RUN = "mirrored_oom"
ZERO_RUN = "zero_infinity"
#: TensorFlow's lines that precede its logging set-up (they ignore TF_CPP_MIN_LOG_LEVEL).
NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog"
    r"|[IW]\d{4} [\d:. ]+\s+\d+ [\w./-]+\.cc:\d+\])"
)
REPO = Path(__file__).resolve().parent.parent
#: ZeroConfig keys both runs start from (``--set`` overrides them). 256 KiB pages: stage 3
#: still gives every variable's shard at least one page (issue #16, flat chunks), which at
#: the default 4 MiB would hold ~20x the demo's parameter bytes on the host and NVMe.
DEFAULT_SETS = ("page_size_bytes=262144",)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m demo.compare`` (defaults: the README's demo)."""
    p = argparse.ArgumentParser(
        prog="python -m demo.compare",
        description="Train the demo GPT with plain data parallelism (runs out of the device "
        "budget) and with ZeRO-Infinity (trains), under the same budget.",
    )
    p.add_argument("--logdir", default=str(REPO / "logs" / "demo"), help="TensorBoard logdir")
    p.add_argument("--steps", type=positive_int, default=100, help="ZeRO-Infinity run's steps")
    p.add_argument(
        "--device-budget",
        type=positive_int,
        default=12 << 20,
        help="device tier budget in bytes for both runs (default 12 MiB)",
    )
    p.add_argument("--d-model", type=positive_int, default=192, help="model width")
    p.add_argument("--layers", type=positive_int, default=3, help="transformer blocks")
    p.add_argument(
        "--nvme-dir",
        default=os.path.join(tempfile.gettempdir(), "zero-infinity-demo-nvme"),
        help="directory for the NVMe tier's files (created; default under the temp dir)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more ZeroConfig key for both runs, e.g. --set page_size_bytes=262144",
    )
    return p


def _pipe_filtered(src, dst) -> None:
    for line in iter(src.readline, ""):
        if not NOISE.match(line):
            dst.write(line)
            dst.flush()
    src.close()


def run_train(args: Sequence[str]) -> int:
    """Run ``python -m demo.train ARGS`` with the allocator reading on; stdout passes
    through, stderr without TensorFlow's start-up noise. Returns the exit status."""
    env = dict(os.environ)
    env.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "demo.train", *args],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    t = threading.Thread(target=_pipe_filtered, args=(proc.stderr, sys.stderr), daemon=True)
    t.start()
    status = proc.wait()
    t.join(timeout=10)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run both; returns the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    logdir = Path(args.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    Path(args.nvme_dir).mkdir(parents=True, exist_ok=True)
    for run in (MIRRORED_RUN, ZERO_RUN):  # an earlier demo's events would mix in
        shutil.rmtree(logdir / run, ignore_errors=True)
    model = ["--d-model", str(args.d_model), "--layers", str(args.layers)]
    budget = f"device_budget_bytes={args.device_budget}"
    extra = [a for item in (*DEFAULT_SETS, *args.set) for a in ("--set", item)]
    mib = args.device_budget / (1 << 20)
    print(f"== 1/2  plain data parallelism (stage 0), device budget {mib:g} MiB ==", flush=True)
    mirrored = run_train(
        ["--logdir", str(logdir), "--run", MIRRORED_RUN, "--steps", "5", *model]
        + ["--set", "stage=0", "--set", budget, *extra]
    )
    print(flush=True)
    print(
        f"== 2/2  ZeRO-Infinity (stage 3; parameters and optimizer states on NVMe), "
        f"device budget {mib:g} MiB ==",
        flush=True,
    )
    zero = run_train(
        ["--logdir", str(logdir), "--run", ZERO_RUN, "--steps", str(args.steps), *model]
        + ["--set", "stage=3", "--set", "offload_param=nvme", "--set", "offload_optimizer=nvme"]
        + ["--set", f"nvme_path={args.nvme_dir}", "--set", budget, *extra]
    )
    ok = mirrored == 1 and zero == 0
    if mirrored != 1:
        print(
            f"demo.compare: the mirrored run was expected to run out of memory (exit 1), "
            f"it exited {mirrored}: raise --d-model or lower --device-budget",
            file=sys.stderr,
        )
    if zero != 0:
        print(f"demo.compare: the ZeRO-Infinity run exited {zero}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
