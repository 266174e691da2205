"""What this version implements: the (stage, offload) combinations a strategy accepts.

One table read by the strategy (to refuse an unimplemented config at construction) and by
the OOM advice (to offer only changes that would run). It sits below both, so neither
imports the other for it (layering: ``zero_runtime/__init__.py``).
"""

from __future__ import annotations

from typing import Any

#: (stage, offload_optimizer) pairs this version implements (stage 0 ignores the offload).
IMPLEMENTED: frozenset[tuple[int, str]] = frozenset(
    {(0, "none")}
    | {(s, o) for s in (1, 2) for o in ("none", "cpu", "nvme")}
    | {(3, o) for o in ("none", "cpu", "nvme")}  # stage 3: tests/test_stage3.py
)

#: offload_param tiers of stage 3 this version implements (parity-tested in
#: tests/test_stage3.py); any offload_optimizer tier combines with them.
IMPLEMENTED_STAGE3_PARAM: frozenset[str] = frozenset({"none", "cpu", "nvme"})


def check_implemented(config: Any) -> None:
    """Refuse a config whose (stage, offload) combination this version does not implement.

    Args:
        config: a :class:`zero_runtime.config.ZeroConfig` (reads ``stage``,
            ``offload_optimizer`` and ``offload_param``).

    Raises:
        NotImplementedError: the combination is not implemented; the message lists the
            implemented ones.
    """
    if config.stage == 3 and config.offload_param not in IMPLEMENTED_STAGE3_PARAM:
        raise NotImplementedError(
            f"stage=3 with offload_param={config.offload_param!r} is not implemented yet; "
            f"implemented offload_param at stage 3: {sorted(IMPLEMENTED_STAGE3_PARAM)}"
        )
    key = (config.stage, config.offload_optimizer if config.stage else "none")
    if key not in IMPLEMENTED:
        raise NotImplementedError(
            f"stage={config.stage} with offload_optimizer={config.offload_optimizer!r} "
            f"is not implemented yet; implemented (stage, offload_optimizer): "
            f"{sorted(IMPLEMENTED)}"
        )
