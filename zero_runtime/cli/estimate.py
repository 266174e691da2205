"""``zero-runtime estimate``: bytes per replica on each tier for one stage/offload choice
(a table of terms), or for every choice against budgets (a table of the 18 choices and
the smallest that fits); from a parameter count or a model factory (``--model``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from zero_runtime.cli.arguments import (
    format_bytes,
    load_config_file,
    parse_bytes,
    parse_count,
    positive_int,
)
from zero_runtime.cli.commands import Command, UsageError
from zero_runtime.config import OFFLOAD_DEVICES, ZeroConfig
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


COMMAND = Command(
    name="estimate",
    help="bytes per replica on each tier (ZeRO SC20 / ZeRO-Infinity SC21 formulas)",
    add_arguments=_estimate_add_arguments,
    run=_estimate_run,
)
"""The subcommand (registered by :mod:`zero_runtime.cli`)."""
