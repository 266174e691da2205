"""Stage-3 tier accounting: the tiers record built from the stage-3 pool's page table.

At stage 3 no parameter is replicated: a replica holds its shards (on the tier
``offload_param`` selects; pages of the engine's
:class:`~zero_runtime.memory.PagedBufferPool`, reserved there when they are device
variables) and, while a unit runs, its gathered parameters on the device tier
(TensorFlow tensors outside the pool, at most ``UNITS_LIVE`` units:
:mod:`zero_runtime.stage3.device_plan`). The runtime's ``memory_hierarchy/tiers`` record
takes them from the pool's accounting and the engine's device plan
(:class:`~zero_runtime.stage3.engine.PoolStep`) instead of counting the model as
replicated (``Psi * 4 * replicas``). Everything here is bytes.

Per tier (``T`` = the pool's pages on the tier at the step boundary, ``P`` = its peak
during the step, ``base`` = the partitioned optimizer's own record of the tier):

- device: ``param`` = T's 'param' pages (shards with ``offload_param='none'``, the
  row-paged tables' cached row pages); ``gathered`` = the step's gathered units, the
  device plan's bound (``UNITS_LIVE`` x the largest unit x local replicas; freed by the
  step's end, so in ``peak`` only); ``grad`` = the reduced gradient shards the step hands to the
  optimizer, ``4 * shard_size`` per local replica (ZeRO, SC20, section 5.3), held by
  TensorFlow; with the update in backward (zero_runtime/optim/backward_update.py) one
  block's shard at a time, ``4 * max_block_shard_elements`` per local replica
  (``ZeroRuntime.grad_bytes``); frozen (non-trainable) weights, replicated on every
  replica's device and not in the pool, are added to ``param``; ``optimizer`` = base's
  device optimizer states + T's 'optimizer' pages; ``other`` = T's other kinds;
  ``used`` = their sum; ``peak`` = P + gathered + grad + optimizer + frozen;
  ``capacity`` = the pool's device capacity + what the budget keeps outside the pool
  for gathered units and frozen weights (``reserved_bytes``): ``device_budget_bytes``,
  or the engine's default. Activations held by TensorFlow are not counted.
- host and nvme: base's optimizer states and scratch + T's pages ('param' = the shards
  and gathered buffers the pool moved down); peak = base's peak + P; capacity = base's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from zero_runtime.telemetry import TierStats

#: Pool page kinds counted as parameters / optimizer states; the rest is "other".
_PARAM_KINDS = ("param",)
_OPTIMIZER_KINDS = ("optimizer",)


def stage3_tiers(
    base: Mapping[str, TierStats],
    records: Sequence,
    grad_device_bytes: float,
    frozen_device_bytes: float = 0.0,
) -> dict[str, TierStats]:
    """The tiers record of a stage-3 step.

    Args:
        base: the runtime's record for ``"device"``, ``"host"``, ``"nvme"`` from the
            optimizers' stores (its device parameter and gradient figures are ignored).
        records: the step's :class:`~zero_runtime.stage3.engine.PoolStep` of each
            stage-3 engine in the process.
        grad_device_bytes: bytes of reduced gradient shards of the local replicas.
        frozen_device_bytes: bytes of the frozen (non-trainable) weights the local
            replicas hold on the device, replicated (``Stage3Engine.frozen_bytes`` x
            local replicas; default 0): counted as device ``param`` bytes.

    Returns:
        ``{"device"|"host"|"nvme": TierStats}`` (bytes; NaN where unknown).
    """
    out = {}
    for name in ("device", "host", "nvme"):
        b = base[name]
        used = peak = param = optimizer = other = 0.0
        capacity = 0.0
        for r in records:
            u = r.usage[name]
            used += u.used_bytes
            peak += u.peak_bytes
            capacity += u.capacity_bytes if u.capacity_bytes is not None else math.inf
            if name == "device":  # outside the pool (engine.PoolStep)
                peak += r.gathered_bytes
                capacity += r.reserved_bytes
            for kind, nbytes in u.bytes_by_kind.items():
                if kind in _PARAM_KINDS:
                    param += nbytes
                elif kind in _OPTIMIZER_KINDS:
                    optimizer += nbytes
                else:
                    other += nbytes
        base_opt = _finite(b.optimizer_bytes)
        if name == "device":
            grad = float(grad_device_bytes)
            frozen = float(frozen_device_bytes)
            out[name] = TierStats(
                used_bytes=used + grad + base_opt + frozen,
                capacity_bytes=capacity if math.isfinite(capacity) else math.nan,
                peak_bytes=peak + grad + base_opt + frozen,
                param_bytes=param + frozen,
                grad_bytes=grad,
                optimizer_bytes=base_opt + optimizer,
                other_bytes=other,
            )
        else:
            base_other = _finite(b.other_bytes)
            out[name] = TierStats(
                used_bytes=_finite(b.used_bytes) + used,
                capacity_bytes=b.capacity_bytes,
                peak_bytes=_finite(b.peak_bytes) + peak,
                param_bytes=param,
                grad_bytes=0.0,
                optimizer_bytes=base_opt + optimizer,
                other_bytes=base_other + other,
            )
    return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0
