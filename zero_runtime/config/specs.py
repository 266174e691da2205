"""Per-key specification: one record per ZeroConfig key (kind, unit, bounds, choices)
drives the validation of each value and its error message.

Kinds: "int", "float", "bool", "choice", "path". Units are as in the vocabulary of
:mod:`zero_runtime.config` (*bytes*, *elements*, *steps*, *seconds*).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from zero_runtime.config.errors import ZeroConfigError

OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")
"""Accepted values of ``offload_optimizer`` and ``offload_param``."""

KIB = 1024
MIB = 1024 * 1024
GIB = 1024 * MIB

MIN_PAGE_SIZE_BYTES = 64 * KIB
"""Smallest accepted ``page_size_bytes`` (the paged pool's minimum page)."""
MAX_PAGE_SIZE_BYTES = GIB
"""Largest accepted ``page_size_bytes``: one page of 1 GiB already makes every tier's
budget a multiple of a gigabyte; larger pages only make tiers that cannot hold one page."""


@dataclasses.dataclass(frozen=True)
class KeySpec:
    kind: str
    unit: str
    minimum: float | None = None  # inclusive for "int", exclusive for "float"
    maximum: float | None = None  # inclusive
    choices: tuple[str, ...] = ()
    nullable: bool = False  # None accepted (meaning documented per key)
    power_of_two: bool = False
    auto: bool = False  # the string "auto" accepted (meaning documented per key)

    def accepted(self) -> str:
        """Human-readable description of the accepted values, used in error messages."""
        if self.kind == "choice":
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.kind == "bool":
            text = "a bool (true or false)"
        elif self.kind == "path":
            text = "a non-empty string path"
        else:
            noun = "an int" if self.kind == "int" else "a finite number"
            if self.power_of_two:
                noun = "a power-of-two int"
            lo, hi = self.minimum, self.maximum
            if lo is not None and hi is not None:
                left = "(" if self.kind == "float" else "["  # a float's minimum is exclusive
                text = f"{noun} in {left}{_fmt(lo)}, {_fmt(hi)}]"
            elif lo is not None:
                op = ">" if self.kind == "float" else ">="
                text = f"{noun} {op} {_fmt(lo)}"
            else:
                text = noun
            if self.unit:
                text += f" ({self.unit})"
        if self.nullable:
            text += ", or None"
        if self.auto:
            text += ", or 'auto'"
        return text


def _fmt(x: float) -> str:
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return f"{x:_}" if isinstance(x, int) and abs(x) >= 100_000 else str(x)


COUNT_MAX = None  # no static upper bound on element counts; tunables declare their own

SPECS: Mapping[str, KeySpec] = MappingProxyType(
    {
        "stage": KeySpec("int", "", 0, 3),
        "offload_optimizer": KeySpec("choice", "", choices=OFFLOAD_DEVICES),
        "offload_param": KeySpec("choice", "", choices=OFFLOAD_DEVICES),
        "nvme_path": KeySpec("path", "", nullable=True),
        "page_size_bytes": KeySpec(
            "int", "bytes", MIN_PAGE_SIZE_BYTES, MAX_PAGE_SIZE_BYTES, power_of_two=True
        ),
        "device_budget_bytes": KeySpec("int", "bytes", 1, None, nullable=True, auto=True),
        "host_budget_bytes": KeySpec("int", "bytes", 1, None, nullable=True),
        "nvme_budget_bytes": KeySpec("int", "bytes", 1, None, nullable=True),
        "persistence_threshold": KeySpec("int", "elements", 0, COUNT_MAX),
        "prefetch_bucket_size": KeySpec("int", "elements", 0, COUNT_MAX),
        "max_live_parameters": KeySpec("int", "elements", 1, COUNT_MAX),
        "max_reuse_distance": KeySpec("int", "elements", 0, COUNT_MAX),
        "reduce_bucket_size": KeySpec("int", "elements", 1, COUNT_MAX),
        "allgather_bucket_size": KeySpec("int", "elements", 1, COUNT_MAX),
        "overlap_comm": KeySpec("bool", ""),
        "gradient_accumulation_steps": KeySpec("int", "micro-steps", 1, None),
        "sub_group_size": KeySpec("int", "elements", 1, COUNT_MAX),
        "pin_memory": KeySpec("bool", ""),
        "telemetry_every_n_steps": KeySpec("int", "steps", 1, None),
        "mirrored_fallback_bytes": KeySpec("int", "bytes", 0, None),
        "collective_timeout_seconds": KeySpec("float", "seconds", 0.0, None),
        "embedding_row_paging_threshold": KeySpec("int", "elements", 1, COUNT_MAX),
        "offload_optimizer_ratio": KeySpec("float", "", 0.0, 1.0),
        "headroom_fraction": KeySpec("float", "", 0.0, 0.9),
        "tile_size": KeySpec("int", "elements", 1, COUNT_MAX, nullable=True, auto=True),
        "activation_checkpointing": KeySpec("bool", ""),
        "optimizer_host_budget_bytes": KeySpec("int", "bytes", 1, None, nullable=True),
    }
)


def _is_numpy_bool(value: Any) -> bool:
    """True for numpy.bool_ (named ``bool`` in numpy 2), without importing numpy."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")


def check_value(key: str, value: Any, spec: KeySpec) -> Any:
    """Validate one value against its spec; return it normalised (int/float/str/bool/None).

    Raises:
        ZeroConfigError: naming ``key``, ``value`` and ``spec.accepted()``.
    """
    accepted = spec.accepted()

    def fail(reason: str = "") -> ZeroConfigError:
        msg = f"{key}={value!r} is invalid: expected {accepted}"
        if reason:
            msg += f"; {reason}"
        return ZeroConfigError(msg, key=key, value=value, accepted=accepted)

    if value is None:
        if spec.nullable:
            return None
        raise fail("got None")
    if spec.auto and isinstance(value, str) and value == "auto":
        return value

    if spec.kind == "bool":
        if isinstance(value, bool):
            return value
        # numpy's bool is not a Python bool; accept it, but nothing else (not 0/1, "true").
        if _is_numpy_bool(value):
            return bool(value)
        raise fail(f"got {type(value).__name__}")

    if spec.kind == "choice":
        if not isinstance(value, str):
            raise fail(f"got {type(value).__name__}")
        if value not in spec.choices:
            raise fail()
        return value

    if spec.kind == "path":
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise fail(f"got {type(value).__name__}")
        if not value.strip():
            raise fail("got an empty string")
        return value

    # Numbers. bool is a subclass of int in Python; it is never a number here.
    if isinstance(value, bool) or _is_numpy_bool(value):
        raise fail("got bool")
    if spec.kind == "int":
        if not isinstance(value, numbers.Integral):
            if isinstance(value, numbers.Real) and not math.isfinite(float(value)):
                raise fail(f"got non-finite {type(value).__name__}")
            raise fail(f"got {type(value).__name__}")
        value = int(value)
    else:  # float
        if not isinstance(value, numbers.Real):
            raise fail(f"got {type(value).__name__}")
        value = float(value)
        if not math.isfinite(value):
            raise fail("must be finite (not NaN or inf)")
    if spec.minimum is not None:
        too_small = value <= spec.minimum if spec.kind == "float" else value < spec.minimum
        if too_small:
            raise fail()
    if spec.maximum is not None and value > spec.maximum:
        raise fail()
    if spec.power_of_two and value & (value - 1) != 0:
        raise fail("not a power of two")
    return value


def suggest(key: str, known: list[str] | tuple[str, ...]) -> str:
    """``"; did you mean 'x'?"`` for the nearest known key, or ``""`` if none is close."""
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def unknown_key_error(key: Any, known: tuple[str, ...]) -> ZeroConfigError:
    hint = suggest(key, known) if isinstance(key, str) else ""
    if not hint:
        hint = "; known keys: " + ", ".join(known)
    return ZeroConfigError(
        f"unknown key {key!r}{hint}", key=str(key), value=None, accepted=", ".join(known)
    )
