"""PagedBufferPool: tensors stored as fixed-size pages over device, host and NVMe tiers.

Terms (page, payload, slot, tier) are defined in :mod:`zero_runtime.memory.page_table`.

The pool is a façade over parts with one owner each (``docs/design/paging.md``):

- :mod:`.page_table`: the one record of every page and its state machine;
- :mod:`.transitions`: every page move between tiers, one transition per method;
- :mod:`.placement`: the placement loop (target tier, victims, out-of-memory);
- :mod:`.io`: the slab file and the I/O scheduler (threads, queue depth);
- :mod:`.prefetch`: the prefetch queue and its thread;
- :mod:`.access`: a tensor's bytes read and written where its pages are;
- :mod:`.reports`: placement, usage and OOM snapshots (read only).

Threads and locking. One lock guards the page table, the tiers and the counters; public
methods hold it except while they wait, and they wait only on the condition variable tied
to it (:class:`~zero_runtime.memory.wakeups.PoolCondition`: a finished job, a release or an
unpin wakes only the waiters it concerns), so an I/O thread can always take it to finish a
job. I/O threads do only pread, pwrite and CRC-32C on buffers that the page table has
reserved for the job (the page is ``IN_FLIGHT_*``); the completion is then recorded under
the lock (:meth:`TierTransitions.on_io_complete`). ``prefetch`` hands tensors to one background
thread that runs the same placement loop as ``acquire`` but yields whenever a caller is
short of slots and never raises out-of-memory.

Where the bytes go. Device <-> host moves are synchronous copies under the lock. Host <->
NVMe moves are asynchronous jobs (at most ``queue_depth`` at the I/O threads). ``read``
and ``write`` of a page that lives on NVMe do a synchronous pread/pwrite through one
page-aligned staging buffer under the lock: they are not the paging hot path.

Lifecycle (:class:`PoolState`): OPEN -> CLOSING (:meth:`PagedBufferPool.close`: prefetch
stopped, I/O drained, threads joined) -> CLOSED (pages freed, memory unmapped, the slab
file removed). Every public method but ``close`` raises ``PoolClosedError`` once closing.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import psutil

from zero_runtime.memory.core import PoolCore
from zero_runtime.memory.counters import PageCounters, PoolTotals
from zero_runtime.memory.errors import PoolClosedError
from zero_runtime.memory.io import IoJob
from zero_runtime.memory.page_table import (
    KINDS,
    LEVEL,
    TIER_ORDER,
    PageRecord,
    TensorEntry,
)
from zero_runtime.memory.placement import WAIT_SLICE_SECONDS
from zero_runtime.memory.pool_hints import PoolHints, PoolViews
from zero_runtime.memory.pool_hints import check_int as _check_int
from zero_runtime.memory.reports import (
    MAX_HOLDERS,
    PageInfo,
    TensorInfo,
)
from zero_runtime.memory.tiers import DeviceTier, HostTier, NvmeTier, SlotTier
from zero_runtime.memory.wakeups import PoolCondition

if TYPE_CHECKING:
    import tensorflow as tf

logger = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 4 << 20  # bytes (4 MiB)
MIN_PAGE_SIZE = 64 << 10  # bytes (64 KiB)

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "LEVEL",
    "MAX_HOLDERS",
    "MIN_PAGE_SIZE",
    "TIER_ORDER",
    "WAIT_SLICE_SECONDS",
    "PageInfo",
    "PagedBufferPool",
    "PoolConfig",
    "PoolState",
    "TensorInfo",
]


class PoolState(enum.Enum):
    """Lifecycle of a pool. OPEN: in use. CLOSING: :meth:`PagedBufferPool.close` stops
    the prefetcher and drains the I/O; public methods raise ``PoolClosedError``. CLOSED:
    no page, thread, mapping, descriptor or file of the pool remains."""

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """A pool's sizes and options, validated (the arguments of :class:`PagedBufferPool`).

    Attributes:
        host_budget_bytes: host tier capacity (bytes); rounded down to whole pages, at
            least one page, at most ``psutil.virtual_memory().available``. Reserved as
            one mmap at construction (committed by the OS on first touch).
        page_size_bytes: bytes per page; a power of two >= 65536. Default 4 MiB.
        device_budget_bytes: device tier capacity (bytes), rounded down to whole pages;
            ``None`` or 0 disables the device tier. Without a GPU the tier is a stand-in
            on the CPU (see :class:`~zero_runtime.memory.tiers.DeviceTier`).
        nvme_path: an existing writable directory for the NVMe slab file; ``None``
            disables the NVMe tier.
        nvme_budget_bytes: NVMe tier capacity (bytes), rounded down to whole pages;
            ``None`` for unbounded. Refused if larger than the disk's free space;
            preallocated on disk at start (``posix_fallocate``), so a disk that fills up
            later cannot fail a page-out. An unbounded tier preallocates each slot before
            its first write, and a full disk then raises :class:`NvmeFullError`.
        io_threads: I/O threads for the NVMe tier (default 4).
        queue_depth: maximum NVMe page reads/writes outstanding at once (default 8).
        pin_host_memory: request page-locked host memory; recorded only (no effect
            without a GPU).

    Raises:
        ValueError: a bad page size, budget, thread count or queue depth; a host budget
            above the available memory (the message gives both numbers);
            ``nvme_budget_bytes`` without ``nvme_path``.
    """

    host_budget_bytes: int
    page_size_bytes: int = DEFAULT_PAGE_SIZE
    device_budget_bytes: int | None = None
    nvme_path: str | None = None
    nvme_budget_bytes: int | None = None
    io_threads: int = 4
    queue_depth: int = 8
    pin_host_memory: bool = False

    def __post_init__(self) -> None:
        ps = _check_int("page_size_bytes", self.page_size_bytes, 1)
        if ps < MIN_PAGE_SIZE or ps & (ps - 1):
            raise ValueError(
                f"page_size_bytes must be a power of two >= {MIN_PAGE_SIZE} (64 KiB), "
                f"got {self.page_size_bytes}"
            )
        host = _check_int("host_budget_bytes", self.host_budget_bytes, ps)
        available = psutil.virtual_memory().available
        if host > available:
            raise ValueError(
                f"host_budget_bytes={host} exceeds the memory available on this machine "
                f"({available} bytes, psutil.virtual_memory().available); lower the budget"
            )
        if self.device_budget_bytes is not None:
            _check_int("device_budget_bytes", self.device_budget_bytes, 0)
        if self.nvme_budget_bytes is not None:
            if self.nvme_path is None:
                raise ValueError("nvme_budget_bytes was given without nvme_path")
            _check_int("nvme_budget_bytes", self.nvme_budget_bytes, ps)
        _check_int("io_threads", self.io_threads, 1)
        _check_int("queue_depth", self.queue_depth, 1)

    @property
    def device_bytes(self) -> int:
        """The device budget in bytes (0: no device tier)."""
        return int(self.device_budget_bytes or 0)


def _make_tiers(config: PoolConfig) -> tuple[dict[str, SlotTier], NvmeTier | None]:
    """The three tiers (a 0-slot NVMe stand-in without ``nvme_path``) and the NVMe tier."""
    ps = int(config.page_size_bytes)
    device_tier = DeviceTier(ps, config.device_bytes)
    host_tier = HostTier(ps, int(config.host_budget_bytes), pinned=config.pin_host_memory)
    nvme = None
    if config.nvme_path is not None:
        try:
            nvme = NvmeTier(ps, config.nvme_path, config.nvme_budget_bytes)
        except BaseException:
            host_tier.close()
            raise
    nvme_slot: SlotTier = nvme if nvme is not None else SlotTier("nvme", ps, 0)
    return {"device": device_tier, "host": host_tier, "nvme": nvme_slot}, nvme


def _new_entry(
    tensor_id: str, shape: Sequence[int], dtype: object, kind: str, page_size: int
) -> TensorEntry:
    """A validated tensor entry with its pages UNPLACED (see ``allocate``)."""
    dt = np.dtype(dtype)
    if dt.hasobject or dt.itemsize == 0:
        raise ValueError(f"dtype {dt} cannot be paged (object or zero-size items)")
    shp = tuple(int(d) for d in shape)
    if any(d < 0 for d in shp):
        raise ValueError(f"shape must be non-negative, got {shp}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    nbytes = math.prod(shp) * dt.itemsize
    ps = page_size
    pages = [PageRecord(tensor_id, i, min(ps, nbytes - i * ps)) for i in range(-(-nbytes // ps))]
    return TensorEntry(tensor_id, shp, dt, kind, nbytes, pages)


def _payload(entry: TensorEntry, array: object) -> np.ndarray:
    """``array`` as the tensor's bytes, 1-D uint8 ``[nbytes]`` (see ``write``)."""
    arr = np.asarray(array)
    if arr.shape != entry.shape:
        raise ValueError(
            f"write to {entry.tensor_id!r}: array shape {arr.shape} != tensor shape {entry.shape}"
        )
    return np.ascontiguousarray(arr, dtype=entry.dtype).reshape(-1).view(np.uint8)


def _check_tier(tier: str, allowed: Sequence[str], device_slots: int, has_nvme: bool) -> None:
    if tier not in allowed:
        raise ValueError(f"tier must be one of {tuple(allowed)}, got {tier!r}")
    if tier == "device" and device_slots == 0:
        raise ValueError("the device tier is disabled (device_budget_bytes is 0 or None)")
    if tier == "nvme" and not has_nvme:
        raise ValueError("the NVMe tier is disabled (no nvme_path)")


def _build_core(
    config: PoolConfig, check_open: Callable[[], None], closed: Callable[[], bool]
) -> PoolCore:
    """Make the tiers and the core over them (the slab file and I/O threads with
    ``nvme_path``), logging one line that describes the tiers."""
    tiers, nvme = _make_tiers(config)
    core = PoolCore.assemble(tiers, nvme, PoolCondition(), check_open, closed)
    if nvme is not None:
        core.moves.attach_io(int(config.io_threads), int(config.queue_depth))
    described = [t.description for t in tiers.values() if t is not tiers["nvme"]]
    described.append(nvme.description if nvme is not None else "nvme: disabled")
    logger.info(
        "paged buffer pool: %d-byte pages; %s", config.page_size_bytes, "; ".join(described)
    )
    return core


class PagedBufferPool(PoolHints, PoolViews):
    """Tensors stored as fixed-size pages on three tiers, paged between them on demand.

    A tensor is allocated with a shape, a dtype and a ``kind`` label, and lives as
    ``ceil(nbytes / page_size)`` pages. ``acquire`` brings its pages to the host or device
    tier and pins them until ``release``; when a tier is full, unpinned pages of other
    tensors move one tier down, least recently used first, or by reuse distance when
    :meth:`set_access_order` gave the step's access order. ``prefetch`` schedules the
    moves ahead of use. The pool is a context manager; :meth:`close` removes its files.
    The placement hints (prefetch, evict, pin, access order, device budget) are in
    :class:`~.pool_hints.PoolHints`, the read-only views (usage, traces) in
    :class:`~.pool_hints.PoolViews`.

    Args: the fields of :class:`PoolConfig` (bytes; page size a power of two >= 64
    KiB, default 4 MiB; ``device_budget_bytes``/``nvme_path`` None disable their tier;
    ``io_threads`` 4 and ``queue_depth`` 8 by default), by keyword.

    Raises:
        ValueError: a bad page size, budget, thread count or queue depth; a host budget
            above the available memory (the message gives both numbers);
            ``nvme_budget_bytes`` without ``nvme_path``.
        NvmePathError: ``nvme_path`` is missing, not a directory, read-only, or has less
            free space than ``nvme_budget_bytes``.
    """

    def __init__(
        self,
        *,
        host_budget_bytes: int,
        page_size_bytes: int = DEFAULT_PAGE_SIZE,
        device_budget_bytes: int | None = None,
        nvme_path: str | None = None,
        nvme_budget_bytes: int | None = None,
        io_threads: int = 4,
        queue_depth: int = 8,
        pin_host_memory: bool = False,
    ) -> None:
        config = PoolConfig(
            host_budget_bytes,
            page_size_bytes,
            device_budget_bytes,
            nvme_path,
            nvme_budget_bytes,
            io_threads,
            queue_depth,
            pin_host_memory,
        )
        self._page_size = int(page_size_bytes)
        self._state = PoolState.OPEN
        self._p = _build_core(config, self._check_open, lambda: self.closed)
        self._p.trace.enabled = False  # off until set_tracing(True): no cost for others
        self._finalizer = weakref.finalize(
            self, self._p.nvme.close if self._p.nvme is not None else (lambda: None)
        )

    @property
    def page_size(self) -> int:
        """Bytes per page."""
        return self._page_size

    @property
    def nvme_io_mode(self) -> str | None:
        """``"direct"`` (O_DIRECT) or ``"buffered"``, detected at start; ``None`` without NVMe."""
        return self._p.nvme.file.io_mode if self._p.nvme else None

    @property
    def nvme_file(self) -> str | None:
        """Path of the NVMe slab file, or ``None`` without an NVMe tier."""
        return self._p.nvme.file.path if self._p.nvme else None

    @property
    def device_tier(self) -> DeviceTier:
        """The device tier (see ``is_standin`` and ``description``)."""
        return self._p.device

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has begun (CLOSING or CLOSED)."""
        return self._state is not PoolState.OPEN

    @property
    def state(self) -> PoolState:
        """The :class:`PoolState`."""
        return self._state

    def add_io_listener(self, listener: Callable[[IoJob], None]) -> bool:
        """Observe every finished NVMe job (:meth:`IoScheduler.add_listener`): telemetry
        turns them into page moves and I/O intervals. Returns False (nothing registered)
        for a pool without an NVMe tier."""
        io = self._p.moves.io
        if io is None:
            return False
        io.add_listener(listener)
        return True

    def __enter__(self) -> PagedBufferPool:
        self._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop prefetching, finish outstanding I/O, free every page, remove the NVMe file.

        Idempotent. Arrays returned by ``acquire`` should not be used afterwards.
        """
        with self._p.cond:
            if self._state is not PoolState.OPEN:
                return
            self._state = PoolState.CLOSING
            self._p.cond.notify_all()
        self._p.shutdown()
        with self._p.cond:
            assert self._state is PoolState.CLOSING, self._state
            self._p.release_all()
            self._state = PoolState.CLOSED
        self._finalizer()

    def allocate(
        self,
        tensor_id: str,
        shape: Sequence[int],
        dtype: np.dtype | type | str,
        kind: str = "other",
        tier: str = "host",
    ) -> None:
        """Create a zero-filled tensor of ``shape`` and ``dtype`` with its pages on ``tier``.

        Args:
            tensor_id: a new identifier.
            shape: the logical shape (non-negative ints).
            dtype: any numpy dtype without Python objects.
            kind: accounting label, one of 'param', 'grad', 'optimizer', 'activation',
                'other'.
            tier: 'device', 'host' or 'nvme'. Other tensors' pages are evicted to make
                room if needed.

        Raises:
            ValueError: duplicate id, bad shape/dtype/kind, or a disabled tier.
            PoolOutOfMemoryError: the pages cannot be placed (nothing is allocated).
            NvmeFullError: the disk filled up while pages moved to NVMe.
        """
        entry = _new_entry(tensor_id, shape, dtype, kind, self._page_size)
        with self._p.cond:
            self._check_open()
            self._check_tier(tier, TIER_ORDER)
            self._p.allocate(entry, tier)
            self._trace("A", tensor_id, entry.nbytes, entry.dtype.itemsize, kind, tier)

    def fork(self, source_id: str, tensor_id: str) -> bool:
        """Make ``tensor_id`` a new tensor with ``source_id``'s shape, dtype, kind and
        bytes, on the host, while ``source_id`` keeps its bytes on NVMe: the copy-on-write
        step of shadow paging, with no page write and no room to make.

        ``source_id``'s pages are brought to the host (a read of the ones on NVMe only,
        waited for as :meth:`acquire` waits); each page that still has its NVMe copy
        (read from NVMe and not written since: a *clean* page, docs/design/paging.md) gives its
        host slot to the new tensor's page (dirty: written when evicted) and keeps its NVMe
        slot. Writes to the new tensor then never touch the source.

        Args:
            source_id: an allocated tensor, not acquired.
            tensor_id: a new identifier.

        Returns:
            True when forked. False, with nothing changed, when ``source_id`` is acquired
            or has a page written on the host since it was last on NVMe (it has no NVMe
            copy to keep: allocate and copy instead).

        Raises:
            KeyError: unknown ``source_id``.
            ValueError: ``tensor_id`` exists, or ``source_id`` is a reservation.
            PoolOutOfMemoryError: ``source_id`` cannot be brought to the host.
            PageChecksumError: a page read from NVMe is corrupt (it stays on NVMe).
        """
        with self._p.cond:
            source = self._bytes_entry(source_id, "fork")
            entry = _new_entry(tensor_id, source.shape, source.dtype, source.kind, self._page_size)
            done = self._p.fork(source, entry)
            if done:
                self._trace("K", source_id, tensor_id)
            return done

    def reserve(
        self, tensor_id: str, shape: Sequence[int], dtype: np.dtype | type | str, kind: str
    ) -> None:
        """Account a device tensor whose bytes live outside the pool.

        A stage-3 shard on the device tier is a TensorFlow variable on its replica's
        device (read and assigned inside the step, no host call); the pool still counts
        it: the reservation takes whole pages on the device tier (``usage``, ``describe``,
        placement and OOM reports, the budget), pinned there (never evicted, so a device
        budget below the reservations cannot be applied), and stores no bytes: ``read``,
        ``write`` and ``acquire`` refuse it. :meth:`free` ends it.

        Args:
            tensor_id: a new identifier.
            shape: the logical shape (non-negative ints).
            dtype: any numpy dtype without Python objects.
            kind: accounting label, one of 'param', 'grad', 'optimizer', 'activation',
                'other'.

        Raises:
            ValueError: duplicate id, bad shape/dtype/kind, or no device tier.
            PoolOutOfMemoryError: the pages do not fit the device tier (nothing is
                reserved).
        """
        entry = _new_entry(tensor_id, shape, dtype, kind, self._page_size)
        entry.external = True
        for page in entry.pages:
            page.external = True
        with self._p.cond:
            self._check_open()
            self._check_tier("device", ("device",))
            self._p.allocate(entry, "device")
            self._p.pin(entry)
            self._trace("A", tensor_id, entry.nbytes, entry.dtype.itemsize, kind, "device")

    def free(self, tensor_id: str) -> None:
        """Free a tensor's pages on every tier (waiting for its I/O in flight); a
        reservation's pin is dropped first.

        Raises:
            KeyError: unknown tensor.
            ValueError: the tensor is pinned or acquired.
        """
        with self._p.cond:
            entry = self._entry(tensor_id)
            if entry.external and entry.pin_count == 1 and entry.acquire_count == 0:
                self._p.unpin(entry)
            self._p.free(entry)
            self._trace("F", tensor_id)

    def write(self, tensor_id: str, array: np.ndarray) -> None:
        """Overwrite a tensor's contents where its pages are (no page moves).

        A copy handed out by a multi-page ``acquire(writable=True)`` is not updated and
        is written back over these contents at its release.

        Args:
            tensor_id: an allocated tensor.
            array: array-like of the tensor's shape; cast to its dtype as numpy assignment
                does.

        Raises:
            KeyError: unknown tensor.
            ValueError: shape mismatch.
            PagingError: an I/O error writing an NVMe page.
        """
        with self._p.cond:
            entry = self._bytes_entry(tensor_id, "write")
            data = _payload(entry, array)
            self._p.use(entry, lambda: self._p.access.write(entry, data))
            self._trace("W", tensor_id)

    def read(self, tensor_id: str) -> np.ndarray:
        """Return a copy of a tensor's contents (no page moves).

        Returns:
            A new array of the tensor's shape and dtype.

        Raises:
            KeyError: unknown tensor.
            PageChecksumError: an NVMe page does not match its checksum.
            PagingError: an I/O error reading an NVMe page.
        """
        with self._p.cond:
            entry = self._bytes_entry(tensor_id, "read")
            out = self._p.use(entry, lambda: self._p.access.read(entry))
            self._trace("D", tensor_id)
            return out

    def acquire(
        self, tensor_id: str, tier: str = "host", writable: bool = False
    ) -> np.ndarray | tf.Tensor:
        """Bring a tensor's pages to ``tier``, pin them, and return the tensor.

        Waits only for pages not yet resident on ``tier``; that wait is counted in
        ``stall_seconds``. Each page counts as a prefetch hit (already on ``tier`` or on
        its way there) or a miss (brought in by this call).

        Args:
            tensor_id: an allocated tensor.
            tier: 'host' (returns a numpy array) or 'device' (returns a ``tf.Tensor`` on
                the device tier's device).
            writable: host only. The array may be modified; changes are in the pool after
                the last :meth:`release`. Otherwise the array is read-only.

        Returns:
            'host': an ``np.ndarray`` of the tensor's shape and dtype, a view of the page
            of a one-page tensor, else a copy (``nbytes`` outside the tier budgets), valid
            until the matching :meth:`release`. 'device': a ``tf.Tensor`` assembled from
            the pages (a transient ``nbytes`` device buffer when multi-page).

        Raises:
            KeyError: unknown tensor.
            ValueError: bad tier, ``writable`` with 'device', or already acquired on the
                other tier.
            PoolOutOfMemoryError: the tensor cannot be placed on ``tier``.
            NvmeFullError: the disk filled up while evicting to make room.
            PageChecksumError: a page read from NVMe is corrupt (it stays on NVMe).
        """
        with self._p.cond:
            entry = self._bytes_entry(tensor_id, "acquire")
            self._check_tier(tier, ("host", "device"))
            result = self._p.acquire(entry, tier, writable)
            self._trace("Q", tensor_id, tier)
            return result

    def acquire_pages(self, tensor_id: str, writable: bool = False) -> list[np.ndarray]:
        """Bring a tensor's pages to the host, pin them, and return a view of each page.

        :meth:`acquire` on the host hands out one array: for a multi-page tensor a copy
        of its pages, made at the acquire and (``writable``) copied back at the release.
        A caller that can work page by page (the NVMe optimizer-state store's
        sub-groups) takes the pages' own memory instead: no copy either way. Waits,
        prefetch hits and misses, pins and the trace are as for ``acquire(tensor_id,
        'host', writable)``; release with :meth:`release`.

        Args:
            tensor_id: an allocated tensor.
            writable: the views may be written (what is written is in the pool at once;
                the pages' NVMe copies are dropped as stale now). Otherwise read-only.

        Returns:
            One 1-D array of the tensor's dtype per page, in page order: page ``i`` holds
            flat elements ``[i * E, i * E + len(view))``, ``E = page_size_bytes //
            itemsize`` (the last page's view is shorter when the tensor ends inside it).
            Valid until the matching :meth:`release`.

        Raises:
            KeyError: unknown tensor.
            ValueError: acquired on the device, or acquired by :meth:`acquire` (an array
                copy and page views of one tensor would overwrite each other).
            PoolOutOfMemoryError: the tensor cannot be placed on the host.
            NvmeFullError: the disk filled up while evicting to make room.
            PageChecksumError: a page read from NVMe is corrupt (it stays on NVMe).
        """
        with self._p.cond:
            entry = self._bytes_entry(tensor_id, "acquire")
            result = self._p.acquire(entry, "host", writable, as_pages=True)
            self._trace("Q", tensor_id, "host")
            return result

    def release(self, tensor_id: str) -> None:
        """Undo one :meth:`acquire`; at the last one, write back a writable copy and unpin.

        Raises:
            KeyError: unknown tensor.
            ValueError: the tensor is not acquired.
        """
        with self._p.cond:
            self._p.release(self._entry(tensor_id))
            self._trace("R", tensor_id)

    def totals(self) -> PoolTotals:
        """The page counters since the pool was created: every step's summed (the open
        step's so far included) and the page moves by tensor kind (:class:`PoolTotals`).
        ``step_boundary`` does not reset them."""
        with self._p.cond:
            return self._p.counters.totals()

    def step_boundary(
        self, step: int, outside_device: Mapping[str, int] | None = None
    ) -> PageCounters:
        """Close step ``step``: return its counters, zero them, restart peaks and the order.

        Pages used afterwards are stamped with step ``step + 1``.

        Args:
            step: the step closed (0-based).
            outside_device: ``{"gathered_bytes", "reserved_bytes"}`` (bytes): what the
                pool's owner holds on the device outside the pool this step, recorded
                with the step's trace (None: as last reported).

        Returns:
            The step's :class:`PageCounters` (fields named as ``PAGE_COLUMNS``).
        """
        with self._p.cond:
            if outside_device is not None:
                self._p.outside_device = {k: int(v) for k, v in outside_device.items()}
            return self._p.close_step(step)

    def _trace(self, *event: object) -> None:
        if self._p.trace is not None:
            self._p.trace.add(*event)

    def _check_open(self) -> None:
        if self._state is not PoolState.OPEN:
            raise PoolClosedError("the paged buffer pool is closed")

    def _entry(self, tensor_id: str) -> TensorEntry:
        self._check_open()
        return self._p.table.get(tensor_id)

    def _bytes_entry(self, tensor_id: str, what: str) -> TensorEntry:
        entry = self._entry(tensor_id)
        if entry.external:
            raise ValueError(
                f"cannot {what} {tensor_id!r}: it is a reservation (reserve()), its bytes "
                "are held outside the pool"
            )
        return entry

    def _check_tier(self, tier: str, allowed: Sequence[str]) -> None:
        _check_tier(tier, allowed, self._p.device.n_slots, self._p.nvme is not None)
