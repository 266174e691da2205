"""ZeroConfig: every knob of the runtime in one frozen, validated dataclass.

Vocabulary (other modules cite these names):

- *key*: the name of one ZeroConfig field, e.g. ``"stage"``; the same string is used in
  dicts, JSON files, the live-tuning control file and the docs (docs/config.md).
- *elements*: a count of scalar parameter values (not bytes); bucket sizes and thresholds
  are in elements, as in DeepSpeed's ``zero_optimization`` section.
- *bytes*: budgets and page sizes are plain byte counts (1 MiB = 1048576 bytes).
- *tunable*: a key that may be changed on a running job at a step boundary, through the
  control file. Only the keys in ``TUNABLE_KEYS`` are tunable; each has bounds.

Errors: every invalid value raises ``ZeroConfigError`` (a ``ValueError``) whose message names
the key, the bad value and what is accepted, e.g.
``"stage=4 is invalid: expected an int in [0, 3]"``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import psutil

__all__ = [
    "OFFLOAD_DEVICES",
    "TUNABLE_KEYS",
    "DeepSpeedAutoResolvedWarning",
    "DeepSpeedKeyIgnoredWarning",
    "Tunable",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroConfigFileNotFoundError",
    "physical_memory_bytes",
    "validate_tunable_update",
]

OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")
"""Accepted values of ``offload_optimizer`` and ``offload_param``."""

_KIB = 1024
_MIB = 1024 * 1024
_GIB = 1024 * _MIB

MIN_PAGE_SIZE_BYTES = 64 * _KIB
"""Smallest accepted ``page_size_bytes`` (the paged pool's minimum page)."""
MAX_PAGE_SIZE_BYTES = _GIB
"""Largest accepted ``page_size_bytes``: one page of 1 GiB already makes every tier's
budget a multiple of a gigabyte; larger pages only make tiers that cannot hold one page."""


class ZeroConfigError(ValueError):
    """An invalid configuration value, key or combination of values.

    Attributes:
        key: the offending key (str), or None when the error is not about one key
            (e.g. the input is not a mapping, or invalid JSON).
        value: the offending value (any type), or None.
        accepted: human-readable description of what is accepted (str), or None.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        value: Any = None,
        accepted: str | None = None,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.value = value
        self.accepted = accepted


class ZeroConfigFileNotFoundError(ZeroConfigError, FileNotFoundError):
    """A config given as a path (not JSON text) where no file exists.

    Both a ``ZeroConfigError`` (a ``ValueError``: bad input) and a ``FileNotFoundError``
    (what ``open`` would raise), so either ``except`` catches it. ``value`` is the path.
    """


class DeepSpeedKeyIgnoredWarning(UserWarning):
    """Warned by ``ZeroConfig.from_deepspeed`` once per DeepSpeed key that has no counterpart
    here (and for ``"auto"`` values resolved to our default)."""


# --------------------------------------------------------------------------------------
# Per-key specification: one record per key drives validation and the error messages.
# Kinds: "int", "float", "bool", "choice", "path".
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spec:
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


_COUNT_MAX = None  # no static upper bound on element counts; tunables declare their own

_SPECS: Mapping[str, _Spec] = MappingProxyType(
    {
        "stage": _Spec("int", "", 0, 3),
        "offload_optimizer": _Spec("choice", "", choices=OFFLOAD_DEVICES),
        "offload_param": _Spec("choice", "", choices=OFFLOAD_DEVICES),
        "nvme_path": _Spec("path", "", nullable=True),
        "page_size_bytes": _Spec(
            "int", "bytes", MIN_PAGE_SIZE_BYTES, MAX_PAGE_SIZE_BYTES, power_of_two=True
        ),
        "device_budget_bytes": _Spec("int", "bytes", 1, None, nullable=True, auto=True),
        "host_budget_bytes": _Spec("int", "bytes", 1, None, nullable=True),
        "nvme_budget_bytes": _Spec("int", "bytes", 1, None, nullable=True),
        "persistence_threshold": _Spec("int", "elements", 0, _COUNT_MAX),
        "prefetch_bucket_size": _Spec("int", "elements", 0, _COUNT_MAX),
        "max_live_parameters": _Spec("int", "elements", 1, _COUNT_MAX),
        "max_reuse_distance": _Spec("int", "elements", 0, _COUNT_MAX),
        "reduce_bucket_size": _Spec("int", "elements", 1, _COUNT_MAX),
        "allgather_bucket_size": _Spec("int", "elements", 1, _COUNT_MAX),
        "overlap_comm": _Spec("bool", ""),
        "gradient_accumulation_steps": _Spec("int", "micro-steps", 1, None),
        "sub_group_size": _Spec("int", "elements", 1, _COUNT_MAX),
        "pin_memory": _Spec("bool", ""),
        "telemetry_every_n_steps": _Spec("int", "steps", 1, None),
        "mirrored_fallback_bytes": _Spec("int", "bytes", 0, None),
        "collective_timeout_seconds": _Spec("float", "seconds", 0.0, None),
        "embedding_row_paging_threshold": _Spec("int", "elements", 1, _COUNT_MAX),
        "offload_optimizer_ratio": _Spec("float", "", 0.0, 1.0),
        "headroom_fraction": _Spec("float", "", 0.0, 0.9),
    }
)


def physical_memory_bytes() -> int:
    """This machine's physical memory, bytes (``psutil.virtual_memory().total``): the
    largest accepted ``host_budget_bytes``."""
    return int(psutil.virtual_memory().total)


def _is_numpy_bool(value: Any) -> bool:
    """True for numpy.bool_ (named ``bool`` in numpy 2), without importing numpy."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")


def _check_value(key: str, value: Any, spec: _Spec) -> Any:
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


def _suggest(key: str, known: list[str] | tuple[str, ...]) -> str:
    """``"; did you mean 'x'?"`` for the nearest known key, or ``""`` if none is close."""
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _unknown_key_error(key: Any, known: tuple[str, ...]) -> ZeroConfigError:
    hint = _suggest(key, known) if isinstance(key, str) else ""
    if not hint:
        hint = "; known keys: " + ", ".join(known)
    return ZeroConfigError(
        f"unknown key {key!r}{hint}", key=str(key), value=None, accepted=", ".join(known)
    )


# --------------------------------------------------------------------------------------
# ZeroConfig
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """Every knob of the ZeRO-Infinity runtime; immutable and validated on construction.

    Units: *bytes* are byte counts; *elements* are counts of scalar parameter values
    (independent of dtype), as in DeepSpeed's ``zero_optimization`` section.

    Attributes:
        stage: ZeRO stage, int in [0, 3]. Default 1. 0 = plain data parallelism;
            1 = partition optimizer states; 2 = also gradients; 3 = also parameters
            (ZeRO paper, SC20, section 5.1).
        offload_optimizer: where each replica's optimizer-state shard lives and is updated:
            'none' (device), 'cpu' (host memory) or 'nvme' (files under ``nvme_path``).
            Default 'cpu'.
        offload_param: where each replica's parameter shard lives between uses: 'none',
            'cpu' or 'nvme'. Default 'none'. 'cpu' and 'nvme' require ``stage == 3``.
        nvme_path: directory for the NVMe tier's files, str or None. Default None. Required
            when either offload is 'nvme'.
        page_size_bytes: size of one page of the paged buffer pool, bytes. Default 4 MiB
            (4194304). Must be a power of two in [64 KiB, 1 GiB] ([65536, 1073741824]).
        device_budget_bytes: bytes the runtime may place on the device tier, int >= 1, or
            None (default) meaning the tier's physical size. Must be >= ``page_size_bytes``.
            Or ``'auto'``: the runtime holds its own headroom, adjusting the budget (and,
            near an OOM, prefetch and reuse distance) to keep the measured in-step peak
            ``headroom_fraction`` below the device's real capacity
            (zero_runtime/runtime/headroom.py); the strategy resolves it to an int at start.
        host_budget_bytes: bytes the runtime may place in host memory, int >= 1, or None
            (default) meaning physical memory. Must be >= ``page_size_bytes`` and at most
            this machine's physical memory (:func:`physical_memory_bytes`), at every stage.
        nvme_budget_bytes: bytes the runtime may write under ``nvme_path``, int >= 1, or None
            (default) meaning unbounded (the file system's free space).
            Must be >= ``page_size_bytes``.
        persistence_threshold: parameters with fewer elements than this stay replicated
            (not partitioned), elements, int >= 0. Default 100_000 (DeepSpeed's
            ``stage3_param_persistence_threshold`` default 1e5).
        prefetch_bucket_size: elements of parameters fetched ahead of use, int >= 0; 0
            disables prefetch. Default 50_000_000 (DeepSpeed's 5e7).
        max_live_parameters: upper bound on gathered (unsharded) parameter elements resident
            per replica at once, int >= 1. Default 1_000_000_000 (DeepSpeed's 1e9).
        max_reuse_distance: a released parameter is kept gathered if it will be reused within
            this many elements of other parameters' use, int >= 0. Default 1_000_000_000.
        reduce_bucket_size: elements per gradient reduce(-scatter) bucket, int >= 1.
            Default 500_000_000 (DeepSpeed's 5e8).
        allgather_bucket_size: elements per parameter all-gather bucket, int >= 1.
            Default 500_000_000 (DeepSpeed's 5e8).
        overlap_comm: overlap gradient reduction with the backward pass, bool. Default True.
        gradient_accumulation_steps: micro-steps accumulated locally before one reduction
            and optimizer step, int >= 1. Default 1.
        sub_group_size: elements per optimizer-step tile (the unit the offloaded optimizer
            updates and swaps at once), int >= 1. Default 1_000_000_000 (DeepSpeed's 1e9).
        pin_memory: page-lock host buffers of offloaded states, bool. Default False.
        telemetry_every_n_steps: write a StepStats summary every N steps, int >= 1.
            Default 1.
        mirrored_fallback_bytes: when the model states' total bytes are below this, the
            strategy runs as plain mirrored data parallelism, bytes, int >= 0. Default 0
            (fallback disabled).
        collective_timeout_seconds: a collective that does not finish within this many
            seconds fails, float > 0 (finite). Default 60.0. Ints are accepted and stored
            as float.
        embedding_row_paging_threshold: at stage 3, a ``keras.layers.Embedding`` whose
            table has at least this many elements is row-paged (only the rows a step looks
            up move; hot rows stay on the device tier, cold ones on the offload tier; lazy
            sparse updates, see zero_runtime/stage3/embedding.py), elements, int >= 1.
            Default 10_000_000 (a 40 MB float32 table; smaller tables are gathered whole).
        offload_optimizer_ratio: fraction of each replica's optimizer-state shard kept and
            updated on the host when ``offload_optimizer='cpu'``, float in (0, 1]; the rest
            stays on the device and is updated there concurrently (partial offload,
            DeepSpeed's ``offload_optimizer.ratio``, ZeRO-Offload++ "Twin-Flow";
            zero_runtime/optim/split_state.py). Default 1.0 (all on the host). Below 1.0
            it requires ``offload_optimizer='cpu'`` and stage 1 or 2.
        headroom_fraction: with ``device_budget_bytes='auto'``, the fraction of the
            device's real capacity the runtime keeps free below its measured in-step
            peak, float in (0, 0.9]. Default 0.1. Ignored otherwise.

    Raises:
        ZeroConfigError: on construction, for a value of the wrong type (bool is never an
            int and an int never a bool), out of range, not one of the choices, or a
            violated cross-field rule (offload_param needs stage 3; 'nvme' needs nvme_path;
            budgets at least one page; host_budget_bytes at most physical memory).
    """

    stage: int = 1
    offload_optimizer: str = "cpu"
    offload_param: str = "none"
    nvme_path: str | None = None
    page_size_bytes: int = 4 * _MIB
    device_budget_bytes: int | str | None = None
    host_budget_bytes: int | None = None
    nvme_budget_bytes: int | None = None
    persistence_threshold: int = 100_000
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    gradient_accumulation_steps: int = 1
    sub_group_size: int = 1_000_000_000
    pin_memory: bool = False
    telemetry_every_n_steps: int = 1
    mirrored_fallback_bytes: int = 0
    collective_timeout_seconds: float = 60.0
    embedding_row_paging_threshold: int = 10_000_000
    offload_optimizer_ratio: float = 1.0
    headroom_fraction: float = 0.1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = _check_value(f.name, getattr(self, f.name), _SPECS[f.name])
            object.__setattr__(self, f.name, value)
        self._check_cross_fields()

    def _check_cross_fields(self) -> None:
        if self.offload_param != "none" and self.stage != 3:
            raise ZeroConfigError(
                f"offload_param={self.offload_param!r} is invalid with stage={self.stage}: "
                "parameter offload requires stage 3 (set stage=3 or offload_param='none')",
                key="offload_param",
                value=self.offload_param,
                accepted="'none' unless stage == 3",
            )
        if self.offload_optimizer_ratio < 1.0 and (
            self.offload_optimizer != "cpu" or self.stage not in (1, 2)
        ):
            raise ZeroConfigError(
                f"offload_optimizer_ratio={self.offload_optimizer_ratio!r} is invalid with "
                f"offload_optimizer={self.offload_optimizer!r} and stage={self.stage}: partial "
                "optimizer offload splits the states between the device and the host, so it "
                "needs offload_optimizer='cpu' at stage 1 or 2 (or ratio 1.0)",
                key="offload_optimizer_ratio",
                value=self.offload_optimizer_ratio,
                accepted="1.0, or a float in (0, 1) with offload_optimizer='cpu' and stage 1 or 2",
            )
        for key in ("offload_optimizer", "offload_param"):
            if getattr(self, key) == "nvme" and self.nvme_path is None:
                raise ZeroConfigError(
                    f"{key}='nvme' requires nvme_path (a directory for the NVMe tier's "
                    "files); got nvme_path=None",
                    key="nvme_path",
                    value=None,
                    accepted="a non-empty string path when an offload is 'nvme'",
                )
        for key in ("device_budget_bytes", "host_budget_bytes", "nvme_budget_bytes"):
            budget = getattr(self, key)
            if budget is not None and budget != "auto" and budget < self.page_size_bytes:
                raise ZeroConfigError(
                    f"{key}={budget!r} is invalid: expected None or an int >= "
                    f"page_size_bytes ({self.page_size_bytes}) bytes; a tier must hold at "
                    "least one page",
                    key=key,
                    value=budget,
                    accepted=f"None or an int >= {self.page_size_bytes} (bytes)",
                )
        physical = physical_memory_bytes()
        if self.host_budget_bytes is not None and self.host_budget_bytes > physical:
            accepted = f"None or an int in [{self.page_size_bytes}, {physical}] (bytes)"
            raise ZeroConfigError(
                f"host_budget_bytes={self.host_budget_bytes!r} is invalid: expected "
                f"{accepted}; it exceeds this machine's physical memory, {physical} bytes "
                f"({physical / _GIB:.1f} GiB)",
                key="host_budget_bytes",
                value=self.host_budget_bytes,
                accepted=accepted,
            )

    # -- conversions ---------------------------------------------------------------

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """All key names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every key (JSON-serialisable: int, float, str, bool, None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ZeroConfig:
        """Build a validated config from a mapping; missing keys take their defaults.

        Raises:
            ZeroConfigError: ``d`` is not a mapping; an unknown key (the message suggests
                the nearest known key, e.g. "unknown key 'offload_optimiser'; did you mean
                'offload_optimizer'?"); any invalid value.
        """
        if not isinstance(d, Mapping):
            raise ZeroConfigError(
                f"config must be a mapping of key -> value, got {type(d).__name__}"
            )
        known = cls.keys()
        for key in d:
            if key not in known:
                raise _unknown_key_error(key, known)
        return cls(**d)

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text of ``to_dict()``; ``from_json(to_json())`` equals ``self``."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, path_or_str: str | os.PathLike[str]) -> ZeroConfig:
        """Load from JSON text (a string starting with ``{``) or from a JSON file path.

        Raises:
            ZeroConfigError: invalid JSON, not an object (e.g. ``"[1, 2]"``), unknown keys,
                invalid values.
            ZeroConfigFileNotFoundError: a path where no file exists (also a
                ``FileNotFoundError``); the message names the path and what is accepted.
            OSError: an existing file cannot be read.
        """
        return cls.from_dict(_load_json_object(path_or_str))

    def replace(self, **changes: Any) -> ZeroConfig:
        """A validated copy with ``changes`` applied.

        Raises:
            ZeroConfigError: unknown key (with a suggestion) or invalid resulting config.
        """
        return type(self).from_dict({**self.to_dict(), **changes})

    @classmethod
    def from_deepspeed(
        cls,
        ds_config: Mapping[str, Any] | str | os.PathLike[str],
        *,
        hidden_size: int | None = None,
    ) -> ZeroConfig:
        """Build from a DeepSpeed config (dict, JSON text or JSON file path).

        See ``zero_runtime.config._from_deepspeed`` and docs/config.md for the key mapping.
        Keys with no counterpart are ignored with one ``DeepSpeedKeyIgnoredWarning`` each;
        keys DeepSpeed itself rejects (and misspelt sections) raise.

        Args:
            ds_config: the DeepSpeed config.
            hidden_size: the model's hidden size (elements, int >= 1) to resolve the
                ``"auto"`` bucket sizes as the Hugging Face Trainer does; None (default)
                resolves them to our defaults with a warning.

        Raises:
            ZeroConfigError: invalid values, an ``"auto"`` value that has no sensible
                default here, JSON text that is not an object (e.g. ``"[1, 2]"``), or an
                argument of another type.
            ZeroConfigFileNotFoundError: a path where no file exists (also a
                ``FileNotFoundError``); the message names it and what is accepted.
        """
        return _from_deepspeed(cls, ds_config, hidden_size)


def _load_json_object(path_or_str: str | os.PathLike[str], what: str = "config") -> dict[str, Any]:
    """Parse JSON text or a JSON file into a dict.

    A string is JSON text when it starts with ``{`` or ``[``, or when it parses as JSON and
    names no existing file (``"null"``, ``"3"``); otherwise it is a path.

    Args:
        path_or_str: JSON text, or the path of a JSON file.
        what: what the input is, for messages (``"config"``, ``"DeepSpeed config"``).

    Raises:
        ZeroConfigError: invalid JSON or a top-level value that is not an object.
        ZeroConfigFileNotFoundError: a path (not JSON text) where no file exists; it is
            both a ``ZeroConfigError`` and a ``FileNotFoundError``.
        OSError: an existing file that cannot be read.
    """
    accepted = (
        "a JSON object as text (e.g. '{\"stage\": 2}') or the path of a JSON file holding one"
    )
    text = _json_text(path_or_str)
    if text is not None:
        source = "<string>"
    else:
        source = os.fspath(path_or_str)
        if not os.path.exists(source):
            raise ZeroConfigFileNotFoundError(
                f"{what} {_shorten(source)} is neither JSON text nor the path of an existing "
                f"file; expected {accepted}",
                value=source,
                accepted=accepted,
            )
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ZeroConfigError(
            f"invalid JSON in {source}: {e}; expected {accepted}", value=text, accepted=accepted
        ) from None
    if not isinstance(obj, dict):
        given = f"JSON text {_shorten(text)}" if source == "<string>" else f"file {source!r}"
        raise ZeroConfigError(
            f"JSON in {source} must be an object, got {type(obj).__name__} ({what} given: "
            f"{given}); expected {accepted}",
            value=obj,
            accepted=accepted,
        )
    return obj


def _json_text(path_or_str: str | os.PathLike[str]) -> str | None:
    """``path_or_str`` itself when it is JSON text rather than a path, else None."""
    if not isinstance(path_or_str, str):
        return None
    stripped = path_or_str.strip()
    if stripped.startswith(("{", "[")):
        return path_or_str
    if not stripped or os.path.exists(path_or_str):
        return None
    try:
        json.loads(stripped)
    except json.JSONDecodeError:
        return None
    return path_or_str


def _shorten(text: str, limit: int = 80) -> str:
    """``repr(text)``, cut to about ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


# --------------------------------------------------------------------------------------
# Live tuning
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tunable:
    """A key that may be changed on a running job at a step boundary.

    Attributes:
        key: the ZeroConfig key.
        unit: unit of the value ("bytes", "elements", "steps").
        minimum: smallest accepted value, inclusive (int).
        maximum: largest accepted value, inclusive (int).
        description: one line for the UI.
        takes_effect: when an applied change acts on the running job (one line for the
            UI): ``"next step"``, or ``"rebuild"`` for a key only read when the model or
            its pool is built (an applied change is recorded but changes nothing until the
            job is rebuilt, e.g. restarted from a checkpoint), with the stages it acts at.
        acts_when: ``(config key, value)`` pairs a run's config must all match for an
            applied change to act on it (empty: every run); see :meth:`acts_in`.

    Values are ints (never bool, never float, never None); the resulting config must also
    pass ZeroConfig's own validation (e.g. a budget of at least one page).
    """

    key: str
    unit: str
    minimum: int
    maximum: int
    description: str
    takes_effect: str = "next step"
    acts_when: tuple[tuple[str, Any], ...] = ()

    def acts_in(self, config: Mapping[str, Any] | None) -> bool | None:
        """Whether an applied change of this key acts on a running job started with
        ``config`` (a ``ZeroConfig.to_dict()``): False for a rebuild key or a config that
        does not match :attr:`acts_when`; None when ``config`` is unknown and it matters."""
        if self.takes_effect.startswith("rebuild"):
            return False
        if not self.acts_when:
            return True
        if config is None:
            return None
        return all(config.get(k) == v for k, v in self.acts_when)

    def check(self, value: Any) -> int:
        """Return ``value`` as int if it is within bounds.

        Raises:
            ZeroConfigError: wrong type (bool, float, str, None...), NaN/inf, out of bounds.
        """
        spec = _Spec("int", self.unit, self.minimum, self.maximum)
        if isinstance(value, float) and not math.isfinite(value):
            accepted = spec.accepted()
            raise ZeroConfigError(
                f"{self.key}={value!r} is invalid: expected {accepted}; "
                "must be finite (not NaN or inf)",
                key=self.key,
                value=value,
                accepted=accepted,
            )
        return _check_value(self.key, value, spec)


_PIB = 1 << 50
_MAX_ELEMENTS = 10**15  # a quadrillion elements: far above any model, far below overflow

TUNABLE_KEYS: Mapping[str, Tunable] = MappingProxyType(
    {
        t.key: t
        for t in (
            Tunable(
                "device_budget_bytes",
                "bytes",
                64 * _KIB,
                _PIB,
                "bytes the runtime may place on the device tier",
                "next step (budget check; stage 3: device tier capacity, pages move)",
            ),
            Tunable(
                "host_budget_bytes",
                "bytes",
                64 * _KIB,
                _PIB,
                "bytes the runtime may place in host memory",
                "next step (budget check); the pool's host tier: rebuild",
            ),
            Tunable(
                "persistence_threshold",
                "elements",
                0,
                _MAX_ELEMENTS,
                "parameters with fewer elements stay replicated",
                "rebuild (stage 3's traced plan)",
            ),
            Tunable(
                "max_live_parameters",
                "elements",
                1,
                _MAX_ELEMENTS,
                "max gathered parameter elements resident per replica",
                "rebuild (stage 3's traced plan)",
            ),
            Tunable(
                "max_reuse_distance",
                "elements",
                0,
                _MAX_ELEMENTS,
                "keep a parameter gathered if reused within this many elements",
                "rebuild (stage 3's traced plan)",
            ),
            Tunable(
                "prefetch_bucket_size",
                "elements",
                0,
                _MAX_ELEMENTS,
                "parameter elements fetched ahead of use (0 disables prefetch)",
                "next step (stage 3 with NVMe: the next prefetch)",
                (("stage", 3), ("offload_param", "nvme")),
            ),
            Tunable(
                "telemetry_every_n_steps",
                "steps",
                1,
                1_000_000,
                "write a StepStats summary every N steps",
                "next step",
            ),
        )
    }
)
"""The keys that may be tuned live, with bounds; the control file may hold only these."""


def validate_tunable_update(current: ZeroConfig, updates: Mapping[str, Any]) -> ZeroConfig:
    """Validate a live-tuning update against ``TUNABLE_KEYS`` and apply it to ``current``.

    Args:
        current: the running job's config.
        updates: key -> new value; only keys of ``TUNABLE_KEYS``. May be empty.

    Returns:
        The new validated config (``current`` itself if ``updates`` is empty).

    Raises:
        ZeroConfigError: ``updates`` is not a mapping; an unknown key (with a suggestion);
            a known but non-tunable key; a value of the wrong type, NaN/inf or out of
            bounds; a resulting config that fails ZeroConfig validation.
    """
    if not isinstance(updates, Mapping):
        raise ZeroConfigError(
            f"tunable update must be a mapping of key -> value, got {type(updates).__name__}"
        )
    tunable = tuple(TUNABLE_KEYS)
    checked: dict[str, int] = {}
    for key, value in updates.items():
        if key not in TUNABLE_KEYS:
            if key in ZeroConfig.keys():
                raise ZeroConfigError(
                    f"key {key!r} cannot be tuned live on a running job; tunable keys: "
                    + ", ".join(tunable),
                    key=key,
                    value=value,
                    accepted=", ".join(tunable),
                )
            hint = _suggest(key, tunable) if isinstance(key, str) else ""
            if not hint and isinstance(key, str):
                hint = _suggest(key, ZeroConfig.keys())
            raise ZeroConfigError(
                f"unknown key {key!r}{hint} (tunable keys: " + ", ".join(tunable) + ")",
                key=str(key),
                value=value,
                accepted=", ".join(tunable),
            )
        checked[key] = TUNABLE_KEYS[key].check(value)
    if not checked:
        return current
    return current.replace(**checked)


# --------------------------------------------------------------------------------------
# DeepSpeed import
# --------------------------------------------------------------------------------------


# DeepSpeed ``zero_optimization`` scalar key -> ZeroConfig key. Both the documented
# ``stage3_*`` names and DeepSpeed's own field names (its pydantic aliases) are accepted.
_DS_ZERO_SCALARS: Mapping[str, str] = MappingProxyType(
    {
        "stage3_param_persistence_threshold": "persistence_threshold",
        "param_persistence_threshold": "persistence_threshold",
        "stage3_prefetch_bucket_size": "prefetch_bucket_size",
        "prefetch_bucket_size": "prefetch_bucket_size",
        "stage3_max_live_parameters": "max_live_parameters",
        "max_live_parameters": "max_live_parameters",
        "stage3_max_reuse_distance": "max_reuse_distance",
        "max_reuse_distance": "max_reuse_distance",
        "reduce_bucket_size": "reduce_bucket_size",
        "allgather_bucket_size": "allgather_bucket_size",
        "overlap_comm": "overlap_comm",
        "sub_group_size": "sub_group_size",
    }
)
# Top-level DeepSpeed key -> ZeroConfig key.
_DS_TOP_SCALARS: Mapping[str, str] = MappingProxyType(
    {"gradient_accumulation_steps": "gradient_accumulation_steps"}
)
# Keys whose "auto" has no sensible default here: rejected.
_DS_AUTO_REJECTED = frozenset({"stage", "offload_optimizer", "offload_param", "nvme_path"})

# Every key DeepSpeed's ``DeepSpeedZeroConfig`` accepts (field names and their ``stage3_*``
# aliases), from deepspeed/runtime/zero/config.py (deepspeedai/DeepSpeed edaa7221,
# 2026-08-22). DeepSpeed's model forbids other keys (``extra="forbid"``), and so do we.
_DS_ZERO_KEYS = frozenset(
    {
        "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
        "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size",
        "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint", "offload_param",
        "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
        "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size",
        "stage3_prefetch_bucket_size", "param_persistence_threshold",
        "stage3_param_persistence_threshold", "model_persistence_threshold",
        "stage3_model_persistence_threshold", "max_live_parameters",
        "stage3_max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
        "module_granularity_threshold", "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params",
        "allgather_sequential", "stage3_allgather_sequential",
        "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters",
        "legacy_stage1", "round_robin_gradients", "zero_hpz_partition_size",
        "zero_quantized_weights", "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
        "mics_hierarchical_params_gather", "memory_efficient_linear",
        "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
        "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
    }
)  # fmt: skip
# DeepSpeedZeroOffloadParamConfig / DeepSpeedZeroOffloadOptimizerConfig fields
# (deepspeed/runtime/zero/offload_config.py; ``extra="forbid"`` there too).
_DS_OFFLOAD_KEYS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "offload_param": frozenset(
            {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"}
        ),
        "offload_optimizer": frozenset(
            {
                "device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                "pipeline_write", "fast_init", "ratio", "super_offload", "cpuadam_cores_perc",
            }
        ),
    }
)  # fmt: skip
# DeepSpeed's deprecated boolean offload keys -> the section DeepSpeed builds from them
# (``new_param_fn``: ``{"device": "cpu"}`` if true, no section if false). Giving one with
# its replacement is an error in DeepSpeed ("Cannot provide deprecated parameter ... and
# replacing parameter ... together"), and here.
_DS_LEGACY_OFFLOAD: Mapping[str, str] = MappingProxyType(
    {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
)
# Top-level sections of a DeepSpeed config (deepspeed/runtime/constants.py and config.py).
# Another top-level key within difflib's reach of one of these is taken for a misspelling
# and rejected; a key far from all of them is ignored with a warning (DeepSpeed ignores
# unknown top-level keys).
_DS_TOP_KEYS = frozenset(
    {
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "amp", "torch_autocast",
        "gradient_clipping", "zero_optimization", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "steps_per_print", "wall_clock_breakdown",
        "memory_breakdown", "dump_state", "prescale_gradients", "gradient_predivide_factor",
        "sparse_gradients", "sparse_attention", "activation_checkpointing", "flops_profiler",
        "tensorboard", "wandb", "csv_monitor", "comet", "aio", "elasticity", "pipeline",
        "communication_data_type", "seq_parallel_communication_data_type", "data_types",
        "checkpoint", "compression_training", "data_efficiency", "curriculum_learning",
        "autotuning", "nebula", "progressive_layer_drop", "eigenvalue", "quantize_training",
        "hybrid_engine", "compile", "disable_allgather", "dataloader_drop_last",
        "gradient_allreduce_op", "graph_harvesting", "use_data_before_expert_parallel_",
        "vocabulary_size", "weight_quantization", "zero_optimization_stage", "comms_logger",
        "monitor_config", "sequence_parallel_size", "expert_parallel", "timers",
    }
)  # fmt: skip
# HF Trainer's "auto" keys resolved from the model's hidden size
# (transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_finalize):
# ZeroConfig key -> (function of hidden size, stage-3 only).
_HF_HIDDEN_AUTO: Mapping[str, tuple[Any, bool]] = MappingProxyType(
    {
        "reduce_bucket_size": (lambda h: h * h, False),
        "prefetch_bucket_size": (lambda h: int(0.9 * h * h), True),
        "persistence_threshold": (lambda h: 10 * h, True),
    }
)


def _unknown_deepspeed_key(path: str, key: Any, known: frozenset[str]) -> ZeroConfigError:
    hint = _suggest(key, sorted(known)) if isinstance(key, str) else ""
    if key in _DS_TOP_KEYS:
        parent = path.rpartition(".")[0]
        hint = f"; {key!r} is a top-level DeepSpeed section: move it out of {parent!r}"
    elif not hint and len(known) <= 12:
        hint = "; accepted keys: " + ", ".join(sorted(known))
    return ZeroConfigError(
        f"unknown DeepSpeed key {path!r}{hint} (DeepSpeed rejects it too: its "
        "zero_optimization and offload sections forbid unknown keys)",
        key=path,
        value=key,
        accepted=", ".join(sorted(known)),
    )


def looks_like_deepspeed(obj: Mapping[str, Any]) -> bool:
    """True if a config dict is a DeepSpeed config: it has a DeepSpeed top-level section
    (e.g. ``zero_optimization``, ``train_batch_size``) or a close misspelling of one that
    is not a ZeroConfig key (e.g. ``zero_optimisation``)."""
    ours = {f.name for f in dataclasses.fields(ZeroConfig)}
    for key in obj:
        if not isinstance(key, str) or key in ours:
            continue
        if key in _DS_TOP_KEYS or difflib.get_close_matches(key, _DS_TOP_KEYS, 1, 0.8):
            return True
    return False


class DeepSpeedAutoResolvedWarning(DeepSpeedKeyIgnoredWarning):
    """A DeepSpeed ``"auto"`` value was replaced by the ZeroConfig default (the DeepSpeed
    value itself is ignored: only the Hugging Face Trainer knows how to resolve it)."""


class _DeepSpeedImport:
    """One translation of a DeepSpeed config into ZeroConfig keyword arguments.

    Holds the mapped values, the DeepSpeed key each came from, and the warnings to emit
    (one per DeepSpeed key path), so no state is spread over module globals.
    """

    def __init__(self, hidden_size: int | None = None) -> None:
        self.hidden_size = hidden_size
        self.stage: int | None = None
        self.mapped: dict[str, Any] = {}
        self.sources: dict[str, str] = {}  # ZeroConfig key -> DeepSpeed key path
        self.warnings: dict[str, tuple[str, type[Warning]]] = {}  # DeepSpeed path -> message

    def ignore(self, path: str, why: str = "it has no counterpart in ZeroConfig") -> None:
        self.warnings.setdefault(
            path, (f"DeepSpeed key {path!r} ignored: {why}", DeepSpeedKeyIgnoredWarning)
        )

    def value(self, key: str, path: str, value: Any) -> Any:
        """Validate DeepSpeed ``value`` at ``path`` for ZeroConfig ``key``; resolve "auto"."""
        spec = _SPECS[key]
        if isinstance(value, str) and value == "auto":
            if key in _DS_AUTO_REJECTED:
                raise ZeroConfigError(
                    f"{path}='auto' cannot be resolved: there is no sensible default for "
                    f"{key}; expected {spec.accepted()}",
                    key=path,
                    value=value,
                    accepted=spec.accepted(),
                )
            if key in _HF_HIDDEN_AUTO and self.hidden_size is not None:
                fill, stage3_only = _HF_HIDDEN_AUTO[key]
                if not stage3_only or self.stage == 3:
                    return _check_value(path, fill(self.hidden_size), spec)
            default = _DEFAULTS[key]
            self.warnings.setdefault(
                path,
                (
                    f"DeepSpeed key {path!r} is 'auto' (resolved by the Hugging Face Trainer "
                    f"from its arguments); using the ZeroConfig default {key}={default!r}",
                    DeepSpeedAutoResolvedWarning,
                ),
            )
            return default
        # DeepSpeed parses integer fields leniently: JSON 5e8 is a float with no fraction.
        if (
            spec.kind == "int"
            and isinstance(value, float)
            and math.isfinite(value)
            and value.is_integer()
        ):
            value = int(value)
        return _check_value(path, value, spec)

    def put(self, key: str, path: str, value: Any) -> None:
        """Record ``key = value`` from ``path``; two DeepSpeed keys may not disagree."""
        value = self.value(key, path, value)
        if key in self.mapped and self.mapped[key] != value:
            other = self.sources[key]
            raise ZeroConfigError(
                f"{path}={value!r} conflicts with {other}={self.mapped[key]!r}: both map to "
                f"ZeroConfig's single {key}",
                key=path,
                value=value,
                accepted=f"the same value as {other}",
            )
        self.mapped[key] = value
        self.sources[key] = path

    def zero_section(self, zero: Any) -> None:
        path = "zero_optimization"
        if zero is None or isinstance(zero, bool):
            # Legacy form: "zero_optimization": true meant stage 1.
            self.put("stage", path, 1 if zero else 0)
            return
        if not isinstance(zero, Mapping):
            raise ZeroConfigError(
                f"{path} must be an object, got {type(zero).__name__}", key=path, value=zero
            )
        for key in zero:
            if key not in _DS_ZERO_KEYS:
                raise _unknown_deepspeed_key(f"{path}.{key}", key, _DS_ZERO_KEYS)
        self.put("stage", f"{path}.stage", zero.get("stage", 0))
        self.stage = self.mapped["stage"]
        pins: list[tuple[str, bool]] = []
        for key, value in zero.items():
            sub = f"{path}.{key}"
            if key == "stage":
                continue
            if key in _DS_ZERO_SCALARS:
                self.put(_DS_ZERO_SCALARS[key], sub, value)
            elif key in ("offload_optimizer", "offload_param"):
                pins.extend(self.offload_section(key, value))
            elif key in _DS_LEGACY_OFFLOAD:
                self.legacy_offload(key, value, zero)
            elif key == "cpu_offload_use_pin_memory":
                self.ignore(
                    sub,
                    "DeepSpeed deprecated it and gives it no effect either (set_new_param "
                    "False in deepspeed/runtime/zero/config.py); set pin_memory in "
                    "offload_optimizer / offload_param",
                )
            else:
                self.ignore(sub)
        self.pin_memory(pins)

    def legacy_offload(self, key: str, value: Any, zero: Mapping[str, Any]) -> None:
        """DeepSpeed's deprecated ``cpu_offload`` / ``cpu_offload_param``: true means the
        section ``{"device": "cpu"}`` (DeepSpeed's ``new_param_fn``), false or null none."""
        path, section = f"zero_optimization.{key}", _DS_LEGACY_OFFLOAD[key]
        if value is not None and not isinstance(value, bool):
            raise ZeroConfigError(
                f"{path}={value!r} is invalid: expected true or false",
                key=path,
                value=value,
                accepted="true, false",
            )
        if section in zero:
            raise ZeroConfigError(
                f"{path} and zero_optimization.{section} are both given: {key} is "
                f"DeepSpeed's deprecated spelling of {section} (DeepSpeed refuses both "
                "together too); keep only the section",
                key=path,
                value=value,
                accepted=f"one of {key} and {section}",
            )
        if value:
            self.put(section, path, "cpu")

    def offload_section(self, key: str, section: Any) -> list[tuple[str, bool]]:
        """Map one offload section; return its (path, pin_memory) if it is active."""
        path = f"zero_optimization.{key}"
        if section is None:
            self.put(key, f"{path}.device", "none")
            return []
        if not isinstance(section, Mapping):
            raise ZeroConfigError(
                f'{path} must be an object such as {{"device": "cpu"}}, got '
                f"{type(section).__name__}",
                key=path,
                value=section,
            )
        for sub_key in section:
            if sub_key not in _DS_OFFLOAD_KEYS[key]:
                raise _unknown_deepspeed_key(f"{path}.{sub_key}", sub_key, _DS_OFFLOAD_KEYS[key])
        # DeepSpeed's pydantic model defaults "device" to "none".
        self.put(key, f"{path}.device", section.get("device", "none"))
        device = self.mapped[key]
        pins: list[tuple[str, bool]] = []
        for sub_key, value in section.items():
            sub = f"{path}.{sub_key}"
            if sub_key == "device":
                continue
            if device == "none" and sub_key in ("nvme_path", "pin_memory"):
                self.ignore(sub, f"{path}.device is 'none'")
            elif sub_key == "nvme_path":
                if device == "nvme":
                    self.put("nvme_path", sub, value)
                else:
                    self.ignore(sub, f"{path}.device is {device!r}, not 'nvme'")
            elif sub_key == "pin_memory":
                pins.append((sub, self.value("pin_memory", sub, value)))
            elif sub_key == "ratio" and key == "offload_optimizer":
                if device == "cpu":
                    self.put("offload_optimizer_ratio", sub, value)
                else:
                    self.ignore(sub, f"{path}.device is {device!r}; ratio applies to 'cpu'")
            else:
                self.ignore(sub)
        return pins

    def pin_memory(self, pins: list[tuple[str, bool]]) -> None:
        """One pin_memory for all offloaded states: True if any active section asks."""
        if not pins:
            return
        wanted = any(v for _, v in pins)
        self.mapped["pin_memory"] = wanted
        for path, value in pins:
            if value != wanted:
                self.ignore(
                    path,
                    "ZeroConfig has one pin_memory for all offloaded states and another "
                    "offload section asks for pin_memory=true",
                )
            else:
                self.sources.setdefault("pin_memory", path)


_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {f.name: f.default for f in dataclasses.fields(ZeroConfig)}
)


def _from_deepspeed(
    cls: type[ZeroConfig],
    ds_config: Mapping[str, Any] | str | os.PathLike[str],
    hidden_size: int | None = None,
) -> ZeroConfig:
    """Translate a DeepSpeed config into a ZeroConfig (see ``ZeroConfig.from_deepspeed``).

    Mapping (DeepSpeed -> ZeroConfig); keys DeepSpeed leaves unset take DeepSpeed's
    defaults where they differ from ours:

    - ``zero_optimization.stage`` -> ``stage`` (unset: 0, DeepSpeed's default; a missing
      ``zero_optimization`` section also means stage 0; legacy ``true`` means 1).
    - ``zero_optimization.offload_optimizer.device`` / ``offload_param.device`` ->
      ``offload_optimizer`` / ``offload_param`` (unset section or device: 'none').
    - ``offload_*.nvme_path`` of a section whose device is 'nvme' -> ``nvme_path``
      (two different paths are an error: there is one NVMe directory here).
    - ``offload_*.pin_memory`` of an active section -> ``pin_memory`` (True if any).
    - ``stage3_param_persistence_threshold``, ``stage3_prefetch_bucket_size``,
      ``stage3_max_live_parameters``, ``stage3_max_reuse_distance`` (or their names
      without ``stage3_``), ``reduce_bucket_size``, ``allgather_bucket_size``,
      ``overlap_comm``, ``sub_group_size`` -> the same-named ZeroConfig keys.
      ``overlap_comm`` unset: True for stage 3 and False otherwise, as DeepSpeed does.
    - top-level ``gradient_accumulation_steps`` -> ``gradient_accumulation_steps``.

    - legacy ``cpu_offload: true`` -> ``offload_optimizer='cpu'`` and
      ``cpu_offload_param: true`` -> ``offload_param='cpu'``, as DeepSpeed's
      ``new_param_fn`` maps them (false: no offload; with the replacing section: an
      error, as in DeepSpeed). ``cpu_offload_use_pin_memory`` is ignored with a warning:
      DeepSpeed gives it no effect either.

    Keys DeepSpeed's ``zero_optimization`` and offload sections do not accept are errors
    (DeepSpeed's pydantic models forbid extra keys) naming the nearest valid key; a
    top-level key close to a DeepSpeed section (``zero_optimisation``) is an error too.

    Integral floats (JSON ``5e8``) are accepted for int keys, as DeepSpeed accepts them.
    ``"auto"``: with ``hidden_size`` (the model's hidden size, as the Hugging Face Trainer
    reads it from the model config), ``reduce_bucket_size`` = h², and at stage 3
    ``stage3_prefetch_bucket_size`` = int(0.9 h²) and ``stage3_param_persistence_threshold``
    = 10 h (transformers/integrations/deepspeed.py, ``trainer_config_finalize``). Other
    ``"auto"`` values resolve to our default with a ``DeepSpeedAutoResolvedWarning``
    (DeepSpeed itself drops ``"auto"`` and uses its defaults, which ours equal), except
    stage, offload devices and nvme_path, where it is rejected.
    """
    if isinstance(ds_config, Mapping):
        ds: Mapping[str, Any] = ds_config
    elif isinstance(ds_config, (str, os.PathLike)):
        ds = _load_json_object(ds_config, "DeepSpeed config")
    else:
        raise ZeroConfigError(
            "DeepSpeed config must be a mapping, JSON text or a path, got "
            f"{type(ds_config).__name__}"
        )
    if hidden_size is not None:
        _check_value("hidden_size", hidden_size, _Spec("int", "elements", 1, _COUNT_MAX))
    for key in ds:
        if isinstance(key, str) and key not in _DS_TOP_KEYS:
            near = difflib.get_close_matches(key, _DS_TOP_KEYS, 1, 0.8)
            if near:
                raise ZeroConfigError(
                    f"unknown DeepSpeed section {key!r}; did you mean {near[0]!r}? "
                    "(a misspelt section would be ignored and silently change the run)",
                    key=key,
                    value=ds[key],
                    accepted=near[0],
                )
    imp = _DeepSpeedImport(hidden_size)
    imp.zero_section(ds.get("zero_optimization"))
    imp.mapped.setdefault("offload_optimizer", "none")
    imp.mapped.setdefault("offload_param", "none")
    imp.mapped.setdefault("overlap_comm", imp.mapped["stage"] == 3)
    for key, value in ds.items():
        if key == "zero_optimization":
            continue
        if key in _DS_TOP_SCALARS:
            imp.put(_DS_TOP_SCALARS[key], key, value)
        else:
            imp.ignore(key)
    for message, category in imp.warnings.values():
        warnings.warn(message, category, stacklevel=3)
    try:
        return cls(**imp.mapped)
    except ZeroConfigError as e:
        origin = imp.sources.get(e.key or "")
        where = f" (from DeepSpeed key {origin!r})" if origin else ""
        raise ZeroConfigError(
            f"DeepSpeed config is not valid here{where}: {e}",
            key=e.key,
            value=e.value,
            accepted=e.accepted,
        ) from None
