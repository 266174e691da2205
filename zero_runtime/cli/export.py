"""``zero-runtime export``: consolidate a sharded checkpoint into a ``.keras`` file or a
SavedModel."""

from __future__ import annotations

import argparse
import os
import sys

from zero_runtime.cli.commands import PROG, Command, UsageError


def _export_add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        metavar="CKPT_DIR",
        help="a checkpoint root (its 'latest' is used) or one checkpoint directory",
    )
    p.add_argument(
        "--out",
        required=True,
        help="output: FILE.keras (Keras archive) or a directory (TensorFlow SavedModel)",
    )
    p.add_argument("--tag", default=None, help="a checkpoint tag under the root")
    p.add_argument(
        "--import",
        dest="import_modules",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (found from the current directory too), registering the "
        "model's custom layers, e.g. --import demo.model; repeatable",
    )


def _export_run(args: argparse.Namespace) -> int:
    """Consolidate a sharded checkpoint into a plain Keras model / SavedModel."""
    from zero_runtime.checkpoint import CheckpointError, export  # imports TensorFlow

    if args.import_modules and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` finds the user's modules
    try:
        out = export(args.checkpoint, args.out, tag=args.tag, import_modules=args.import_modules)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    except ImportError as exc:
        raise UsageError(f"--import: {exc}") from None
    print(f"{PROG} export: wrote {out}")
    return 0


COMMAND = Command(
    name="export",
    help="consolidate a sharded checkpoint into a .keras file or a SavedModel",
    add_arguments=_export_add_arguments,
    run=_export_run,
)
"""The subcommand (registered by :mod:`zero_runtime.cli`)."""
