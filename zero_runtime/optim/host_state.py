"""Optimizer state shards kept in host memory, one record per local replica.

ZeRO stage 1 (Rajbhandari et al., SC20, section 5.1, "P_os"): each data-parallel replica
holds only its shard of the optimizer states. With optimizer offload to the host
(ZeRO-Offload, Ren et al., USENIX ATC 2021, section 4.1) those shards live in CPU memory
and the update runs on the CPU, tile by tile (``kernels.tile_elements()``) so that every
pass of the NumPy update stays in the cache (the fused one makes a single pass).

Every optimizer-state store (:class:`HostOptimizerState` here,
:class:`~zero_runtime.optim.nvme_state.NvmeOptimizerState`,
:class:`~zero_runtime.optim.device_state.DeviceOptimizerState`) answers
``usage() -> {tier: (state_bytes, other_bytes)}`` for the runtime's accounting.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Callable, Sequence

import numpy as np

from zero_runtime.optim import kernels
from zero_runtime.optim.layout import FlatLayout

#: ``step_fn(slots, scratch, param, grad)``: update one tile in place. ``slots`` maps slot
#: name -> float32 view ``[t]``; ``scratch`` two float32 work buffers ``[t]``; ``param``
#: and ``grad`` float32 views ``[t]`` (param updated in place).
_Views = dict[str, np.ndarray]
StepFn = Callable[[_Views, tuple[np.ndarray, np.ndarray], np.ndarray, np.ndarray], None]


class ShardState(enum.Enum):
    """Lifecycle of one replica's host shard.

    ``UNALLOCATED``: no memory held (counts 0 bytes). ``READY``: slot buffers allocated and
    valid between steps (counts ``len(slots) * shard_bytes`` plus the scratch buffers).
    ``UPDATING``: inside an update; the buffers are being written.
    """

    UNALLOCATED = "unallocated"
    READY = "ready"
    UPDATING = "updating"


@dataclasses.dataclass
class ReplicaShard:
    """One replica's optimizer-state shard on the host.

    Attributes:
        replica: the replica id in the sync group.
        slots: slot name (e.g. ``"momentum"``) -> float32 ``[shard_size]`` buffer.
        scratch: two float32 ``[tile]`` work buffers reused every step.
        state: the lifecycle state.
        updates: number of completed updates.
    """

    replica: int
    slots: dict[str, np.ndarray]
    scratch: tuple[np.ndarray, np.ndarray]
    state: ShardState = ShardState.READY
    updates: int = 0

    @property
    def nbytes(self) -> int:
        """Host bytes held: the slot buffers plus the scratch buffers."""
        return sum(a.nbytes for a in self.slots.values()) + sum(a.nbytes for a in self.scratch)

    @property
    def state_bytes(self) -> int:
        """Host bytes of optimizer state proper (the slot buffers only)."""
        return sum(a.nbytes for a in self.slots.values())


def run_tiles(
    step_fn: StepFn,
    slots: dict[str, np.ndarray],
    scratch: tuple[np.ndarray, np.ndarray],
    param: np.ndarray,
    grad: np.ndarray,
    start: int,
    end: int,
) -> None:
    """Apply ``step_fn`` to elements ``[start, end)`` of equally long 1-D buffers, tile by
    tile (tiles of ``len(scratch[0])`` elements)."""
    tile = len(scratch[0])
    for s, e in kernels.tiles(end - start, tile):
        s, e = s + start, e + start
        views = {k: a[s:e] for k, a in slots.items()}
        step_fn(views, (scratch[0][: e - s], scratch[1][: e - s]), param[s:e], grad[s:e])


class HostOptimizerState:
    """The host-resident optimizer-state shards of one optimizer, for the local replicas.

    Args:
        layout: the flat layout of the optimizer's trainable variables.
        slot_names: names of the per-element state buffers (e.g. ``("momentum",
            "velocity")`` for Adam; empty for plain SGD).
        tile: elements per update tile (default ``kernels.tile_elements()``).

    Shards are allocated lazily, the first time a replica updates, so a worker process
    only ever holds the shards of its own replicas. Thread-safe: replicas update from
    TensorFlow's executor threads concurrently, each on its own shard.
    """

    tier = "host"

    def __init__(
        self,
        layout: FlatLayout,
        slot_names: tuple[str, ...],
        tile: int | None = None,
    ) -> None:
        self.layout = layout
        self.slot_names = tuple(slot_names)
        tile = kernels.tile_elements() if tile is None else tile
        self.tile = max(1, min(tile, layout.shard_size))
        self._shards: dict[int, ReplicaShard] = {}
        self._lock = threading.Lock()

    def shard(self, replica: int) -> ReplicaShard:
        """The shard of ``replica``, allocating it (zero-filled) on first use.

        Raises:
            ValueError: ``replica`` outside ``[0, layout.num_shards)``.
        """
        if not 0 <= replica < self.layout.num_shards:
            raise ValueError(f"replica {replica} out of range [0, {self.layout.num_shards})")
        with self._lock:
            shard = self._shards.get(replica)
            if shard is None:
                n = self.layout.shard_size
                shard = ReplicaShard(
                    replica=replica,
                    slots={s: np.zeros(n, np.float32) for s in self.slot_names},
                    scratch=(np.empty(self.tile, np.float32), np.empty(self.tile, np.float32)),
                )
                self._shards[replica] = shard
            return shard

    def begin_update(self, replica: int) -> ReplicaShard:
        """Move ``replica``'s shard READY -> UPDATING and return it.

        Raises:
            RuntimeError: the shard is already UPDATING (two concurrent updates).
        """
        shard = self.shard(replica)
        if shard.state is not ShardState.READY:
            raise RuntimeError(f"shard {replica} is {shard.state.value}, expected ready")
        shard.state = ShardState.UPDATING
        return shard

    def end_update(self, shard: ReplicaShard, count: bool = True) -> None:
        """Move a shard UPDATING -> READY and count the update (unless ``count`` is False)."""
        if shard.state is not ShardState.UPDATING:
            raise RuntimeError(f"shard {shard.replica} is {shard.state.value}, expected updating")
        shard.updates += int(count)
        shard.state = ShardState.READY

    def update(
        self,
        replica: int,
        ranges: Sequence[tuple[int, int]],
        param: np.ndarray,
        grad: np.ndarray,
        step_fn: StepFn,
        offset: int = 0,
        count: bool = True,
        step: int | None = None,
    ) -> None:
        """Update ``replica``'s shard in place over the shard-local ``ranges``.

        Not transactional (``step`` is accepted for the stores' common signature and
        ignored): a host update only fails on a bug, not on I/O; the NVMe store's steps
        are transactions (:class:`~zero_runtime.optim.nvme_state.StepTransaction`).

        Args:
            replica: the replica id.
            ranges: shard-local ``[start, end)`` element ranges to update (active
                variables), within ``[offset, offset + len(param))``.
            param: float32 parameter elements ``[offset, offset + len(param))`` of the
                shard (the whole ``[shard_size]`` shard with the default offset 0),
                updated in place.
            grad: float32 reduced gradient, the same elements as ``param``.
            step_fn: the optimizer's per-tile update (:data:`StepFn`).
            offset: shard-local element index of ``param[0]`` (default 0). The stage-3
                update in backward (:mod:`zero_runtime.optim.backward_update`) passes one
                block's elements at a time.
            count: count this call in :meth:`updates` (default True; False for the
                partial updates of one step but its last).
            step: ignored (see above).
        """
        del step
        shard = self.begin_update(replica)
        slots = shard.slots
        if offset:
            slots = {k: a[offset : offset + len(param)] for k, a in slots.items()}
        try:
            for s, e in ranges:
                run_tiles(step_fn, slots, shard.scratch, param, grad, s - offset, e - offset)
        finally:
            self.end_update(shard, count)

    @property
    def nbytes(self) -> int:
        """Host bytes held by all allocated local shards (state plus scratch)."""
        with self._lock:
            return sum(s.nbytes for s in self._shards.values())

    @property
    def state_bytes(self) -> int:
        """Host bytes of optimizer state proper over all allocated local shards."""
        with self._lock:
            return sum(s.state_bytes for s in self._shards.values())

    def usage(self) -> dict[str, tuple[int, int]]:
        """``{"host": (state_bytes, scratch_bytes)}``."""
        state = self.state_bytes
        return {"host": (state, self.nbytes - state)}

    def mark_updated(self, replica: int) -> None:
        """Count one completed update of ``replica``'s shard made of partial updates
        (``update(..., count=False)``, the stage-3 update in backward)."""
        self.shard(replica).updates += 1

    def updates(self, replica: int) -> int:
        """Completed updates of ``replica``'s shard (0 before the first)."""
        with self._lock:
            shard = self._shards.get(replica)
        return 0 if shard is None else shard.updates

    def slot_values(self, slot: str) -> np.ndarray:
        """The full (unpadded) flat buffer of one slot, in variable order.

        Only meaningful when every shard is local (one process); used by tests and by
        checkpoint export. Shape ``[layout.total]``, float32.

        Raises:
            KeyError: unknown slot name, or a shard was never allocated here.
        """
        return self.layout.unshard(
            [self._shards[r].slots[slot] for r in range(self.layout.num_shards)]
        )

    def read_shard(self, replica: int, slot: str) -> np.ndarray:
        """A copy of one slot of ``replica``'s shard, float32 ``[layout.shard_size]``.

        A shard never updated here reads as zeros (the optimizer's initial state) and is
        not allocated by the read. Used by checkpoints (``zero_runtime.checkpoint``).

        Raises:
            ValueError: ``replica`` outside ``[0, layout.num_shards)``.
            KeyError: unknown slot name.
        """
        if not 0 <= replica < self.layout.num_shards:
            raise ValueError(f"replica {replica} out of range [0, {self.layout.num_shards})")
        if slot not in self.slot_names:
            raise KeyError(f"unknown optimizer slot {slot!r}; slots: {self.slot_names}")
        with self._lock:
            shard = self._shards.get(replica)
        if shard is None:
            return np.zeros(self.layout.shard_size, np.float32)
        return np.array(shard.slots[slot], np.float32, copy=True)

    def write_shard(self, replica: int, slot: str, values: np.ndarray) -> None:
        """Overwrite one slot of ``replica``'s shard (allocating the shard if needed).

        Args:
            replica: the global replica id.
            slot: the slot name (e.g. ``"momentum"``).
            values: float32 ``[layout.shard_size]`` (padding elements included).

        Raises:
            ValueError: ``replica`` out of range or ``values`` of the wrong shape.
            KeyError: unknown slot name.
            RuntimeError: the shard is inside an update.
        """
        values = _checked_shard(values, self.layout.shard_size, slot)
        if slot not in self.slot_names:
            raise KeyError(f"unknown optimizer slot {slot!r}; slots: {self.slot_names}")
        shard = self.shard(replica)
        if shard.state is not ShardState.READY:
            raise RuntimeError(f"shard {replica} is {shard.state.value}, expected ready")
        shard.slots[slot][:] = values

    def close(self) -> None:
        """Nothing to release (numpy buffers are freed with the object)."""


def _checked_shard(values: np.ndarray, shard_size: int, slot: str) -> np.ndarray:
    """``values`` as float32 ``[shard_size]``; ValueError naming the slot otherwise."""
    values = np.asarray(values, np.float32)
    if values.shape != (shard_size,):
        raise ValueError(
            f"slot {slot!r} shard has shape {values.shape}, the store expects ({shard_size},)"
        )
    return values
