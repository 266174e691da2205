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

One module per concept: :mod:`~zero_runtime.config.zero_config` (the dataclass and its
validation), :mod:`~zero_runtime.config.specs` (the per-key specs that drive it),
:mod:`~zero_runtime.config.errors`, :mod:`~zero_runtime.config.json_input` (JSON text or
file), :mod:`~zero_runtime.config.tunables` (live tuning) and
:mod:`~zero_runtime.config.deepspeed` (importing a DeepSpeed config; its schema in
:mod:`~zero_runtime.config.deepspeed_keys`). Import the public names from here.
"""

from __future__ import annotations

from zero_runtime.config.deepspeed import (
    DeepSpeedAutoResolvedWarning,
    DeepSpeedKeyIgnoredWarning,
    looks_like_deepspeed,
)
from zero_runtime.config.errors import ZeroConfigError, ZeroConfigFileNotFoundError
from zero_runtime.config.specs import MAX_PAGE_SIZE_BYTES, MIN_PAGE_SIZE_BYTES, OFFLOAD_DEVICES
from zero_runtime.config.tunables import TUNABLE_KEYS, Tunable, validate_tunable_update
from zero_runtime.config.zero_config import ZeroConfig, physical_memory_bytes

__all__ = [
    "MAX_PAGE_SIZE_BYTES",
    "MIN_PAGE_SIZE_BYTES",
    "OFFLOAD_DEVICES",
    "TUNABLE_KEYS",
    "DeepSpeedAutoResolvedWarning",
    "DeepSpeedKeyIgnoredWarning",
    "Tunable",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroConfigFileNotFoundError",
    "looks_like_deepspeed",
    "physical_memory_bytes",
    "validate_tunable_update",
]
