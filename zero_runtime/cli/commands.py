"""The subcommand registry of the ``zero-runtime`` command line: ``Command`` records in
``COMMANDS``, and the ``UsageError`` a subcommand raises for bad input."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

PROG = "zero-runtime"
"""The program name, used in messages."""


class UsageError(Exception):
    """Raised by a subcommand's ``run`` for bad input; reported as exit code 2."""


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand.

    Attributes:
        name: the subcommand word, e.g. "estimate".
        help: one line shown by ``zero-runtime --help``.
        add_arguments: adds the subcommand's options to its ``argparse`` sub-parser.
        run: executes the parsed arguments; returns the exit code (int).
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}
"""Subcommand name -> Command, in the order shown by ``--help``."""


def register(command: Command) -> Command:
    """Add ``command`` to ``COMMANDS``; returns it. Raises ValueError on a duplicate name."""
    if command.name in COMMANDS:
        raise ValueError(f"subcommand {command.name!r} is already registered")
    COMMANDS[command.name] = command
    return command
