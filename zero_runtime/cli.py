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
from typing import Any

from zero_runtime.config import (
    OFFLOAD_DEVICES,
    DeepSpeedKeyIgnoredWarning,
    ZeroConfig,
    ZeroConfigError,
    looks_like_deepspeed,
)
from zero_runtime.estimator import (
    ACCOUNTINGS,
    OPTIMIZER_STATE_BYTES,
    PRECISIONS,
    TIERS,
    Budgets,
    estimate,
    estimate_choices,
    smallest_fit,
)

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


_BYTE_SUFFIXES = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """Parse a positive byte count: ``34359738368``, ``32GiB``, ``32e9``, ``32GB``, ``32G``
    (KiB/MiB/GiB/TiB binary; k/K(B), M(B), G(B), T(B) decimal). Whole bytes >= 1.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse turns it into exit code 2).
    """
    stripped = text.strip()
    number = stripped.rstrip("KMGTBikmgtb")
    suffix = stripped[len(number) :].lower()
    try:
        value = Decimal(number) * _BYTE_SUFFIXES[suffix]
    except (InvalidOperation, KeyError):
        raise argparse.ArgumentTypeError(
            f"invalid byte count {text!r}: expected e.g. 34359738368, 32GiB, 32GB or 3.2e10"
        ) from None
    if not value.is_finite() or value != value.to_integral_value() or value < 1:
        raise argparse.ArgumentTypeError(
            f"invalid byte count {text!r}: expected a whole number of bytes >= 1"
        )
    return int(value)


def format_bytes(n: int) -> str:
    """Human-readable binary units: ``format_bytes(1875000000) == '1.75 GiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def load_config_file(path: str, hidden_size: int | None = None) -> tuple[ZeroConfig, str]:
    """Load a ZeroConfig JSON or a DeepSpeed JSON (detected by a DeepSpeed section such as
    ``zero_optimization``, or a misspelling of one: ``config.looks_like_deepspeed``).
    Returns the config and its kind ("zero" or "deepspeed"). DeepSpeed keys that are
    ignored or "auto" are reported on stderr, one ``zero-runtime: note:`` line each.
    ``hidden_size`` resolves DeepSpeed's "auto" bucket sizes as the HF Trainer does.

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
        if not looks_like_deepspeed(obj):
            return ZeroConfig.from_dict(obj), "zero"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeepSpeedKeyIgnoredWarning)
            config = ZeroConfig.from_deepspeed(obj, hidden_size=hidden_size)
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
    "fp32_grads": "fp32 gradients",
    "optimizer_states": "optimizer states",
    "persistent_params": "persistent params",
    "working_set": "working memory",
    "row_cache": "embedding row cache",
}


def _estimate_add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        type=parse_count,
        default=None,
        metavar="N",
        help="parameter count Ψ, e.g. 7.5e9 or 7.5B (required unless --model)",
    )
    parser.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        default=None,
        help="a function returning a built keras.Model; it is called without allocating "
        "weights (keras.StatelessScope) and its weights' shapes give Ψ, the units and the "
        "dtype policy",
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
        help="ZeRO stage; without it (and without --config) every stage/offload choice is "
        "listed, which needs --model or a budget",
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
        default=None,
        help="mixed: 2-byte params/grads + fp32 master; fp32: 4-byte everything "
        "(default: mixed with --params, the model's dtype policy with --model)",
    )
    parser.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZER_STATE_BYTES),
        default=None,
        help="optimizer whose state is counted (default: the compiled model's, else adam)",
    )
    parser.add_argument(
        "--accounting",
        choices=ACCOUNTINGS,
        default="sc21",
        help="sc21 (default): ZeRO-Infinity/DeepSpeed (fp32 gradient copy, gradients with "
        "offloaded optimizer states, stage-3 working memory); sc20: the ZeRO paper's model "
        "states (this runtime's layout)",
    )
    parser.add_argument(
        "--largest-layer",
        type=parse_count,
        default=None,
        metavar="N",
        help="elements of the largest unit (DeepSpeed's largest_layer_params) for the "
        "stage-3 working memory with --params (default 0); --model finds it",
    )
    for tier, scope in (("device", "per device"), ("host", "per process"), ("nvme", "per process")):
        parser.add_argument(
            f"--{tier}-budget",
            type=parse_bytes,
            default=None,
            metavar="BYTES",
            help=f"{tier} bytes available {scope}, e.g. 32GiB; lists every choice and "
            "names the smallest that fits",
        )
    parser.add_argument(
        "--local-replicas",
        type=positive_int,
        default=1,
        metavar="N",
        help="replicas per process sharing --host-budget and --nvme-budget (default 1)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="ZeroConfig JSON or DeepSpeed JSON (has a zero_optimization key); "
        "supplies stage and offload devices unless given on the command line",
    )
    parser.add_argument(
        "--hidden-size",
        type=positive_int,
        default=None,
        metavar="H",
        help="the model's hidden size: resolves a DeepSpeed config's \"auto\" "
        "reduce_bucket_size (H*H), stage3_prefetch_bucket_size (0.9*H*H) and "
        "stage3_param_persistence_threshold (10*H) as the Hugging Face Trainer does",
    )


def _load_model_factory(spec: str) -> Callable[[], Any]:
    """``MODULE:FUNCTION`` -> the function (the current directory is importable)."""
    import importlib  # noqa: PLC0415

    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise UsageError(f"--model {spec!r} is invalid: expected MODULE:FUNCTION")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"--model {spec!r}: cannot import {module_name!r}: {e}") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise UsageError(f"--model {spec!r}: {module_name} has no function {function_name!r}")
    return factory


class _Estimator:
    """One estimate per (stage, offload_optimizer, offload_param) for the parsed args."""

    def __init__(self, args: argparse.Namespace, config: ZeroConfig) -> None:
        self.args, self.config, self.model_info = args, config, None
        self.optimizer = args.optimizer
        if args.model is not None:
            from zero_runtime import estimator  # noqa: PLC0415

            factory = _load_model_factory(args.model)
            try:
                self.model = estimator.build_model_abstractly(factory)
            except ValueError as e:
                raise UsageError(f"--model {args.model!r}: {e}") from None
            self.precision = args.precision
        else:
            self.model = None
            self.precision = args.precision or "mixed"
            self.optimizer = args.optimizer or "adam"

    def __call__(self, stage: int, offload_optimizer: str, offload_param: str):
        args = self.args
        try:
            if self.model is None:
                return estimate(
                    args.params,
                    args.replicas,
                    stage,
                    offload_optimizer,
                    offload_param,
                    self.precision,
                    self.optimizer,
                    accounting=args.accounting,
                    largest_unit_params=args.largest_layer or 0,
                )
            from zero_runtime.estimator import estimate_for_model  # noqa: PLC0415

            result = estimate_for_model(
                self.model,
                self.config,
                args.replicas,
                self.precision,
                self.optimizer,
                accounting=args.accounting,
                page_rounding=True,
                stage=stage,
                offload_optimizer=offload_optimizer,
                offload_param=offload_param,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        self.model_info = result
        return result.tiers


def _print_rows(rows: list[tuple[str, ...]], right: int) -> None:
    """Columns padded; the last ``right`` columns right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        left = len(row) - right
        cells = [c.ljust(w) for c, w in zip(row[:left], widths[:left])]
        cells += [c.rjust(w) for c, w in zip(row[left:], widths[left:])]
        print("  ".join(cells).rstrip())


def _estimate_run(args: argparse.Namespace) -> int:
    if (args.params is None) == (args.model is None):
        raise UsageError("give exactly one of --params N and --model MODULE:FUNCTION")
    stage, offload_optimizer, offload_param = None, "none", "none"
    config_kind = None
    config = ZeroConfig(offload_optimizer="none")
    if args.config is not None:
        config, config_kind = load_config_file(args.config, args.hidden_size)
        stage = config.stage
        offload_optimizer, offload_param = config.offload_optimizer, config.offload_param
    if args.stage is not None:
        stage = args.stage
    budgets_given = any(
        b is not None for b in (args.device_budget, args.host_budget, args.nvme_budget)
    )
    if stage is None and not (budgets_given or args.model):
        raise UsageError("--stage is required unless --config, --model or a budget is given")
    offload_optimizer = args.offload_optimizer or offload_optimizer
    offload_param = args.offload_param or offload_param
    one = _Estimator(args, config)
    if stage is None or budgets_given:
        return _estimate_choices_run(args, one, config_kind)
    result = one(stage, offload_optimizer, offload_param)
    inputs = {
        "params": args.params if one.model_info is None else one.model_info.num_params,
        "replicas": args.replicas,
        "stage": stage,
        "offload_optimizer": offload_optimizer,
        "offload_param": offload_param,
        "precision": one.precision if one.model_info is None else one.model_info.precision,
        "optimizer": one.optimizer if one.model_info is None else one.model_info.optimizer,
        "accounting": args.accounting,
        "config": args.config,
        "config_kind": config_kind,
    }
    if args.model is not None:
        inputs["model"] = args.model
    if args.json:
        out = {**result.to_dict(), "inputs": inputs}
        if one.model_info is not None:
            out["model"] = {k: v for k, v in one.model_info.to_dict().items() if k != "tiers"}
        print(json.dumps(out, indent=2))
        return 0
    source = {"sc20": "ZeRO paper, SC20, sec. 5.1", "sc21": "ZeRO-Infinity, SC21, sec. 3"}
    print(
        f"Memory per replica ({source[args.accounting]}): Ψ={inputs['params']:,} params, "
        f"N_d={args.replicas}, stage {stage}, {inputs['precision']} precision, "
        f"{inputs['optimizer']}"
    )
    print(f"offload: optimizer={offload_optimizer}, param={offload_param}")
    _print_model_line(one)
    print()
    rows = [("term", "formula", "tier", "bytes", "human")]
    for name, term in result.breakdown.items():
        divisor = f" / {term['divisor']}" if term["divisor"] > 1 else ""
        formula = (
            "" if name in ("working_set", "row_cache") else f"{term['bytes_per_param']}Ψ{divisor}"
        )
        rows.append(
            (
                _TERM_LABELS.get(name, name),
                formula,
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
    _print_rows(rows, right=2)
    return 0


def _print_model_line(one: _Estimator) -> None:
    info = one.model_info
    if info is None:
        return
    print(
        f"model {one.args.model}: largest unit {info.largest_block_name!r} "
        f"{info.largest_block_params:,} params; compute {info.compute_bytes} B/element; "
        "weights not allocated (keras.StatelessScope)"
    )


def _estimate_choices_run(
    args: argparse.Namespace, one: _Estimator, config_kind: str | None
) -> int:
    budgets = Budgets(args.device_budget, args.host_budget, args.nvme_budget, args.local_replicas)
    rows = estimate_choices(one, budgets)
    best = smallest_fit(rows)
    if args.json:
        out = {
            "choices": rows,
            "smallest_fit": best,
            "budgets": dataclasses.asdict(budgets),
            "accounting": args.accounting,
            "config_kind": config_kind,
        }
        if one.model_info is not None:
            out["model"] = {k: v for k, v in one.model_info.to_dict().items() if k != "tiers"}
        print(json.dumps(out, indent=2))
        return 0
    params = args.params if one.model_info is None else one.model_info.num_params
    print(
        f"Memory per replica for every choice ({args.accounting}): Ψ={params:,} params, "
        f"N_d={args.replicas}"
    )
    _print_model_line(one)
    print(
        "budgets: "
        + ", ".join(
            f"{tier} {format_bytes(b) if b is not None else 'unlimited'}"
            for tier, b in (
                ("device", budgets.device_bytes),
                ("host", budgets.host_bytes),
                ("nvme", budgets.nvme_bytes),
            )
        )
        + f" (host/NVMe per process of {budgets.local_replicas} replica(s))"
    )
    print()
    table = [("stage", "offload opt", "offload param", "device", "host", "nvme", "fits")]
    for row in rows:
        short = ", ".join(f"{t} -{format_bytes(b)}" for t, b in row["shortfall"].items())
        table.append(
            (
                str(row["stage"]),
                row["offload_optimizer"],
                row["offload_param"],
                format_bytes(row["device_bytes"]),
                format_bytes(row["host_bytes"]),
                format_bytes(row["nvme_bytes"]),
                "yes" if row["fits"] else f"no ({short})" if short else "no",
            )
        )
    _print_rows(table, right=0)
    print()
    if best is None:
        print("nothing fits the budgets")
    else:
        print(
            f"smallest that fits: stage {best['stage']}, offload_optimizer="
            f"{best['offload_optimizer']}, offload_param={best['offload_param']}"
        )
    return 0


register(
    Command(
        name="estimate",
        help="bytes per replica on each tier (ZeRO SC20 / ZeRO-Infinity SC21 formulas)",
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
    if not os.path.exists(args.path):
        raise UsageError(f"{args.path!r} does not exist")
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
