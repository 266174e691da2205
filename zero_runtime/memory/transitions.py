"""Tier transitions: the one owner of moving a page's bytes from one tier to another.

Terms (page, payload, slot, tier) are defined in :mod:`.page_table`. Each move of a page
is one method of :class:`TierTransitions`, which first asserts the state it leaves
(:meth:`TierTransitions._expect`), then moves the bytes and records the new state through
:meth:`PageTable.transition <zero_runtime.memory.page_table.PageTable.transition>`:

=======================  ==============================  ===============================
method                   page state                      bytes
=======================  ==============================  ===============================
``place``                UNPLACED -> ON_<tier>           zero-filled in the new slot
``device_to_host``       ON_DEVICE -> ON_HOST            synchronous copy (d2h)
``host_to_device``       ON_HOST[_CLEAN] -> ON_DEVICE    synchronous copy (h2d)
``start_page_out``       ON_HOST -> IN_FLIGHT_OUT        write job queued (:mod:`.io`)
``finish_page_out``      IN_FLIGHT_OUT -> ON_NVME/HOST   the write ended (ok / failed)
``start_page_in``        ON_NVME -> IN_FLIGHT_IN         read job queued
``finish_page_in``       IN_FLIGHT_IN -> ON_HOST_CLEAN   the read ended ok (the NVMe
                         or -> ON_NVME                   copy is kept) / failed
``drop_clean``           ON_HOST_CLEAN -> ON_NVME        none: the NVMe copy is current
``dirty``                ON_HOST_CLEAN -> ON_HOST        none: the NVMe copy is dropped
``free``                 any settled -> FREED            slots returned
=======================  ==============================  ===============================

The NVMe jobs run on the I/O scheduler's threads; :meth:`TierTransitions.on_io_complete`
records their end under the pool's lock. ``write_nvme``/``read_nvme`` are the
synchronous NVMe reads and writes of a page's bytes that leave its state unchanged (the
pool's ``read``/``write``), through one page-aligned staging buffer.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

import numpy as np

from zero_runtime.memory.checksum import page_checksum
from zero_runtime.memory.counters import CounterAccumulator
from zero_runtime.memory.errors import (
    NvmeFullError,
    OomSnapshot,
    PageChecksumError,
    PageStateError,
    PagingError,
)
from zero_runtime.memory.io import IoJob, IoScheduler, aligned_buffer, round_up
from zero_runtime.memory.page_table import (
    HOST_STATES,
    RESIDENT,
    PageRecord,
    PageState,
    PageTable,
    TensorEntry,
)
from zero_runtime.memory.tiers import DeviceTier, HostTier, NvmeTier, SlotTier
from zero_runtime.memory.wakeups import PoolCondition

logger = logging.getLogger(__name__)

S = PageState

#: ``snapshot(nbytes, tensor_id, tier, reason)``: the pool's OOM snapshot (reports.py).
SnapshotFn = Callable[[int, str, str, str], OomSnapshot]


class TierTransitions:
    """Moves pages between tiers, one transition per method (see the module doc).

    Not thread-safe except :meth:`on_io_complete`: the pool calls the others under its
    lock (``cond``), which :meth:`on_io_complete` takes from the I/O threads.

    Args:
        table: the page table (the one record of page states).
        tiers: ``{"device", "host", "nvme"}`` -> tier (the NVMe entry a 0-slot stand-in
            without an NVMe tier).
        nvme: the NVMe tier, or None.
        counters: where completed moves, evictions and I/O seconds are counted.
        cond: the pool's condition variable (its lock); a completed NVMe job wakes the
            waiters it concerns (``PoolCondition.notify_io``).
        snapshot: builds the OOM snapshot of an ``NvmeFullError``.

    Attributes:
        io: the I/O scheduler (None without an NVMe tier); its ``_on_complete`` is
            :meth:`on_io_complete` (observers: ``IoScheduler.add_listener``).
    """

    def __init__(
        self,
        table: PageTable,
        tiers: dict[str, SlotTier],
        nvme: NvmeTier | None,
        counters: CounterAccumulator,
        cond: PoolCondition,
        snapshot: SnapshotFn,
    ) -> None:
        self._table = table
        self._tiers = tiers
        self._device: DeviceTier = tiers["device"]  # type: ignore[assignment]
        self._host: HostTier = tiers["host"]  # type: ignore[assignment]
        self._nvme = nvme
        self._counters = counters
        self._cond = cond
        self._snapshot = snapshot
        ps = self._host.page_size
        self._zeros = np.zeros(ps, np.uint8)  # (page_size,) source of zero-filled pages
        self._staging = aligned_buffer(ps)  # page-aligned buffer for synchronous NVMe I/O
        self._staging_arr = np.frombuffer(self._staging, np.uint8)[:ps]
        self.io: IoScheduler | None = None

    def attach_io(self, threads: int, queue_depth: int) -> None:
        """Start the I/O scheduler over the NVMe slab file (an NVMe tier is required)."""
        assert self._nvme is not None
        self.io = IoScheduler(self._nvme.file, threads, queue_depth, self.on_io_complete)

    @property
    def nvme_path(self) -> str:
        """The slab file's path ('' without an NVMe tier), for error messages."""
        return self._nvme.file.path if self._nvme is not None else ""

    def io_busy(self) -> bool:
        """True while an NVMe job is queued or running."""
        return self.io is not None and self.io.busy()

    # --- guard --------------------------------------------------------------------------
    @staticmethod
    def _expect(page: PageRecord, state: PageState, move: str) -> None:
        if page.state is not state:
            raise PageStateError(
                f"{move} of page {page.index} of {page.tensor_id!r} needs {state.name}, "
                f"the page is {page.state.name} (internal error)"
            )

    # --- transitions --------------------------------------------------------------------
    def hop(self, page: PageRecord, dst: str, slot: int, jobs: list[IoJob], evicting: bool) -> None:
        """Start (or do) the one move of ``page`` into ``slot`` of tier ``dst`` that its
        state allows; the slot goes back to its tier if the move fails before taking it.

        Raises:
            PageStateError: no move leads from the page's state to ``dst``.
        """
        state = page.state
        try:
            if state is S.UNPLACED:
                self.place(page, dst, slot)
            elif state is S.ON_DEVICE and dst == "host":
                self.device_to_host(page, slot, evicting)
            elif state in HOST_STATES and dst == "device":
                self.host_to_device(page, slot)
            elif state is S.ON_HOST and dst == "nvme":
                self.start_page_out(page, slot, jobs, evicting)
            elif state is S.ON_NVME and dst == "host":
                self.start_page_in(page, slot, jobs)
            else:
                raise PageStateError(
                    f"no move from {state.name} to tier {dst!r} for page {page.index} of "
                    f"{page.tensor_id!r} (internal error)"
                )
        except BaseException:
            if page.slots.get(dst) != slot:  # the transition did not take the slot
                self._tiers[dst].release(slot)
            raise

    def place(self, page: PageRecord, dst: str, slot: int) -> None:
        """UNPLACED -> ON_<dst>: the page's first slot, zero-filled."""
        self._expect(page, S.UNPLACED, "place")
        self._table.transition(page, RESIDENT[dst], slot)
        if page.external:  # a reservation: the slot is counted, no bytes are stored
            return
        if page.state is S.ON_DEVICE:
            self._device.put(page.slots["device"], self._zeros[: page.payload])
        elif page.state is S.ON_HOST:
            self._host.view(page.slots["host"])[: page.payload] = 0
        else:
            self.write_nvme(page, self._zeros[: page.payload])

    def device_to_host(self, page: PageRecord, slot: int, evicting: bool) -> None:
        """ON_DEVICE -> ON_HOST (a synchronous copy; counted as an eviction if so)."""
        self._expect(page, S.ON_DEVICE, "device -> host")
        self._device.copy_out(page.slots["device"], self._host.view(slot))
        self._table.transition(page, S.ON_HOST, slot)
        if evicting:
            self._counters.add("evictions")

    def host_to_device(self, page: PageRecord, slot: int) -> None:
        """ON_HOST or ON_HOST_CLEAN -> ON_DEVICE (a synchronous copy; a clean page's
        NVMe copy is dropped with its host slot)."""
        if page.state is not S.ON_HOST_CLEAN:
            self._expect(page, S.ON_HOST, "host -> device")
        self._device.put(slot, self._host.view(page.slots["host"])[: page.payload])
        self._table.transition(page, S.ON_DEVICE, slot)

    def drop_clean(self, page: PageRecord, evicting: bool) -> None:
        """ON_HOST_CLEAN -> ON_NVME: the page's NVMe copy is current, so its host slot is
        returned with no write (counted as ``h2n_clean``, and as an eviction if so)."""
        self._expect(page, S.ON_HOST_CLEAN, "clean eviction")
        self._table.transition(page, S.ON_NVME)
        if evicting:
            self._counters.add("evictions")

    def hand_over(self, source: PageRecord, target: PageRecord) -> None:
        """Fork one clean page: ``source`` keeps only its NVMe copy (ON_HOST_CLEAN ->
        ON_NVME, counted as ``h2n_clean``: its host copy leaves with no write) and
        ``target`` (UNPLACED) takes the host copy (-> ON_HOST, dirty: it has no NVMe
        copy of its own). No I/O; the bytes are copied only when the host tier hands
        ``target`` another slot than the one ``source`` gave back."""
        self._expect(source, S.ON_HOST_CLEAN, "fork")
        self._expect(target, S.UNPLACED, "fork")
        old = source.slots["host"]
        self._table.transition(source, S.ON_NVME)
        slot = self._host.take()
        try:
            self._table.transition(target, S.ON_HOST, slot)
        except BaseException:
            self._host.release(slot)
            raise
        if slot != old:  # the bytes are still in the old slot: nothing ran in between
            self._host.view(slot)[: target.payload] = self._host.view(old)[: target.payload]

    def dirty(self, page: PageRecord) -> None:
        """Before a write to a page on the host: a clean page's NVMe copy stops being
        current, so its NVMe slot is returned (ON_HOST_CLEAN -> ON_HOST); any other state
        is left as it is."""
        if page.state is S.ON_HOST_CLEAN:
            self._table.transition(page, S.ON_HOST)

    def reclaim_nvme(self, n: int) -> int:
        """Return up to ``n`` NVMe slots held by clean pages' copies (those pages become
        dirty: their host copy stays and is written again when evicted). For an NVMe tier
        whose budget is full of such copies. Returns the slots freed. O(pages)."""
        freed = 0
        for page in self._table.pages():
            if freed >= n:
                break
            if page.state is S.ON_HOST_CLEAN:
                self.dirty(page)
                freed += 1
        return freed

    def start_page_out(
        self, page: PageRecord, slot: int, jobs: list[IoJob], evicting: bool
    ) -> None:
        """ON_HOST -> IN_FLIGHT_OUT: queue the write of the page into NVMe ``slot``."""
        self._expect(page, S.ON_HOST, "page-out")
        self._table.transition(page, S.IN_FLIGHT_OUT, slot)
        self._submit("write", page, page.slots["host"], slot, jobs, evicting)

    def start_page_in(self, page: PageRecord, slot: int, jobs: list[IoJob]) -> None:
        """ON_NVME -> IN_FLIGHT_IN: queue the read of the page into host ``slot``."""
        self._expect(page, S.ON_NVME, "page-in")
        self._table.transition(page, S.IN_FLIGHT_IN, slot)
        self._submit("read", page, slot, page.slots["nvme"], jobs, False)

    def finish_page_out(self, job: IoJob) -> None:
        """IN_FLIGHT_OUT -> ON_NVME (written; CRC-32C recorded) or back to ON_HOST (failed:
        ``job.error`` becomes the pool's error naming the page and file)."""
        page = job.page
        self._expect(page, S.IN_FLIGHT_OUT, "end of page-out")
        if job.error is None:
            page.checksum = job.crc
            self._table.transition(page, S.ON_NVME)
            if job.evicting:
                self._counters.add("evictions")
        else:
            self._table.transition(page, S.ON_HOST)  # the page stays where it was
            job.error = self.write_error(page, job.offset, job.error)

    def finish_page_in(self, job: IoJob) -> None:
        """IN_FLIGHT_IN -> ON_HOST_CLEAN (read, CRC checked; the NVMe copy is kept, so an
        eviction before the next write costs no write) or back to ON_NVME (an I/O error or
        a checksum mismatch, set as ``job.error``)."""
        page = job.page
        self._expect(page, S.IN_FLIGHT_IN, "end of page-in")
        if job.error is None and job.crc != page.checksum:
            job.error = PageChecksumError(
                self.nvme_path,
                job.offset,
                page.tensor_id,
                page.index,
                page.checksum or 0,
                job.crc or 0,
            )
        elif job.error is not None:
            err = PagingError(
                f"I/O error reading page {page.index} of tensor {page.tensor_id!r} "
                f"from {self.nvme_path} at offset {job.offset}: {job.error}"
            )
            err.__cause__ = job.error
            job.error = err
        if job.error is None:
            self._table.transition(page, S.ON_HOST_CLEAN)
            self._table.touch(page)
        else:
            self._table.transition(page, S.ON_NVME)  # the page stays where it was

    def free(self, entry: TensorEntry) -> None:
        """Every page of ``entry`` -> FREED (its slots returned); the entry is removed."""
        for page in entry.pages:
            if page.state is not S.FREED:
                self._table.transition(page, S.FREED)
        self._table.remove(entry.tensor_id)

    # --- NVMe jobs ----------------------------------------------------------------------
    def _submit(
        self,
        op: str,
        page: PageRecord,
        host_slot: int,
        nvme_slot: int,
        jobs: list[IoJob],
        evicting: bool,
    ) -> None:
        assert self.io is not None and self._nvme is not None
        job = IoJob(
            op,
            page,
            self._host.buffer(host_slot, round_up(page.payload)),
            self._nvme.offset(nvme_slot),
            page.payload,
            evicting=evicting,
        )
        jobs.append(job)
        self.io.submit(job)

    def on_io_complete(self, job: IoJob) -> None:
        """Record a finished NVMe job (runs on an I/O thread; takes the pool's lock)."""
        with self._cond:
            self._counters.add("io_seconds", job.seconds)
            if job.op == "write":
                self.finish_page_out(job)
            else:
                self.finish_page_in(job)
            if job.error is not None:
                logger.warning("paging I/O failed: %s", job.error)
            job.done = True
            assert self.io is not None
            self.io.job_finished()
            freed = job.op == "write" or job.error is not None  # a failed read frees too
            self._cond.notify_io(job.page, freed, idle=not self.io.busy())

    def write_error(self, page: PageRecord, offset: int, exc: BaseException) -> Exception:
        """The pool's error for a failed NVMe write of ``page`` (``NvmeFullError`` on a
        full disk, else ``PagingError``), caused by ``exc``."""
        where = f"page {page.index} of tensor {page.tensor_id!r} at offset {offset}"
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            snapshot = self._snapshot(
                self._host.page_size,
                page.tensor_id,
                "nvme",
                "the disk under nvme_path is full (ENOSPC) before the NVMe budget was reached",
            )
            err: Exception = NvmeFullError(snapshot, self.nvme_path, errno.ENOSPC, where)
        else:
            err = PagingError(f"I/O error writing {where} to {self.nvme_path}: {exc}")
        err.__cause__ = exc
        return err

    # --- synchronous NVMe access (no state change) --------------------------------------
    def write_nvme(self, page: PageRecord, data: np.ndarray) -> None:
        """Write ``data`` (1-D uint8, the payload) to the page's NVMe slot; set its CRC-32C."""
        assert self._nvme is not None
        n = page.payload
        self._staging_arr[:n] = data
        xfer = round_up(n)
        self._staging_arr[n:xfer] = 0
        offset = self._nvme.offset(page.slots["nvme"])
        start = time.perf_counter()
        try:
            crc = page_checksum(memoryview(self._staging)[:n])
            self._nvme.file.pwrite(memoryview(self._staging)[:xfer], offset)
        except OSError as exc:
            raise self.write_error(page, offset, exc) from exc
        finally:
            self._counters.add("io_seconds", time.perf_counter() - start)
        page.checksum = crc

    def read_nvme(self, page: PageRecord, out: np.ndarray) -> None:
        """Read the page's NVMe copy into ``out`` (1-D uint8, payload), checking its CRC-32C."""
        assert self._nvme is not None
        n = page.payload
        offset = self._nvme.offset(page.slots["nvme"])
        start = time.perf_counter()
        try:
            self._nvme.file.pread_into(memoryview(self._staging)[: round_up(n)], offset)
            crc = page_checksum(memoryview(self._staging)[:n])
        except OSError as exc:
            raise PagingError(
                f"I/O error reading page {page.index} of tensor {page.tensor_id!r} from "
                f"{self.nvme_path} at offset {offset}: {exc}"
            ) from exc
        finally:
            self._counters.add("io_seconds", time.perf_counter() - start)
        if crc != page.checksum:
            raise PageChecksumError(
                self._nvme.file.path, offset, page.tensor_id, page.index, page.checksum or 0, crc
            )
        out[:] = self._staging_arr[:n]

    def close(self) -> None:
        """Release the staging buffer (after the I/O threads stopped)."""
        self._staging_arr = np.empty(0, np.uint8)
        try:
            self._staging.close()
        except BufferError:
            pass
