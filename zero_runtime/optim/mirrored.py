"""The record of an optimizer that runs the stock (mirrored) update: stage 0, or a model
below ``mirrored_fallback_bytes``.

Plain data parallelism (``tf.distribute.MirroredStrategy``) keeps on every replica the
whole model state: parameters (4 Ψ bytes in fp32), gradients (4 Ψ) and the optimizer's
states (K Ψ; Adam: 8 Ψ) — ZeRO (Rajbhandari et al., SC20) section 3.1, the baseline of
Table 1. The runtime still records every step of such a run (tiers, budgets, step time,
the OOM post-mortem), so that a mirrored run and a ZeRO run of the same model can be
compared in the Memory Hierarchy tab; this module gives the accounting what it reads
from a partitioned optimizer's :class:`~zero_runtime.optim.partitioned.
ZeroOptimizerState`: the same field names, with stage 0 and a store that holds every
replica's full states on the device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zero_runtime.optim.layout import FlatLayout


class ReplicatedDeviceStates:
    """The stock optimizer's slot variables, replicated on each local replica's device.

    Args:
        state_bytes_per_replica: bytes of one replica's optimizer states (the slot
            variables Keras built: Adam's momentum and velocity, SGD's momentum), >= 0.
        local_replicas: replicas in this process, >= 1.

    Raises:
        ValueError: a negative byte count or fewer than one replica.
    """

    def __init__(self, state_bytes_per_replica: int, local_replicas: int) -> None:
        if state_bytes_per_replica < 0:
            raise ValueError(f"state_bytes_per_replica must be >= 0, got {state_bytes_per_replica}")
        if local_replicas < 1:
            raise ValueError(f"local_replicas must be >= 1, got {local_replicas}")
        self.state_bytes_per_replica = int(state_bytes_per_replica)
        self.local_replicas = int(local_replicas)

    def usage(self) -> dict[str, tuple[int, int]]:
        """``{"device": (optimizer-state bytes over the local replicas, 0)}``."""
        return {"device": (self.state_bytes_per_replica * self.local_replicas, 0)}

    def close(self) -> None:
        """Nothing to release (the slot variables belong to Keras)."""


@dataclasses.dataclass
class MirroredOptimizerState:
    """What the runtime's accounting reads of a stock (mirrored) optimizer.

    The fields mirror :class:`~zero_runtime.optim.partitioned.ZeroOptimizerState` so the
    accounting treats both alike; ``stage`` is 0 (nothing partitioned).

    Attributes:
        config: the active configuration.
        layout: a one-shard :class:`FlatLayout` of the trainable variables (``total``
            elements; ``num_shards`` is the replica count, for the collective figures).
        store: the :class:`ReplicatedDeviceStates`.
        devices: the local replicas' devices.
        runtime: the strategy's ``ZeroRuntime`` or None.
    """

    config: Any
    layout: FlatLayout
    store: ReplicatedDeviceStates
    devices: tuple[str, ...]
    runtime: Any
    stage: int = 0
    group: Any = None
    accumulators: tuple = ()
    journals: Any = None

    @property
    def accumulation_steps(self) -> int:
        """Always 1: Keras's own accumulation is not counted here."""
        return 1

    @property
    def accumulator_bytes(self) -> int:
        """0: no ZeRO accumulator."""
        return 0

    @classmethod
    def from_optimizer(
        cls, optimizer: Any, variables: list, config: Any, devices: tuple[str, ...], runtime: Any
    ) -> MirroredOptimizerState:
        """The record of a built stock Keras ``optimizer`` over its trainable ``variables``.

        The optimizer-state bytes are the built slot variables' (every optimizer variable
        except Keras's scalar counters), per replica, in their own dtypes.

        Raises:
            ValueError: a variable with an unknown dimension (from :class:`FlatLayout`).
        """
        trainable = [v for v in variables if getattr(v, "trainable", True)]
        layout = FlatLayout.from_variables(trainable, max(1, len(devices)))
        state = 0
        for v in optimizer.variables:
            shape = tuple(int(d) for d in v.shape)
            if not shape:  # iterations, learning rate: scalars, not model state
                continue
            size = 1
            for d in shape:
                size *= d
            state += size * _itemsize(v.dtype)
        store = ReplicatedDeviceStates(state, max(1, len(devices)))
        return cls(config=config, layout=layout, store=store, devices=devices, runtime=runtime)


def _itemsize(dtype: Any) -> int:
    name = getattr(dtype, "name", str(dtype))
    if "16" in name:
        return 2
    if "64" in name:
        return 8
    return 4
