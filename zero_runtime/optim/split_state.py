"""Partial optimizer offload: one part of each shard's states on the device, the rest on
the host, both updated in the same step, concurrently.

DeepSpeed's ZeRO-Offload++ "Twin-Flow" (``zero_optimization.offload_optimizer.ratio``,
DeepSpeed blog "ZeRO-Offload++", 2023; ZeroConfig ``offload_optimizer_ratio``): a fraction
``ratio`` of the optimizer states is kept and updated on the CPU (ZeRO-Offload, Ren et
al., USENIX ATC 2021, section 4.1), the remaining ``1 - ratio`` stays in accelerator
memory and is updated there, so the device is not idle while the CPU works and less
state crosses the host link.

Each replica's flat shard of ``shard_size`` elements (:class:`~.layout.FlatLayout`) is cut
at ``device_size = round((1 - ratio) * shard_size)``: elements ``[0, device_size)`` are
updated by the optimizer's TensorFlow ops on the replica's device
(:class:`~.device_state.DeviceOptimizerState`), elements ``[device_size, shard_size)`` by
the host kernels (:class:`~.host_state.HostOptimizerState`). The two updates have no data
dependency, so TensorFlow's executor runs them in parallel (the host one in a
``tf.numpy_function`` call); the stage 1-2 update (:mod:`.flat_update`) concatenates
their outputs before the all-gather. Both follow Keras's operation order, so the result
is the same as with either tier alone (``tests/test_partial_offload.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from zero_runtime.optim.device_state import DeviceOptimizerState
from zero_runtime.optim.host_state import HostOptimizerState, _checked_shard
from zero_runtime.optim.layout import FlatLayout


@dataclasses.dataclass(frozen=True)
class ShardSlice:
    """The layout a part store sees: ``shard_size`` elements per replica, ``num_shards``
    replicas (the part stores only read these two fields)."""

    shard_size: int
    num_shards: int


def device_elements(shard_size: int, ratio: float) -> int:
    """Elements of a ``shard_size`` shard kept on the device when ``ratio`` of them is
    offloaded: ``round((1 - ratio) * shard_size)``, clamped to ``[0, shard_size]``."""
    return min(shard_size, max(0, round((1.0 - ratio) * shard_size)))


class SplitOptimizerState:
    """Optimizer-state shards split between the device and the host (Twin-Flow).

    Args:
        layout: the flat layout of the optimizer's trainable variables.
        slot_names: per-element state buffers (e.g. ``("momentum", "velocity")``).
        devices: one device per local replica, index = replica id.
        ratio: fraction of each shard's elements offloaded to the host, float in
            ``(0, 1)`` (ZeroConfig ``offload_optimizer_ratio``).

    Attributes:
        device_size: elements ``[0, device_size)`` of every shard live on the device.
        device: the device part (float32 ``[device_size]`` variables per slot per replica).
        host: the host part (float32 ``[shard_size - device_size]`` buffers).

    Raises:
        ValueError: ``ratio`` outside ``(0, 1)``.
    """

    tier = "host"  # the offload tier; :meth:`usage` reports both

    def __init__(
        self,
        layout: FlatLayout,
        slot_names: tuple[str, ...],
        devices: tuple[str, ...],
        ratio: float,
    ) -> None:
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"ratio={ratio!r}: expected a float in (0, 1)")
        self.layout = layout
        self.slot_names = tuple(slot_names)
        self.ratio = float(ratio)
        self.device_size = device_elements(layout.shard_size, ratio)
        n = layout.num_shards
        self.device = DeviceOptimizerState(
            ShardSlice(self.device_size, n),
            self.slot_names,
            devices,  # type: ignore[arg-type]
        )
        self.host = HostOptimizerState(
            ShardSlice(layout.shard_size - self.device_size, n),  # type: ignore[arg-type]
            self.slot_names,
        )

    def host_ranges(self, ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        """Shard-local ``[start, end)`` ranges clipped to the host part and shifted to its
        own indices (``start - device_size``)."""
        k = self.device_size
        return tuple((max(s, k) - k, e - k) for s, e in ranges if e > k)

    def update(self, replica: int, ranges, param, grad, step_fn, step=None, **kw) -> None:
        """Update the host part (as :meth:`HostOptimizerState.update`): ``param`` and
        ``grad`` are float32 ``[shard_size - device_size]``; ``ranges`` shard-local (full
        shard indices), clipped here."""
        self.host.update(replica, self.host_ranges(tuple(ranges)), param, grad, step_fn, **kw)

    @property
    def nbytes(self) -> int:
        """Host bytes held (the host part, state plus scratch)."""
        return self.host.nbytes

    @property
    def state_bytes(self) -> int:
        """Host bytes of optimizer state proper (the host part)."""
        return self.host.state_bytes

    def usage(self) -> dict[str, tuple[int, int]]:
        """``{"device": (device state bytes, 0), "host": (state bytes, scratch bytes)}``."""
        return {**self.device.usage(), **self.host.usage()}

    def mark_updated(self, replica: int) -> None:
        """Count one completed update of ``replica``'s host part."""
        self.host.mark_updated(replica)

    def updates(self, replica: int) -> int:
        """Completed updates of ``replica``'s shard (counted by the host part)."""
        return self.host.updates(replica)

    def read_shard(self, replica: int, slot: str) -> np.ndarray:
        """A copy of one slot of ``replica``'s whole shard, float32 ``[shard_size]``
        (device part then host part).

        Raises:
            ValueError: ``replica`` out of range.
            KeyError: unknown slot name.
        """
        host = self.host.read_shard(replica, slot)
        if self.device_size == 0:
            return host
        return np.concatenate([self.device.read_shard(replica, slot), host])

    def write_shard(self, replica: int, slot: str, values: np.ndarray) -> None:
        """Overwrite one slot of ``replica``'s whole shard, float32 ``[shard_size]``.

        Call outside a ``tf.function``.

        Raises:
            ValueError: ``values`` of the wrong shape, or ``replica`` out of range.
            KeyError: unknown slot name.
            RuntimeError: the host part is inside an update.
        """
        values = _checked_shard(values, self.layout.shard_size, slot)
        if self.device_size:
            self.device.write_shard(replica, slot, values[: self.device_size])
        self.host.write_shard(replica, slot, values[self.device_size :])

    def slot_values(self, slot: str) -> np.ndarray:
        """One slot's full (unpadded) flat buffer, in variable order (float32
        ``[layout.total]``; every shard local).

        Raises:
            KeyError: unknown slot.
        """
        return self.layout.unshard(
            [self.read_shard(r, slot) for r in range(self.layout.num_shards)]
        )

    def close(self) -> None:
        """Release both parts."""
        self.device.close()
        self.host.close()
