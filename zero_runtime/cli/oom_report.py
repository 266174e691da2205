"""``zero-runtime oom-report``: print the newest OOM post-mortem of a run."""

from __future__ import annotations

import argparse
import json
import os
import sys

from zero_runtime import oom_report  # the report's contract, without TensorFlow
from zero_runtime.cli.commands import PROG, Command, UsageError


def _oom_report_add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        metavar="LOGDIR_OR_RUN",
        help="a log directory, a run directory or a memory_hierarchy_oom.json file; the "
        "newest post-mortem under it is shown",
    )
    parser.add_argument("--json", action="store_true", help="print the report's JSON object")


def _oom_report_run(args: argparse.Namespace) -> int:
    """Print the newest OOM post-mortem under ``args.path``; exit 1 when there is none."""
    if not os.path.exists(args.path):
        raise UsageError(f"{args.path!r} does not exist")
    path = oom_report.find_report(args.path)
    if path is None:
        print(
            f"{PROG} oom-report: no {oom_report.OOM_FILENAME} under {args.path!r} "
            "(no run there ran out of memory)",
            file=sys.stderr,
        )
        return 1
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read the post-mortem {path}: {exc}") from exc
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True))
    else:
        print(oom_report.format_report(report, path))
    return 0


COMMAND = Command(
    name="oom-report",
    help="print the OOM post-mortem of a run (newest under a log directory)",
    add_arguments=_oom_report_add_arguments,
    run=_oom_report_run,
)
"""The subcommand (registered by :mod:`zero_runtime.cli`)."""
