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
the host kernels (:class:`~.host_state.HostOptimizerState`). The cut is rounded to a
multiple of :data:`ALIGN_ELEMENTS`, so that TensorFlow's slice of the device part is a view
of the shard, not a copy, and the host part's slice copies only the host fraction.

On an accelerator the two updates run at the same time. A host call that did the host
update itself would hold one of TensorFlow's inter-op threads for its whole duration (a
``tf.numpy_function`` runs synchronously on the executor thread); with one such call per
replica and as many inter-op threads as cores, the device part waited until the host part
was done (TF profiler trace on the 2-core development machine). The update is therefore
two host calls: :meth:`SplitOptimizerState.start_update` hands the host part to the
replica's worker thread and returns at once, the device part runs, and
:meth:`SplitOptimizerState.finish_update`, which depends on the device part, waits for the
worker and returns the host part's new parameters. On a CPU device both parts would share
the same cores, and overlapping them measured slower than running them one after the
other (side by side in one process, interleaved, load 6 on 2 cores: 46.0 vs 42.2 ms per
step on bench/bench_partial_offload.py's 2.1M-parameter model, 202 vs 178 ms on its
10.6M-parameter variant), so there the start call runs the host part itself, before the
device part. The stage 1-2 update (:mod:`.flat_update`) joins the two parts before the
all-gather. Both follow Keras's operation order, so the result is the same as with either
tier alone (``tests/test_partial_offload.py``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import tensorflow as tf

from zero_runtime.optim import kernels
from zero_runtime.optim.device_state import DeviceOptimizerState
from zero_runtime.optim.host_state import HostOptimizerState, _checked_shard
from zero_runtime.optim.layout import FlatLayout


@dataclasses.dataclass(frozen=True)
class ShardSlice:
    """The layout a part store sees: ``shard_size`` elements per replica, ``num_shards``
    replicas (the part stores only read these two fields)."""

    shard_size: int
    num_shards: int


#: The device part's length is a multiple of this many float32 elements (64 bytes,
#: ``kernels.ALIGN_BYTES``, the alignment of TensorFlow's CPU allocations): TensorFlow's
#: ``StridedSlice`` of an aligned prefix of a 1-D tensor shares its buffer
#: (``IsDim0SliceAligned`` in ``tensorflow/core/kernels/ops_util.h``); any other cut copies.
ALIGN_ELEMENTS = kernels.ALIGN_BYTES // 4


def device_elements(shard_size: int, ratio: float) -> int:
    """Elements of a ``shard_size`` shard kept on the device when ``ratio`` of them is
    offloaded: ``round((1 - ratio) * shard_size)`` rounded to the nearest multiple of
    :data:`ALIGN_ELEMENTS` (so at most 8 elements from the exact cut), unless that would
    empty a part the exact cut keeps (small shards); clamped to ``[0, shard_size]``."""
    exact = min(shard_size, max(0, round((1.0 - ratio) * shard_size)))
    aligned = ALIGN_ELEMENTS * round(exact / ALIGN_ELEMENTS)
    return aligned if 0 < aligned < shard_size or aligned == exact else exact


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
        self._on_cpu = tuple(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in devices)
        self._workers = max(1, len(devices))
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future] = {}
        self._pending_lock = threading.Lock()

    def device_on_cpu(self, replica: int) -> bool:
        """True when ``replica``'s device is a CPU (its tensors reach a host call as
        views, no copy); ``replica`` is taken modulo the local replicas, as
        :meth:`DeviceOptimizerState.slots`."""
        return self._on_cpu[replica % len(self._on_cpu)] if self._on_cpu else True

    def start_update(
        self, replica: int, fn: Callable[..., Any], *args: Any, inline: bool = False
    ) -> None:
        """Run ``fn(*args)`` (the host part's update, :meth:`update` inside) on a worker
        thread and return at once; :meth:`finish_update` collects the result. With
        ``inline``, run it here, now (its error raised here), and keep the result for
        :meth:`finish_update`.

        A replica has at most one update in flight: a step whose finish never ran (its
        device part failed) is waited for here first, its outcome dropped, so two updates
        of one shard never overlap. The arrays in ``args`` may be views of TensorFlow
        buffers (``tf.numpy_function`` inputs); a view keeps its buffer alive.

        Raises:
            RuntimeError: the store is closed.
            Exception: with ``inline``, whatever ``fn`` raised.
        """
        with self._pending_lock:
            if self._workers == 0:
                raise RuntimeError("the split optimizer-state store is closed")
            if self._pool is None and not inline:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="zero-twin")
            stale = self._pending.pop(replica, None)
            pool = self._pool
        if stale is not None:
            stale.exception()  # wait; a failed step's error was (or will never be) raised
        if inline:
            future: Future = Future()
            future.set_result(fn(*args))
        else:
            future = pool.submit(fn, *args)
        with self._pending_lock:
            self._pending[replica] = future

    def finish_update(self, replica: int) -> Any:
        """Wait for ``replica``'s update started by :meth:`start_update` and return what
        ``fn`` returned.

        Raises:
            RuntimeError: no update of ``replica`` in flight.
            Exception: whatever ``fn`` raised.
        """
        with self._pending_lock:
            future = self._pending.pop(replica, None)
        if future is None:
            raise RuntimeError(f"no host update of replica {replica} in flight")
        return future.result()

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
        """Wait for the updates in flight, stop the worker threads, release both parts.
        Idempotent."""
        with self._pending_lock:
            pool, self._pool, self._workers = self._pool, None, 0
            self._pending.clear()
        if pool is not None:
            pool.shutdown(wait=True)
        self.device.close()
        self.host.close()
