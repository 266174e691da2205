"""``zero-runtime`` command line: one subcommand per entry of ``COMMANDS``.

Adding a subcommand: write ``add_arguments(parser)`` and ``run(args) -> int`` functions and
add ``Command(name, help, add_arguments, run)`` to ``COMMANDS`` (or call ``register``).
``run`` returns the exit code; a ``UsageError`` raised from it becomes exit code 2 with an
argparse-style message (``zero-runtime NAME: error: ...``), never a traceback.

Exit codes: 0 success; 2 bad arguments or an invalid config file (argparse convention).

This module imports neither TensorFlow nor Keras, so the CLI starts fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation

from zero_runtime.config import (
    OFFLOAD_DEVICES,
    DeepSpeedKeyIgnoredWarning,
    ZeroConfig,
    ZeroConfigError,
)
from zero_runtime.estimator import OPTIMIZER_STATE_BYTES, PRECISIONS, TIERS, estimate

__all__ = ["COMMANDS", "Command", "UsageError", "format_bytes", "main", "register"]

PROG = "zero-runtime"


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


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """Parse a positive element count: ``7500000000``, ``7.5e9`` or ``7.5B`` (k, M, B/G, T
    are decimal multipliers). The value must be a whole number >= 1.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    raw = text.strip()
    suffix = raw[-1:].lower() if raw[-1:].isalpha() and raw[-1:].lower() != "e" else ""
    number = raw[: len(raw) - len(suffix)] if suffix else raw
    try:
        value = Decimal(number) * _SUFFIXES[suffix]
    except (InvalidOperation, KeyError):
        raise argparse.ArgumentTypeError(
            f"invalid count {text!r}: expected a whole number such as 7500000000, 7.5e9 or 7.5B"
        ) from None
    if not value.is_finite() or value != value.to_integral_value() or value < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: expected a whole number >= 1")
    return int(value)


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int {text!r}: expected an int >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {value}: expected an int >= 1")
    return value


def format_bytes(n: int) -> str:
    """Human-readable binary units: ``format_bytes(1875000000) == '1.75 GiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def load_config_file(path: str) -> tuple[ZeroConfig, str]:
    """Load a ZeroConfig JSON or a DeepSpeed JSON (detected by a ``zero_optimization``
    key). Returns the config and its kind ("zero" or "deepspeed"). DeepSpeed keys that
    are ignored or "auto" are reported on stderr, one ``zero-runtime: note:`` line each.

    Raises:
        UsageError: unreadable file, invalid JSON or an invalid config.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except OSError as e:
        raise UsageError(f"cannot read config file {path!r}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"invalid JSON in {path!r}: {e}") from None
    if not isinstance(obj, dict):
        raise UsageError(f"config file {path!r} must hold a JSON object")
    try:
        if "zero_optimization" not in obj:
            return ZeroConfig.from_dict(obj), "zero"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeepSpeedKeyIgnoredWarning)
            config = ZeroConfig.from_deepspeed(obj)
    except ZeroConfigError as e:
        raise UsageError(f"invalid config file {path!r}: {e}") from None
    for w in caught:  # one short line each on stderr, not Python's warning format
        print(f"{PROG}: note: {w.message}", file=sys.stderr)
    return config, "deepspeed"


# --------------------------------------------------------------------------------------
# estimate
# --------------------------------------------------------------------------------------

_TERM_LABELS = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer_states": "optimizer states",
}


def _estimate_add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        type=parse_count,
        required=True,
        metavar="N",
        help="parameter count Ψ, e.g. 7.5e9 or 7.5B",
    )
    parser.add_argument(
        "--replicas",
        type=positive_int,
        required=True,
        metavar="N_D",
        help="data-parallel degree N_d (int >= 1)",
    )
    parser.add_argument(
        "--stage",
        type=int,
        choices=(0, 1, 2, 3),
        default=None,
        help="ZeRO stage; required unless --config gives it",
    )
    parser.add_argument(
        "--offload-optimizer",
        choices=OFFLOAD_DEVICES,
        default=None,
        help="tier of the optimizer states (default: --config's value, else none)",
    )
    parser.add_argument(
        "--offload-param",
        choices=OFFLOAD_DEVICES,
        default=None,
        help="tier of the parameters, stage 3 only (default: --config's value, else none)",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="mixed",
        help="mixed: 2-byte params/grads + fp32 master (default); fp32: 4-byte everything",
    )
    parser.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZER_STATE_BYTES),
        default="adam",
        help="optimizer whose state is counted (default adam)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="ZeroConfig JSON or DeepSpeed JSON (has a zero_optimization key); "
        "supplies stage and offload devices unless given on the command line",
    )


def _estimate_run(args: argparse.Namespace) -> int:
    stage, offload_optimizer, offload_param = None, "none", "none"
    config_kind = None
    if args.config is not None:
        config, config_kind = load_config_file(args.config)
        stage = config.stage
        offload_optimizer, offload_param = config.offload_optimizer, config.offload_param
    if args.stage is not None:
        stage = args.stage
    if stage is None:
        raise UsageError("--stage is required unless --config is given")
    offload_optimizer = args.offload_optimizer or offload_optimizer
    offload_param = args.offload_param or offload_param
    try:
        result = estimate(
            args.params,
            args.replicas,
            stage,
            offload_optimizer,
            offload_param,
            args.precision,
            args.optimizer,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    inputs = {
        "params": args.params,
        "replicas": args.replicas,
        "stage": stage,
        "offload_optimizer": offload_optimizer,
        "offload_param": offload_param,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "config": args.config,
        "config_kind": config_kind,
    }
    if args.json:
        print(json.dumps({**result.to_dict(), "inputs": inputs}, indent=2))
        return 0
    print(
        f"Model states per replica (ZeRO paper, SC20, sec. 5.1): Ψ={args.params:,} params, "
        f"N_d={args.replicas}, stage {stage}, {args.precision} precision, {args.optimizer}"
    )
    print(f"offload: optimizer={offload_optimizer}, param={offload_param}")
    print()
    rows = [("term", "formula", "tier", "bytes", "human")]
    for name, term in result.breakdown.items():
        divisor = f" / {term['divisor']}" if term["divisor"] > 1 else ""
        rows.append(
            (
                _TERM_LABELS.get(name, name),
                f"{term['bytes_per_param']}Ψ{divisor}",
                term["tier"],
                f"{term['bytes']:,}",
                format_bytes(term["bytes"]),
            )
        )
    rows.append(("", "", "", "", ""))
    for tier in TIERS:
        n = result.bytes_on(tier)
        rows.append((f"{tier} total", "", tier, f"{n:,}", format_bytes(n)))
    rows.append(("all tiers", "", "", f"{result.total_bytes:,}", format_bytes(result.total_bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2])]
        cells += [row[3].rjust(widths[3]), row[4].rjust(widths[4])]
        print("  ".join(cells).rstrip())
    return 0


register(
    Command(
        name="estimate",
        help="bytes of model states per replica on each tier (ZeRO paper formulas)",
        add_arguments=_estimate_add_arguments,
        run=_estimate_run,
    )
)


# --------------------------------------------------------------------------------------
# oom-report
# --------------------------------------------------------------------------------------


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
    from zero_runtime import oom  # imports TensorFlow: only for this subcommand

    path = oom.find_report(args.path)
    if path is None:
        print(
            f"{PROG} oom-report: no {oom.OOM_FILENAME} under {args.path!r} "
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
        print(oom.format_report(report, path))
    return 0


register(
    Command(
        name="oom-report",
        help="print the OOM post-mortem of a run (newest under a log directory)",
        add_arguments=_oom_report_add_arguments,
        run=_oom_report_run,
    )
)


# --------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------


def _launch_add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=positive_int, required=True, help="worker processes")
    p.add_argument(
        "--port-base",
        type=positive_int,
        default=None,
        help="worker r listens on port PORT_BASE + r (default: free ports)",
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
        return launch.launch(args.nproc, command, port_base=args.port_base)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


register(
    Command(
        name="launch",
        help="run a training script as N local workers with TF_CONFIG (multi-worker)",
        add_arguments=_launch_add_arguments,
        run=_launch_run,
    )
)


# --------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------


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


register(
    Command(
        name="export",
        help="consolidate a sharded checkpoint into a .keras file or a SavedModel",
        add_arguments=_export_add_arguments,
        run=_export_run,
    )
)


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------


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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
