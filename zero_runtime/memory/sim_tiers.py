"""Slot-only tiers, I/O and lock for the what-if simulator (:mod:`.simulate`).

Stand-ins with the interfaces the pool's core uses (:class:`~zero_runtime.memory.core.PoolCore`:
the page table, transitions, placement, prefetcher): the tiers count slots and copy no
bytes, the NVMe "file" reads and writes nothing, I/O jobs complete when a placement would
wait for them (:class:`SimCondition`), and there is one thread, so the lock is a no-op.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from zero_runtime.memory.tiers import SlotTier


class SimFile:
    path = "<simulated NVMe>"
    io_mode = "simulated"

    def pwrite(self, buf: memoryview, offset: int) -> None:
        """Nothing is written."""

    def pread_into(self, buf: memoryview, offset: int) -> None:
        """Nothing is read."""


class SimDevice(SlotTier):
    """The device tier's slots only."""

    is_standin = True
    device_name = "<simulated>"
    description = "device (simulated)"

    def put(self, slot: int, data: np.ndarray) -> None:
        """No bytes."""

    def copy_out(self, slot: int, out: np.ndarray) -> None:
        """No bytes."""

    def close(self) -> None:
        """Nothing to free."""


class SimHost(SlotTier):
    """The host tier's slots, over one scratch page (the transitions' copies land there)."""

    description = "host (simulated)"

    def __init__(self, page_size: int, n_slots: int | None) -> None:
        super().__init__("host", page_size, n_slots)
        self._scratch = bytearray(page_size)
        self._view = np.frombuffer(self._scratch, np.uint8)

    def view(self, slot: int) -> np.ndarray:
        """The scratch page."""
        return self._view

    def buffer(self, slot: int, nbytes: int) -> memoryview:
        """The scratch page's first ``nbytes``."""
        return memoryview(self._scratch)[:nbytes]

    def close(self) -> None:
        """Nothing to free."""


class SimNvme(SlotTier):
    """The NVMe tier's slots; its file reads and writes nothing."""

    def __init__(self, page_size: int, n_slots: int | None) -> None:
        super().__init__("nvme", page_size, n_slots)
        self.file = SimFile()
        self.description = "nvme (simulated)"

    def offset(self, slot: int) -> int:
        """Byte offset of ``slot`` (nothing is there)."""
        return slot * self.page_size

    def close(self) -> None:
        """Nothing to close."""


class SimIo:
    """The I/O scheduler's interface; jobs complete when the placement would wait."""

    def __init__(self) -> None:
        self.queue: collections.deque = collections.deque()
        self.complete = None  # TierTransitions.on_io_complete

    def submit(self, job: Any) -> None:
        """Queue a job."""
        self.queue.append(job)

    def busy(self) -> bool:
        """True while jobs are queued."""
        return bool(self.queue)

    def job_finished(self) -> None:
        """Nothing to count."""

    def drain(self) -> None:
        """Complete every queued job (a read's checksum is the page's: no corruption)."""
        while self.queue:
            job = self.queue.popleft()
            job.crc = job.page.checksum if job.op == "read" else 0
            self.complete(job)

    def add_listener(self, listener: Any) -> None:
        """No listeners in a simulation."""

    def shutdown(self) -> None:
        """Nothing to stop."""


class SimCondition:
    """The pool's lock and condition for one thread: waiting completes the queued I/O."""

    def __init__(self) -> None:
        self.io: SimIo | None = None

    def __enter__(self) -> SimCondition:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        """Complete the queued I/O instead of waiting for it."""
        if self.io is not None:
            self.io.drain()
        return True

    def wait_io(self, pages: object, timeout: float, **wants: bool) -> bool:
        """As :meth:`wait` (``PoolCondition.wait_io``'s signature): complete the queued
        I/O."""
        return self.wait(timeout)

    def notify_io(self, page: object, freed: bool, idle: bool) -> None:
        """Nobody waits."""

    def notify_victims(self) -> None:
        """Nobody waits."""

    def notify_plain(self) -> None:
        """Nobody waits."""

    def notify_all(self) -> None:
        """Nobody waits."""

    notify = notify_all
