"""``zero-runtime launch``: run a training script as N local workers with ``TF_CONFIG``."""

from __future__ import annotations

import argparse
import os
import sys

from zero_runtime.cli.arguments import non_negative_int, positive_float, positive_int
from zero_runtime.cli.commands import Command, UsageError


def _launch_add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=positive_int, required=True, help="worker processes")
    p.add_argument(
        "--port-base",
        type=positive_int,
        default=None,
        help="worker r listens on port PORT_BASE + r (default: free ports)",
    )
    p.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=0,
        help="restart the whole worker group after a failure up to this many times "
        "(default 0); needs --checkpoint-dir",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="the job's checkpoint directory: locked while the job runs (a second job on "
        "it is refused), passed to the workers as ZERO_RUNTIME_CHECKPOINT_DIR; restart "
        "events go to DIR/restarts.jsonl",
    )
    p.add_argument(
        "--preemption-grace",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="after SIGTERM to a worker, seconds every worker has to save at an agreed "
        "step and exit 42 (default 30)",
    )
    p.add_argument(
        "--min-nproc",
        type=positive_int,
        default=None,
        help="continue with fewer workers (down to this many; sizes that divide --nproc) "
        "when a rank keeps failing; SIGUSR1 to the launcher grows the job back to --nproc "
        "(default: --nproc, never shrink); needs --max-restarts",
    )
    p.add_argument(
        "--shrink-after",
        type=positive_int,
        default=2,
        metavar="R",
        help="with --min-nproc: shrink after R failures in a row blamed on one rank (default 2)",
    )
    p.add_argument(
        "--logdir",
        default=None,
        help="the job's TensorBoard log directory (the one the script writes to): restart "
        "events and goodput also go to LOGDIR/memory_hierarchy_restarts.jsonl for the "
        "Memory Hierarchy tab; passed to the workers as ZERO_RUNTIME_LOGDIR",
    )
    p.add_argument("script", help="a Python script (run with this interpreter) or a program")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _launch_run(args: argparse.Namespace) -> int:
    from zero_runtime import launch

    command = [args.script, *args.args]
    if args.script.endswith(".py"):
        if not os.path.isfile(args.script):
            raise UsageError(f"script {args.script!r} not found")
        command = [sys.executable, *command]
    try:
        return launch.launch(
            args.nproc,
            command,
            port_base=args.port_base,
            max_restarts=args.max_restarts,
            checkpoint_dir=args.checkpoint_dir,
            preemption_grace_seconds=args.preemption_grace,
            min_nproc=args.min_nproc,
            shrink_after=args.shrink_after,
            logdir=args.logdir,
        )
    except (ValueError, launch.DirectoryLockedError) as exc:
        raise UsageError(str(exc)) from None
    except NotADirectoryError as exc:  # the checkpoint directory or the logdir is a file
        raise UsageError(str(exc)) from None
    except OSError as exc:  # the checkpoint directory cannot be created
        raise UsageError(f"--checkpoint-dir: {exc}") from None


COMMAND = Command(
    name="launch",
    help="run a training script as N local workers with TF_CONFIG (multi-worker)",
    add_arguments=_launch_add_arguments,
    run=_launch_run,
)
"""The subcommand (registered by :mod:`zero_runtime.cli`)."""
