"""``zero-runtime`` command line: one subcommand per entry of ``COMMANDS``.

Adding a subcommand: write ``add_arguments(parser)`` and ``run(args) -> int`` functions and
add ``Command(name, help, add_arguments, run)`` to ``COMMANDS`` (or call ``register``).
``run`` returns the exit code; a ``UsageError`` raised from it becomes exit code 2 with an
argparse-style message (``zero-runtime NAME: error: ...``), never a traceback.

Exit codes: 0 success; 2 bad arguments or an invalid config file (argparse convention).

This package imports neither TensorFlow nor Keras, so the CLI starts fast.

One module per subcommand (``estimate``, ``oom_report``, ``launch``, ``export``); the
registry in ``commands``, argument types and config-file loading in ``arguments``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from zero_runtime.cli import estimate, export, launch, oom_report
from zero_runtime.cli.arguments import (
    format_bytes,
    load_config_file,
    parse_bytes,
    parse_count,
    positive_int,
)
from zero_runtime.cli.commands import COMMANDS, PROG, Command, UsageError, register

__all__ = [
    "COMMANDS",
    "Command",
    "UsageError",
    "format_bytes",
    "load_config_file",
    "main",
    "parse_bytes",
    "parse_count",
    "positive_int",
    "register",
]

for _module in (estimate, oom_report, launch, export):  # the order of ``--help``
    register(_module.COMMAND)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and one sub-parser per entry of ``COMMANDS``."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="ZeRO-Infinity-style runtime for TensorFlow: tools."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    subparsers = {}
    for command in COMMANDS.values():
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(p)
        subparsers[command.name] = p
    return parser, subparsers


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zero-runtime``; returns the exit code (0 ok, 2 usage error).

    Args:
        argv: arguments without the program name; None means ``sys.argv[1:]``.
    """
    parser, subparsers = build_parser()
    try:
        args = parser.parse_args(argv)
        command = COMMANDS[args.command]
        try:
            return command.run(args)
        except UsageError as e:
            subparsers[command.name].error(str(e))  # prints usage, raises SystemExit(2)
    except SystemExit as e:  # argparse exits on --help (0) and on bad arguments (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return 0  # pragma: no cover  (error() never returns)
