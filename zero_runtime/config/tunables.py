"""Live tuning: the keys that may be changed on a running job at a step boundary
(``TUNABLE_KEYS``, each with bounds), and the validation of an update."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from zero_runtime.config.errors import ZeroConfigError
from zero_runtime.config.specs import KIB, KeySpec, check_value, suggest
from zero_runtime.config.zero_config import ZeroConfig


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
        spec = KeySpec("int", self.unit, self.minimum, self.maximum)
        if isinstance(value, float) and not math.isfinite(value):
            accepted = spec.accepted()
            raise ZeroConfigError(
                f"{self.key}={value!r} is invalid: expected {accepted}; "
                "must be finite (not NaN or inf)",
                key=self.key,
                value=value,
                accepted=accepted,
            )
        return check_value(self.key, value, spec)


_PIB = 1 << 50
_MAX_ELEMENTS = 10**15  # a quadrillion elements: far above any model, far below overflow

TUNABLE_KEYS: Mapping[str, Tunable] = MappingProxyType(
    {
        t.key: t
        for t in (
            Tunable(
                "device_budget_bytes",
                "bytes",
                64 * KIB,
                _PIB,
                "bytes the runtime may place on the device tier",
                "next step (budget check; stage 3: device tier capacity, pages move)",
            ),
            Tunable(
                "host_budget_bytes",
                "bytes",
                64 * KIB,
                _PIB,
                "bytes the runtime may place in host memory",
                "next step (budget check); the pool's host tier: rebuild",
            ),
            Tunable(
                "persistence_threshold",
                "elements",
                0,
                _MAX_ELEMENTS,
                "parameters with fewer elements may stay gathered (a permission; "
                "the engine keeps none, the estimator counts them replicated)",
                "rebuild (stage 3's traced plan)",
            ),
            Tunable(
                "max_live_parameters",
                "elements",
                1,
                _MAX_ELEMENTS,
                "max gathered parameter elements per replica (stage 3 tiles or refuses)",
                "rebuild (stage 3's traced plan)",
            ),
            Tunable(
                "max_reuse_distance",
                "elements",
                0,
                _MAX_ELEMENTS,
                "a parameter may stay gathered if reused within this many elements",
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
            hint = suggest(key, tunable) if isinstance(key, str) else ""
            if not hint and isinstance(key, str):
                hint = suggest(key, ZeroConfig.keys())
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
