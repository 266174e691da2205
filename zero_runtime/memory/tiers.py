"""The three tiers: page-sized slots, their free lists, and their storage.

Each tier hands out slot indices from a free list (lowest first) up to its capacity and
tracks used and peak slots. Storage per tier:

- :class:`DeviceTier`: one TensorFlow ``uint8`` tensor per page on the accelerator; on a
  host without a GPU, a budgeted *stand-in* on ``/CPU:0`` (``is_standin`` is True).
- :class:`HostTier`: one anonymous ``mmap`` of ``capacity`` bytes made at construction,
  cut into page-sized numpy views; the OS commits memory on first touch, and no memory is
  allocated per page afterwards. Slots are page-aligned, so O_DIRECT reads and writes use
  them directly.
- :class:`NvmeTier`: slots at ``slot * page_size`` (page-aligned offsets) in one slab
  file (:class:`~zero_runtime.memory.io.NvmeFile`), preallocated: the whole budget at
  start, or each slot before its first write when the tier is unbounded.
"""

from __future__ import annotations

import heapq

import numpy as np

from zero_runtime.memory.errors import PageStateError
from zero_runtime.memory.io import NvmeFile, aligned_buffer


class SlotTier:
    """Slot accounting shared by the tiers.

    Args:
        name: ``"device"``, ``"host"`` or ``"nvme"``.
        page_size: bytes per slot.
        n_slots: number of slots; ``None`` for unbounded.
    """

    def __init__(self, name: str, page_size: int, n_slots: int | None) -> None:
        self.name = name
        self.page_size = page_size
        self.n_slots = n_slots
        self._free: list[int] = []  # heap of released slot indices below _high
        self._high = 0  # slots ever handed out: indices [0, _high)
        self.used = 0  # slots in use
        self.peak = 0  # highest `used` since reset_peak()

    @property
    def capacity_bytes(self) -> int | None:
        """The budget in bytes (whole slots), or ``None`` when unbounded."""
        return None if self.n_slots is None else self.n_slots * self.page_size

    def free_count(self) -> float:
        """Free slots now (``inf`` when unbounded)."""
        return float("inf") if self.n_slots is None else self.n_slots - self.used

    def has_free(self) -> bool:
        """True if :meth:`take` would succeed."""
        return self.n_slots is None or self.used < self.n_slots

    def take(self) -> int:
        """Take the lowest free slot.

        Raises:
            PageStateError: the tier is full (internal error; check :meth:`has_free`).
        """
        if not self.has_free():
            raise PageStateError(f"{self.name} tier has no free slot (internal error)")
        slot = heapq.heappop(self._free) if self._free else self._grow()
        self.used += 1
        self.peak = max(self.peak, self.used)
        return slot

    def _grow(self) -> int:
        self._high += 1
        return self._high - 1

    def release(self, slot: int) -> None:
        """Return ``slot`` to the free list."""
        heapq.heappush(self._free, slot)
        self.used -= 1

    def reset_peak(self) -> None:
        """Start a new peak window at the current use."""
        self.peak = self.used

    def resize(self, n_slots: int) -> None:
        """Set the number of slots (the budget) to ``n_slots`` >= 0.

        Slots in use beyond the new count stay valid; the caller first moves pages out
        until ``used <= n_slots`` (``PagedBufferPool.set_device_budget`` does).
        """
        self.n_slots = int(n_slots)


class DeviceTier(SlotTier):
    """The device tier: pages as TensorFlow ``uint8`` tensors on the accelerator.

    On a host without a GPU this is a stand-in: the pages are tensors on ``/CPU:0`` and
    the budget is enforced only by the pool. ``is_standin`` and ``description`` say so.

    Args:
        page_size: bytes per page.
        capacity_bytes: device budget (bytes); rounded down to whole pages; 0 disables.

    Attributes:
        device_name: the TensorFlow device the pages live on ('/GPU:0' or '/CPU:0').
        is_standin: True when there is no GPU and the tier stands in for one.
        description: one human-readable line, e.g. for the view's tier label.
    """

    def __init__(self, page_size: int, capacity_bytes: int) -> None:
        super().__init__("device", page_size, capacity_bytes // page_size)
        import tensorflow as tf

        self._tf = tf
        gpus = tf.config.list_physical_devices("GPU")
        self.is_standin: bool = not gpus
        self.device_name: str = "/GPU:0" if gpus else "/CPU:0"
        self.description: str = self._describe()
        self._pages: list = [None] * self.n_slots  # slot -> tf.Tensor uint8 [payload]

    def put(self, slot: int, data: np.ndarray) -> None:
        """Store a copy of ``data`` (1-D uint8) as the page in ``slot``."""
        with self._tf.device(self.device_name):
            # Copy first: on CPU, tf.constant may alias an aligned numpy buffer.
            self._pages[slot] = self._tf.identity(self._tf.constant(np.array(data, copy=True)))

    def resize(self, n_slots: int) -> None:
        """Change the budget to ``n_slots`` pages (the page list only grows: slot indices
        handed out before a shrink stay addressable)."""
        super().resize(n_slots)
        if n_slots > len(self._pages):
            self._pages.extend([None] * (n_slots - len(self._pages)))
        self.description = self._describe()

    def _describe(self) -> str:
        if self.is_standin:
            return (
                f"device (CPU stand-in): TensorFlow tensors on /CPU:0, {self.capacity_bytes} "
                f"bytes budget enforced by the pool; no GPU on this host"
            )
        return f"device: TensorFlow tensors on {self.device_name}, {self.capacity_bytes} bytes"

    def get(self, slot: int):  # -> tf.Tensor
        """Return the page tensor in ``slot`` (1-D uint8, the page's payload)."""
        return self._pages[slot]

    def copy_out(self, slot: int, out: np.ndarray) -> None:
        """Copy the page in ``slot`` into ``out`` (1-D uint8 of at least its length)."""
        data = self._pages[slot].numpy()
        out[: data.size] = data

    def release(self, slot: int) -> None:
        """Drop the page tensor and return ``slot`` to the free list."""
        self._pages[slot] = None
        super().release(slot)

    def close(self) -> None:
        """Drop every page tensor."""
        self._pages = [None] * len(self._pages)


class HostTier(SlotTier):
    """The host tier: page-sized slots in one mmap made at construction.

    Args:
        page_size: bytes per page.
        capacity_bytes: host budget (bytes); rounded down to whole pages (>= 1 page).
        pinned: whether pinned (page-locked) memory was requested. Recorded only; it has
            an effect only with a GPU, and this implementation does not page-lock.

    Attributes:
        description: one human-readable line.
    """

    def __init__(self, page_size: int, capacity_bytes: int, pinned: bool = False) -> None:
        super().__init__("host", page_size, capacity_bytes // page_size)
        self.pinned = pinned
        self._mm = aligned_buffer(self.n_slots * page_size)
        self._array = np.frombuffer(self._mm, dtype=np.uint8)  # (n_slots * page_size,)
        self.description = (
            f"host: {self.n_slots} page slots of {page_size} bytes in one anonymous mmap "
            f"(pinned requested: {pinned}; has no effect without a GPU)"
        )

    def view(self, slot: int) -> np.ndarray:
        """The slot's memory as a writable 1-D uint8 array of ``page_size`` bytes."""
        start = slot * self.page_size
        return self._array[start : start + self.page_size]

    def buffer(self, slot: int, nbytes: int) -> memoryview:
        """The first ``nbytes`` of the slot as a writable memoryview (for I/O)."""
        start = slot * self.page_size
        return memoryview(self._mm)[start : start + nbytes]

    def close(self) -> None:
        """Unmap the memory unless arrays handed out still reference it."""
        self._array = np.empty(0, np.uint8)
        try:
            self._mm.close()
        except BufferError:
            pass  # views given to callers keep it alive; freed with the last of them


class NvmeTier(SlotTier):
    """The NVMe tier: page slots in a slab file under ``nvme_path``.

    Args:
        page_size: bytes per page.
        directory: an existing, writable directory.
        capacity_bytes: NVMe budget (bytes), rounded down to whole pages; ``None`` for
            unbounded (limited by the disk).

    Raises:
        NvmePathError: see :class:`~zero_runtime.memory.io.NvmeFile`.

    Attributes:
        file: the slab file.
        description: one human-readable line.
    """

    def __init__(self, page_size: int, directory: str, capacity_bytes: int | None) -> None:
        n_slots = None if capacity_bytes is None else capacity_bytes // page_size
        super().__init__("nvme", page_size, n_slots)
        self.file = NvmeFile(directory, capacity_bytes, page_size)
        if not self.file.preallocated:
            reserved = "not preallocated (no fallocate)"
        elif capacity_bytes is None:
            reserved = "preallocated as slots are first used"
        else:
            reserved = "preallocated"
        self.description = (
            f"nvme: slab file {self.file.path}, {page_size}-byte slots, "
            f"{self.file.io_mode} I/O, budget "
            f"{'unbounded' if capacity_bytes is None else f'{self.capacity_bytes} bytes'}"
            f" ({reserved})"
        )

    def offset(self, slot: int) -> int:
        """Byte offset of ``slot`` in the slab file."""
        return slot * self.page_size

    def close(self) -> None:
        """Close and remove the slab file."""
        self.file.close()
