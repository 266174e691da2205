"""Argument types of the ``zero-runtime`` subcommands (element and byte counts), the byte
formatter of their tables, and loading a ZeroConfig or DeepSpeed config file."""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from decimal import Decimal, InvalidOperation

from zero_runtime.cli.commands import PROG, UsageError
from zero_runtime.config import (
    DeepSpeedKeyIgnoredWarning,
    ZeroConfig,
    ZeroConfigError,
    looks_like_deepspeed,
)

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
    return _scaled_whole(
        text,
        number,
        _SUFFIXES.get(suffix),
        "count",
        "a whole number such as 7500000000, 7.5e9 or 7.5B",
        "a whole number >= 1",
    )


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    """``int(text)``, which must be >= ``low``; else ``argparse.ArgumentTypeError``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid int {text!r}: expected an int >= {low}"
        ) from None
    if value < low:
        raise argparse.ArgumentTypeError(f"invalid value {value}: expected an int >= {low}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}: expected a number > 0")
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
    return _scaled_whole(
        text,
        number,
        _BYTE_SUFFIXES.get(suffix),
        "byte count",
        "e.g. 34359738368, 32GiB, 32GB or 3.2e10",
        "a whole number of bytes >= 1",
    )


def _scaled_whole(
    text: str, number: str, multiplier: int | None, noun: str, examples: str, whole: str
) -> int:
    """``number`` (decimal text) times ``multiplier`` (its suffix's; None: an unknown
    suffix), which must be a whole number >= 1.

    Raises:
        argparse.ArgumentTypeError: ``"invalid {noun} {text!r}: expected {examples}"`` for
            text that is not a number or an unknown suffix, ``... expected {whole}`` for a
            value that is not a whole number >= 1.
    """
    try:
        if multiplier is None:
            raise InvalidOperation
        value = Decimal(number) * multiplier
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"invalid {noun} {text!r}: expected {examples}") from None
    if not value.is_finite() or value != value.to_integral_value() or value < 1:
        raise argparse.ArgumentTypeError(f"invalid {noun} {text!r}: expected {whole}")
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
