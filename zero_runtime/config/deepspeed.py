"""Importing a DeepSpeed config (``ZeroConfig.from_deepspeed``): the key mapping,
DeepSpeed's legacy keys, "did you mean" checks of misspelt keys and sections, and the
resolution of ``"auto"`` values.

The schema tables are in :mod:`zero_runtime.config.deepspeed_keys`. This module does not
import :class:`~zero_runtime.config.ZeroConfig` (which calls it): the class is passed in.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

from zero_runtime.config.deepspeed_keys import (
    DS_AUTO_REJECTED,
    DS_LEGACY_OFFLOAD,
    DS_OFFLOAD_KEYS,
    DS_TOP_KEYS,
    DS_TOP_SCALARS,
    DS_ZERO_KEYS,
    DS_ZERO_SCALARS,
    HF_HIDDEN_AUTO,
)
from zero_runtime.config.errors import ZeroConfigError
from zero_runtime.config.json_input import load_json_object
from zero_runtime.config.specs import COUNT_MAX, SPECS, KeySpec, check_value, suggest

_ConfigT = TypeVar("_ConfigT")


class DeepSpeedKeyIgnoredWarning(UserWarning):
    """Warned by ``ZeroConfig.from_deepspeed`` once per DeepSpeed key that has no counterpart
    here (and for ``"auto"`` values resolved to our default)."""


def _unknown_deepspeed_key(path: str, key: Any, known: frozenset[str]) -> ZeroConfigError:
    hint = suggest(key, sorted(known)) if isinstance(key, str) else ""
    if key in DS_TOP_KEYS:
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
    ours = SPECS.keys()  # the ZeroConfig keys
    for key in obj:
        if not isinstance(key, str) or key in ours:
            continue
        if key in DS_TOP_KEYS or difflib.get_close_matches(key, DS_TOP_KEYS, 1, 0.8):
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

    def __init__(self, defaults: Mapping[str, Any], hidden_size: int | None = None) -> None:
        self.defaults = defaults  # ZeroConfig key -> its default, for "auto"
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
        spec = SPECS[key]
        if isinstance(value, str) and value == "auto":
            if key in DS_AUTO_REJECTED:
                raise ZeroConfigError(
                    f"{path}='auto' cannot be resolved: there is no sensible default for "
                    f"{key}; expected {spec.accepted()}",
                    key=path,
                    value=value,
                    accepted=spec.accepted(),
                )
            if key in HF_HIDDEN_AUTO and self.hidden_size is not None:
                fill, stage3_only = HF_HIDDEN_AUTO[key]
                if not stage3_only or self.stage == 3:
                    return check_value(path, fill(self.hidden_size), spec)
            default = self.defaults[key]
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
        return check_value(path, value, spec)

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
            if key not in DS_ZERO_KEYS:
                raise _unknown_deepspeed_key(f"{path}.{key}", key, DS_ZERO_KEYS)
        self.put("stage", f"{path}.stage", zero.get("stage", 0))
        self.stage = self.mapped["stage"]
        pins: list[tuple[str, bool]] = []
        for key, value in zero.items():
            sub = f"{path}.{key}"
            if key == "stage":
                continue
            if key in DS_ZERO_SCALARS:
                self.put(DS_ZERO_SCALARS[key], sub, value)
            elif key in ("offload_optimizer", "offload_param"):
                pins.extend(self.offload_section(key, value))
            elif key in DS_LEGACY_OFFLOAD:
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
        path, section = f"zero_optimization.{key}", DS_LEGACY_OFFLOAD[key]
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
            if sub_key not in DS_OFFLOAD_KEYS[key]:
                raise _unknown_deepspeed_key(f"{path}.{sub_key}", sub_key, DS_OFFLOAD_KEYS[key])
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


def from_deepspeed_config(
    cls: type[_ConfigT],
    ds_config: Mapping[str, Any] | str | os.PathLike[str],
    hidden_size: int | None = None,
) -> _ConfigT:
    """Translate a DeepSpeed config into ``cls(**keys)``, ``cls`` a ZeroConfig dataclass
    (see ``ZeroConfig.from_deepspeed``, which calls this: the warnings name its caller).

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
        ds = load_json_object(ds_config, "DeepSpeed config")
    else:
        raise ZeroConfigError(
            "DeepSpeed config must be a mapping, JSON text or a path, got "
            f"{type(ds_config).__name__}"
        )
    if hidden_size is not None:
        check_value("hidden_size", hidden_size, KeySpec("int", "elements", 1, COUNT_MAX))
    for key in ds:
        if isinstance(key, str) and key not in DS_TOP_KEYS:
            near = difflib.get_close_matches(key, DS_TOP_KEYS, 1, 0.8)
            if near:
                raise ZeroConfigError(
                    f"unknown DeepSpeed section {key!r}; did you mean {near[0]!r}? "
                    "(a misspelt section would be ignored and silently change the run)",
                    key=key,
                    value=ds[key],
                    accepted=near[0],
                )
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    imp = _DeepSpeedImport(defaults, hidden_size)
    imp.zero_section(ds.get("zero_optimization"))
    imp.mapped.setdefault("offload_optimizer", "none")
    imp.mapped.setdefault("offload_param", "none")
    imp.mapped.setdefault("overlap_comm", imp.mapped["stage"] == 3)
    for key, value in ds.items():
        if key == "zero_optimization":
            continue
        if key in DS_TOP_SCALARS:
            imp.put(DS_TOP_SCALARS[key], key, value)
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
