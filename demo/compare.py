"""The main job's two runs: plain data parallelism runs out of device memory, and
ZeRO-Infinity trains the same model on the same device.

``scripts/run_demo.sh`` calls this, then serves TensorBoard on the log directory::

    python -m demo.compare --logdir logs/demo --steps 100

The device: on the CPU stand-in, TensorFlow's CPU allocator capped at ``--device-mib``
MiB (``TF_CPU_BFC_MEM_LIMIT_IN_MB``, set for both runs): past it TensorFlow refuses the
allocation, as a GPU's allocator does. Both runs are judged by one measure, TensorFlow's
allocator in-step peak (``tf.config.experimental.get_memory_info(...)['peak']``, reset at
every step boundary): every tensor TensorFlow holds for either replica (parameters,
gradients, optimizer states, activations, the paged pool's device pages), nothing the
runtime keeps in host memory or on NVMe. Each run prints it (``demo.train``).

Runs (subdirectories of ``--logdir``, emptied first):

- ``mirrored_oom``: ZeRO stage 0 (every replica holds all parameters, gradients and
  Adam states, as ``tf.distribute.MirroredStrategy`` does), ``device_budget_bytes`` = the
  device. Expected to run out of memory in its first steps with exit status 1 and an OOM
  post-mortem (``memory_hierarchy_oom.json``), which the tab shows first for that run.
- ``zero_infinity``: ZeRO stage 3, ``offload_param=nvme`` and ``offload_optimizer=nvme``
  (real files under ``--nvme-dir``) through the host's paged pool, on the same device
  (no host budget is set, so the parameters' pages stay cached on the host tier and the
  optimizer states are what the NVMe files hold);
  ``device_budget_bytes`` = ``--pool-budget``, the part of the device the pool's pages may
  take (the rest holds activations and TensorFlow's buffers); trained for ``--steps``.

Each run is ``python -m demo.train`` in its own process (a run that fails leaves the
other untouched). TensorFlow's start-up lines that ignore ``TF_CPP_MIN_LOG_LEVEL`` are
dropped from their stderr; everything else is passed through.

Exit status: 0 when the mirrored run ran out of memory (status 1) and the ZeRO-Infinity
run finished (status 0); 1 otherwise (the message says which run did what); 2 on bad
arguments (a pool budget not below the device).
"""

from __future__ import annotations

import argparse
import json
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
#: still gives every variable's shard at least one page (flat chunks), which at
#: the default 4 MiB would hold ~20x the demo's parameter bytes on the host and NVMe.
DEFAULT_SETS = ("page_size_bytes=262144",)
#: TensorFlow's CPU allocator cap, MiB: the CPU stand-in device's memory.
CAP_ENV = "TF_CPU_BFC_MEM_LIMIT_IN_MB"


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
        "--device-mib",
        type=positive_int,
        default=36,
        help="the device's memory in MiB for both runs: TensorFlow's CPU allocator cap "
        "(TF_CPU_BFC_MEM_LIMIT_IN_MB) and the mirrored run's device_budget_bytes (default 36)",
    )
    p.add_argument(
        "--pool-budget",
        type=positive_int,
        default=12 << 20,
        help="ZeRO-Infinity's device_budget_bytes: bytes of the device its paged pool may "
        "hold (default 12 MiB)",
    )
    p.add_argument("--batch-size", type=positive_int, default=8, help="global batch size")
    p.add_argument("--seq-len", type=positive_int, default=32, help="tokens per sequence")
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


def run_train(args: Sequence[str], device_mib: int) -> int:
    """Run ``python -m demo.train ARGS`` with the allocator reading on and capped at
    ``device_mib`` MiB; stdout passes through, stderr without TensorFlow's start-up
    noise. Returns the exit status."""
    env = dict(os.environ)
    env.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env[CAP_ENV] = str(device_mib)
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


def comparison(summaries: Path, device_mib: int) -> list[str]:
    """The closing side-by-side: one line per run, from the ``--summary`` JSON each
    ``demo.train`` wrote into ``summaries`` (file named after the run): its outcome, the
    device's highest in-step peak against the ``device_mib`` MiB device, and where the
    bytes of its last recorded step were (device / host / NVMe, MiB). A run that wrote no
    summary (it failed before training) says so."""
    lines = ["== the two runs on the same device =="]
    for run in (MIRRORED_RUN, ZERO_RUN):
        try:
            s = json.loads((summaries / run).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            lines.append(f"{run:>14}: no summary (the run failed before training; see above)")
            continue
        if s["status"] == "out_of_memory":
            outcome = f"out of memory at step {s['steps']} (expected)"
        else:
            outcome = f"trained {s['steps']} steps, final loss {s['loss']:.3f}"
        peak = s.get("peak_bytes")
        peak_text = "peak not read" if peak is None else f"device peak {peak / MIB:.1f} MiB"
        where = ", ".join(
            f"{tier} {(t.get('used_bytes') or 0) / MIB:.1f}"
            for tier, t in s.get("tiers", {}).items()
            if t.get("used_bytes")
        )
        lines.append(
            f"{run:>14}: {outcome}; {peak_text} of {device_mib} MiB; "
            f"bytes held (MiB): {where or 'not recorded'}"
        )
    return lines


MIB = 1 << 20


def main(argv: Sequence[str] | None = None) -> int:
    """Run both; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    device = args.device_mib << 20
    if args.pool_budget >= device:
        parser.error(
            f"--pool-budget {args.pool_budget} must be below the device "
            f"(--device-mib {args.device_mib} = {device} bytes): activations and "
            "TensorFlow's buffers need the rest"
        )
    logdir = Path(args.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    Path(args.nvme_dir).mkdir(parents=True, exist_ok=True)
    for run in (MIRRORED_RUN, ZERO_RUN):  # an earlier demo's events would mix in
        shutil.rmtree(logdir / run, ignore_errors=True)
    model = ["--d-model", str(args.d_model), "--layers", str(args.layers)]
    model += ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    extra = [a for item in (*DEFAULT_SETS, *args.set) for a in ("--set", item)]
    pool_mib = args.pool_budget / (1 << 20)
    print(
        f"The device: {args.device_mib} MiB for both runs (TensorFlow's CPU allocator "
        f"capped, {CAP_ENV}={args.device_mib}). Both are judged by TensorFlow's allocator "
        "in-step peak: every tensor either replica holds, activations included.",
        flush=True,
    )
    print(f"== 1/2  plain data parallelism (stage 0), device {args.device_mib} MiB ==", flush=True)
    summaries = Path(tempfile.mkdtemp(prefix="demo-compare-"))
    mirrored = run_train(
        ["--logdir", str(logdir), "--run", MIRRORED_RUN, "--steps", "5", *model]
        + ["--set", "stage=0", "--set", f"device_budget_bytes={device}", *extra]
        + ["--expect-oom", "--summary", str(summaries / MIRRORED_RUN)],
        args.device_mib,
    )
    print(flush=True)
    print(
        f"== 2/2  ZeRO-Infinity (stage 3; parameters and optimizer states on NVMe), device "
        f"{args.device_mib} MiB, of which the paged pool's pages may take {pool_mib:g} MiB "
        "(device_budget_bytes) ==",
        flush=True,
    )
    zero = run_train(
        ["--logdir", str(logdir), "--run", ZERO_RUN, "--steps", str(args.steps), *model]
        + ["--set", "stage=3", "--set", "offload_param=nvme", "--set", "offload_optimizer=nvme"]
        + ["--set", f"nvme_path={args.nvme_dir}"]
        + ["--set", f"device_budget_bytes={args.pool_budget}", *extra]
        + ["--summary", str(summaries / ZERO_RUN)],
        args.device_mib,
    )
    print(flush=True)
    for line in comparison(summaries, args.device_mib):
        print(line, flush=True)
    shutil.rmtree(summaries, ignore_errors=True)
    ok = mirrored == 1 and zero == 0
    if mirrored != 1:
        print(
            f"demo.compare: the mirrored run was expected to run out of memory (exit 1), "
            f"it exited {mirrored}: raise --d-model or --layers, or lower --device-mib",
            file=sys.stderr,
        )
    if zero != 0:
        print(
            f"demo.compare: the ZeRO-Infinity run exited {zero}: if it ran out of memory, "
            "lower --pool-budget or raise --device-mib",
            file=sys.stderr,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
