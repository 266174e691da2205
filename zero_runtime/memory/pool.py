"""PagedBufferPool: tensors stored as fixed-size pages over device, host and NVMe tiers.

Terms (page, payload, slot, tier) are defined in :mod:`zero_runtime.memory.page_table`.

Threads and locking. One lock guards the page table, the tiers and the counters; public
methods hold it except while they wait, and they wait only on the condition variable tied
to it, so an I/O thread can always take it to finish a job. I/O threads do only pread,
pwrite and CRC32 on buffers that the page table has reserved for the job (the page is
``IN_FLIGHT_*``); the completion is then recorded under the lock by
:meth:`PagedBufferPool._on_io_complete`. ``prefetch`` hands tensors to one background
thread that runs the same placement loop as ``acquire`` but yields whenever a caller is
short of slots (``_starved > 0``) and never raises out-of-memory.

Where the bytes go. Device <-> host moves are synchronous copies under the lock. Host <->
NVMe moves are asynchronous jobs (at most ``queue_depth`` at the I/O threads). ``read``
and ``write`` of a page that lives on NVMe do a synchronous pread/pwrite through one
page-aligned staging buffer under the lock: they are not the paging hot path.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import math
import threading
import time
import weakref
import zlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import psutil

from zero_runtime.memory.counters import CounterAccumulator, PageCounters, TierUsage
from zero_runtime.memory.errors import (
    Holder,
    NvmeFullError,
    OomSnapshot,
    PageChecksumError,
    PageStateError,
    PagingError,
    PoolClosedError,
    PoolOutOfMemoryError,
)
from zero_runtime.memory.io import IoJob, IoScheduler, aligned_buffer, round_up
from zero_runtime.memory.page_table import (
    HOLDS,
    IN_FLIGHT,
    KINDS,
    RESIDENT,
    PageRecord,
    PageState,
    PageTable,
    TensorEntry,
)
from zero_runtime.memory.policy import EvictionPolicy
from zero_runtime.memory.tiers import DeviceTier, HostTier, NvmeTier, SlotTier

if TYPE_CHECKING:
    import tensorflow as tf

logger = logging.getLogger(__name__)

S = PageState

DEFAULT_PAGE_SIZE = 4 << 20  # bytes (4 MiB)
MIN_PAGE_SIZE = 64 << 10  # bytes (64 KiB)
TIER_ORDER = ("device", "host", "nvme")  # top to bottom
LEVEL = {name: i for i, name in enumerate(TIER_ORDER)}
WAIT_SLICE_SECONDS = 0.25  # seconds; waits re-check their condition at least this often
MAX_HOLDERS = 10  # holders listed per tier in an OomSnapshot


@dataclasses.dataclass(frozen=True)
class PageInfo:
    """Where one page is, as reported by :meth:`PagedBufferPool.describe`.

    Attributes:
        index: page index within the tensor.
        state: its :class:`~zero_runtime.memory.page_table.PageState`.
        tier: the tier it is in (the source tier while in flight).
        slot: its slot in that tier (the NVMe slot is at ``slot * page_size`` in the slab).
        payload: tensor bytes in the page.
        checksum: CRC32 of its last NVMe copy, or ``None``.
        last_use_step: step of its last use.
    """

    index: int
    state: PageState
    tier: str | None
    slot: int | None
    payload: int
    checksum: int | None
    last_use_step: int


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A tensor's metadata and page placement (:meth:`PagedBufferPool.describe`).

    Attributes:
        tensor_id, shape, dtype, kind: as given to ``allocate``.
        nbytes: ``prod(shape) * itemsize`` (bytes).
        pinned: pinned or acquired.
        pages: one :class:`PageInfo` per page.
    """

    tensor_id: str
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str
    nbytes: int
    pinned: bool
    pages: tuple[PageInfo, ...]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class PagedBufferPool:
    """Tensors stored as fixed-size pages on three tiers, paged between them on demand.

    A tensor is allocated with a shape, a dtype and a ``kind`` label, and lives as
    ``ceil(nbytes / page_size)`` pages. ``acquire`` brings its pages to the host or device
    tier and pins them until ``release``; when a tier is full, unpinned pages of other
    tensors move one tier down, least recently used first, or by reuse distance when
    :meth:`set_access_order` gave the step's access order. ``prefetch`` schedules the
    moves ahead of use. The pool is a context manager; :meth:`close` removes its files.

    Args:
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
            ``None`` for unbounded. Refused if larger than the disk's free space. Not
            reserved on disk: a disk that fills up later raises :class:`NvmeFullError`.
        io_threads: I/O threads for the NVMe tier (default 4).
        queue_depth: maximum NVMe page reads/writes outstanding at once (default 8).
        pin_host_memory: request page-locked host memory; recorded only (no effect
            without a GPU).

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
        ps = _check_int("page_size_bytes", page_size_bytes, 1)
        if ps < MIN_PAGE_SIZE or ps & (ps - 1):
            raise ValueError(
                f"page_size_bytes must be a power of two >= {MIN_PAGE_SIZE} (64 KiB), "
                f"got {page_size_bytes}"
            )
        host = _check_int("host_budget_bytes", host_budget_bytes, ps)
        available = psutil.virtual_memory().available
        if host > available:
            raise ValueError(
                f"host_budget_bytes={host} exceeds the memory available on this machine "
                f"({available} bytes, psutil.virtual_memory().available); lower the budget"
            )
        device = (
            0
            if device_budget_bytes is None
            else _check_int("device_budget_bytes", device_budget_bytes, 0)
        )
        if nvme_budget_bytes is not None:
            if nvme_path is None:
                raise ValueError("nvme_budget_bytes was given without nvme_path")
            _check_int("nvme_budget_bytes", nvme_budget_bytes, ps)
        io_threads = _check_int("io_threads", io_threads, 1)
        queue_depth = _check_int("queue_depth", queue_depth, 1)

        self._page_size = ps
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._counters = CounterAccumulator()
        self._device = DeviceTier(ps, device)
        self._host = HostTier(ps, host, pinned=pin_host_memory)
        self._nvme: NvmeTier | None = None
        self._io: IoScheduler | None = None
        nvme_tier: SlotTier = SlotTier("nvme", ps, 0)
        if nvme_path is not None:
            try:
                self._nvme = nvme_tier = NvmeTier(ps, nvme_path, nvme_budget_bytes)
            except BaseException:
                self._host.close()
                raise
            self._io = IoScheduler(self._nvme.file, io_threads, queue_depth, self._on_io_complete)
        self._tiers: dict[str, SlotTier] = {
            "device": self._device,
            "host": self._host,
            "nvme": nvme_tier,
        }
        self._table = PageTable(self._tiers, self._counters)
        self._zeros = np.zeros(ps, np.uint8)  # (page_size,) source of zero-filled pages
        self._staging = aligned_buffer(ps)  # page-aligned buffer for synchronous NVMe I/O
        self._staging_arr = np.frombuffer(self._staging, np.uint8)[:ps]
        self._policy = EvictionPolicy()
        self._starved = 0  # blocking callers waiting for slots; the prefetcher yields
        self._prefetch_queue: collections.deque[tuple[tuple[str, ...], str]] = collections.deque()
        self._prefetching = False
        self._prefetcher: threading.Thread | None = None
        self._closed = False
        self._finalizer = weakref.finalize(
            self, self._nvme.close if self._nvme is not None else (lambda: None)
        )
        logger.info(
            "paged buffer pool: %d-byte pages; %s; %s; %s",
            ps,
            self._device.description,
            self._host.description,
            self._nvme.description if self._nvme else "nvme: disabled",
        )

    # --- properties -------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        """Bytes per page."""
        return self._page_size

    @property
    def nvme_io_mode(self) -> str | None:
        """``"direct"`` (O_DIRECT) or ``"buffered"``, detected at start; ``None`` without NVMe."""
        return self._nvme.file.io_mode if self._nvme else None

    @property
    def nvme_file(self) -> str | None:
        """Path of the NVMe slab file, or ``None`` without an NVMe tier."""
        return self._nvme.file.path if self._nvme else None

    @property
    def device_tier(self) -> DeviceTier:
        """The device tier (see ``is_standin`` and ``description``)."""
        return self._device

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    # --- lifecycle --------------------------------------------------------------------
    def __enter__(self) -> PagedBufferPool:
        self._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop prefetching, finish outstanding I/O, free every page, remove the NVMe file.

        Idempotent. Arrays returned by ``acquire`` should not be used afterwards.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._prefetcher is not None:
            self._prefetcher.join()
        with self._cond:
            while self._io_busy():
                self._cond.wait(WAIT_SLICE_SECONDS)
        if self._io is not None:
            self._io.shutdown()
        with self._cond:
            for entry in self._table.entries():
                for page in entry.pages:
                    self._table.transition(page, S.FREED)
                self._table.remove(entry.tensor_id)
            self._device.close()
            self._host.close()
            self._staging_arr = np.empty(0, np.uint8)
            try:
                self._staging.close()
            except BufferError:
                pass
        self._finalizer()

    # --- allocation -------------------------------------------------------------------
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
        dt = np.dtype(dtype)
        if dt.hasobject or dt.itemsize == 0:
            raise ValueError(f"dtype {dt} cannot be paged (object or zero-size items)")
        shp = tuple(int(d) for d in shape)
        if any(d < 0 for d in shp):
            raise ValueError(f"shape must be non-negative, got {shp}")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        with self._cond:
            self._check_open()
            self._check_tier(tier, TIER_ORDER)
            nbytes = math.prod(shp) * dt.itemsize
            ps = self._page_size
            pages = [
                PageRecord(tensor_id, i, min(ps, nbytes - i * ps)) for i in range(-(-nbytes // ps))
            ]
            entry = TensorEntry(tensor_id, shp, dt, kind, nbytes, pages)
            self._table.add(entry)
            try:
                self._check_fits(entry, tier)
                self._settle(pages, tier, {tensor_id}, advisory=False)
            except BaseException:
                self._discard(entry)
                raise
            for page in pages:
                self._table.touch(page)

    def free(self, tensor_id: str) -> None:
        """Free a tensor's pages on every tier (waiting for its I/O in flight).

        Raises:
            KeyError: unknown tensor.
            ValueError: the tensor is pinned or acquired.
        """
        with self._cond:
            entry = self._entry(tensor_id)
            if entry.pinned:
                raise ValueError(
                    f"tensor {tensor_id!r} is pinned ({entry.pin_count}) or acquired "
                    f"({entry.acquire_count}); unpin/release it before free"
                )
            self._wait_settled(entry)
            self._discard(entry)
            self._cond.notify_all()

    # --- data -------------------------------------------------------------------------
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
        with self._cond:
            entry = self._entry(tensor_id)
            arr = np.asarray(array)
            if arr.shape != entry.shape:
                raise ValueError(
                    f"write to {tensor_id!r}: array shape {arr.shape} != tensor shape {entry.shape}"
                )
            data = np.ascontiguousarray(arr, dtype=entry.dtype).reshape(-1).view(np.uint8)
            self._wait_settled(entry)
            ps = self._page_size
            for page in entry.pages:
                chunk = data[page.index * ps : page.index * ps + page.payload]
                if page.state is S.ON_DEVICE:
                    self._device.put(page.slots["device"], chunk)
                elif page.state is S.ON_HOST:
                    self._host.view(page.slots["host"])[: page.payload] = chunk
                else:
                    self._nvme_write_sync(page, chunk)
                self._table.touch(page)

    def read(self, tensor_id: str) -> np.ndarray:
        """Return a copy of a tensor's contents (no page moves).

        Returns:
            A new array of the tensor's shape and dtype.

        Raises:
            KeyError: unknown tensor.
            PageChecksumError: an NVMe page does not match its checksum.
            PagingError: an I/O error reading an NVMe page.
        """
        with self._cond:
            entry = self._entry(tensor_id)
            self._wait_settled(entry)
            out = np.empty(entry.nbytes, np.uint8)  # (nbytes,)
            ps = self._page_size
            for page in entry.pages:
                chunk = out[page.index * ps : page.index * ps + page.payload]
                if page.state is S.ON_DEVICE:
                    self._device.copy_out(page.slots["device"], chunk)
                elif page.state is S.ON_HOST:
                    chunk[:] = self._host.view(page.slots["host"])[: page.payload]
                else:
                    self._nvme_read_sync(page, chunk)
                self._table.touch(page)
            return out.view(entry.dtype).reshape(entry.shape)

    # --- paging -----------------------------------------------------------------------
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
            For 'host', an ``np.ndarray`` of the tensor's shape and dtype: a view of the
            page for a one-page tensor, else a contiguous copy (so a multi-page acquire
            allocates ``nbytes`` outside the tier budgets). For 'device', a ``tf.Tensor``
            of the shape and dtype, assembled from the pages (a transient ``nbytes``
            device buffer for multi-page tensors). A host array is valid only until the
            matching :meth:`release`: a one-page view then points at a slot the pool may
            give to another page.

        Raises:
            KeyError: unknown tensor.
            ValueError: bad tier, ``writable`` with 'device', or already acquired on the
                other tier.
            PoolOutOfMemoryError: the tensor cannot be placed on ``tier``.
            NvmeFullError: the disk filled up while evicting to make room.
            PageChecksumError: a page read from NVMe is corrupt (it stays on NVMe).
        """
        with self._cond:
            entry = self._entry(tensor_id)
            self._check_tier(tier, ("host", "device"))
            if writable and tier == "device":
                raise ValueError("acquire(writable=True) is for tier='host'; use write()")
            if entry.acquire_count and entry.acquired_tier != tier:
                raise ValueError(
                    f"tensor {tensor_id!r} is acquired on {entry.acquired_tier!r}; release it "
                    f"before acquiring on {tier!r}"
                )
            self._check_fits(entry, tier)
            start = time.perf_counter()
            state = RESIDENT[tier]
            hits = sum(
                1
                for p in entry.pages
                if p.state is state or (tier == "host" and p.state is S.IN_FLIGHT_IN)
            )
            waited = any(p.state is not state for p in entry.pages)
            entry.acquire_count += 1
            entry.acquired_tier = tier
            try:
                self._settle(entry.pages, tier, {tensor_id}, advisory=False)
                result = self._materialise(entry, tier, writable)
            except BaseException:
                self._drop_acquire(entry)
                raise
            self._counters.add("prefetch_hits", hits)
            self._counters.add("prefetch_misses", len(entry.pages) - hits)
            if waited:
                self._counters.add("stall_seconds", time.perf_counter() - start)
            self._policy.advance(tensor_id)
            for page in entry.pages:
                self._table.touch(page)
            return result

    def release(self, tensor_id: str) -> None:
        """Undo one :meth:`acquire`; at the last one, write back a writable copy and unpin.

        Raises:
            KeyError: unknown tensor.
            ValueError: the tensor is not acquired.
        """
        with self._cond:
            entry = self._entry(tensor_id)
            if entry.acquire_count == 0:
                raise ValueError(f"tensor {tensor_id!r} is not acquired")
            if entry.acquire_count == 1 and entry.writable and len(entry.pages) > 1:
                data = entry.acquired.reshape(-1).view(np.uint8)
                ps = self._page_size
                for page in entry.pages:  # pinned on host since the acquire
                    start = page.index * ps
                    self._host.view(page.slots["host"])[: page.payload] = data[
                        start : start + page.payload
                    ]
            self._drop_acquire(entry)
            self._cond.notify_all()

    def prefetch(self, tensor_ids: str | Iterable[str], tier: str = "host") -> None:
        """Schedule page-ins of tensors ahead of use; returns at once.

        A background thread moves the pages to ``tier`` without pinning them. It never
        evicts pinned pages or the tensors of this call, nor, when an access order is set,
        pages needed sooner than these tensors; when nothing can move it gives up
        quietly (``acquire`` then brings the rest).

        Args:
            tensor_ids: one id or several.
            tier: 'host' or 'device'.

        Raises:
            KeyError: an unknown tensor.
            ValueError: bad tier.
        """
        ids = (tensor_ids,) if isinstance(tensor_ids, str) else tuple(tensor_ids)
        with self._cond:
            self._check_open()
            self._check_tier(tier, ("host", "device"))
            for tid in ids:
                self._table.get(tid)
            self._prefetch_queue.append((ids, tier))
            if self._prefetcher is None:
                self._prefetcher = threading.Thread(
                    target=self._prefetch_loop, name="zr-prefetch", daemon=True
                )
                self._prefetcher.start()
            self._cond.notify_all()

    def evict(self, tensor_ids: str | Iterable[str], to_tier: str = "nvme") -> None:
        """Move tensors' pages down to ``to_tier`` (pages already lower stay); waits.

        All the pages' I/O is issued before waiting, so evicting many tensors in one call
        keeps ``queue_depth`` writes in flight.

        Args:
            tensor_ids: one id or several.
            to_tier: 'host' or 'nvme'.

        Raises:
            KeyError: an unknown tensor.
            ValueError: bad tier, or a tensor is pinned or acquired.
            PoolOutOfMemoryError: ``to_tier`` is full and nothing can make room.
            NvmeFullError: the disk filled up; the page that failed stays on host.
        """
        ids = (tensor_ids,) if isinstance(tensor_ids, str) else tuple(tensor_ids)
        with self._cond:
            self._check_open()
            self._check_tier(to_tier, ("host", "nvme"))
            entries = [self._entry(tid) for tid in ids]
            for entry in entries:
                if entry.pinned:
                    raise ValueError(f"tensor {entry.tensor_id!r} is pinned or acquired")
            pages = [p for e in entries for p in e.pages]
            self._settle(pages, to_tier, set(ids), advisory=False, down_only=True)

    def pin(self, tensor_id: str) -> None:
        """Keep a tensor's pages from being evicted until a matching :meth:`unpin`.

        Raises:
            KeyError: unknown tensor.
        """
        with self._cond:
            self._entry(tensor_id).pin_count += 1

    def unpin(self, tensor_id: str) -> None:
        """Undo one :meth:`pin`.

        Raises:
            KeyError: unknown tensor.
            ValueError: the tensor is not pinned.
        """
        with self._cond:
            entry = self._entry(tensor_id)
            if entry.pin_count == 0:
                raise ValueError(f"tensor {tensor_id!r} is not pinned")
            entry.pin_count -= 1
            self._cond.notify_all()

    def set_access_order(self, tensor_ids: Sequence[str] | None) -> None:
        """Declare the order in which a step acquires tensors, for reuse-distance eviction.

        With an order, a full tier evicts first the pages of tensors absent from it, then
        the page whose tensor is next used furthest ahead (counting into the next step),
        ties broken by least recent use.
        The position advances with each ``acquire`` and restarts at ``step_boundary``.
        ``None`` or ``[]`` restores plain LRU.
        """
        with self._cond:
            self._policy.set_order(tensor_ids)

    def set_device_budget(self, capacity_bytes: int) -> int:
        """Change the device tier's capacity (e.g. a live ``device_budget_bytes`` change).

        Growing takes effect at once. Shrinking first moves the excess pages down to the
        host, by the eviction policy (reuse distance with an access order, else least
        recently used), counted as ``d2h`` moves and ``evictions``; the host makes room
        further down as usual.

        Args:
            capacity_bytes: the new budget (bytes), rounded down to whole pages; >= one
                page (the tier cannot be disabled or enabled after construction).

        Returns:
            The number of pages moved down.

        Raises:
            ValueError: a budget below one page, or a pool built without a device tier.
            PoolOutOfMemoryError: shrinking needs more pages to move than are unpinned on
                the device (nothing is changed), or the host cannot take them.
        """
        ps = self._page_size
        new = _check_int("capacity_bytes", capacity_bytes, ps) // ps
        with self._cond:
            self._check_open()
            self._check_tier("device", ("device",))
            excess = self._device.used - new
            victims = self._victims("device", excess, set(), None) if excess > 0 else []
            if len(victims) < excess:
                reason = (
                    f"cannot shrink the device tier to {new} page slots: {self._device.used} "
                    f"are in use and only {len(victims)} can move down (the rest are pinned)"
                )
                raise PoolOutOfMemoryError(self._snapshot(excess * ps, "", "device", reason))
            self._device.resize(new)
            if victims:
                self._settle(victims, "host", set(), advisory=False, down_only=True)
                self._counters.add("evictions", len(victims))
            self._cond.notify_all()
            return len(victims)

    def synchronize(self) -> None:
        """Wait until queued prefetches and all NVMe I/O have finished."""
        with self._cond:
            while not self._closed and (
                self._prefetch_queue or self._prefetching or self._io_busy()
            ):
                self._cond.wait(WAIT_SLICE_SECONDS)

    # --- accounting -------------------------------------------------------------------
    def step_boundary(self, step: int) -> PageCounters:
        """Close step ``step``: return its counters, zero them, restart peaks and the order.

        Pages used afterwards are stamped with step ``step + 1``.

        Returns:
            The step's :class:`PageCounters` (fields named as ``PAGE_COLUMNS``).
        """
        with self._cond:
            snapshot = self._counters.snapshot()
            self._counters.reset()
            for tier in self._tiers.values():
                tier.reset_peak()
            self._table.step = int(step) + 1
            self._policy.restart()
            return snapshot

    def usage(self) -> dict[str, TierUsage]:
        """Return each tier's use: ``{"device"|"host"|"nvme": TierUsage}`` (bytes).

        A disabled tier reports capacity 0; an unbounded NVMe tier capacity ``None``.
        """
        with self._cond:
            by_kind = {name: dict.fromkeys(KINDS, 0) for name in TIER_ORDER}
            for entry in self._table.entries():
                for page in entry.pages:
                    for name in HOLDS[page.state]:
                        by_kind[name][entry.kind] += self._page_size
            return {
                name: TierUsage(
                    used_bytes=tier.used * self._page_size,
                    capacity_bytes=tier.capacity_bytes,
                    peak_bytes=tier.peak * self._page_size,
                    bytes_by_kind=by_kind[name],
                    pages=tier.used,
                )
                for name, tier in self._tiers.items()
            }

    def describe(self, tensor_id: str) -> TensorInfo:
        """Return a tensor's metadata and where each of its pages is.

        Raises:
            KeyError: unknown tensor.
        """
        with self._cond:
            e = self._entry(tensor_id)
            pages = tuple(
                PageInfo(
                    p.index,
                    p.state,
                    p.tier,
                    p.slots.get(p.tier) if p.tier else None,
                    p.payload,
                    p.checksum,
                    p.last_use_step,
                )
                for p in e.pages
            )
            return TensorInfo(e.tensor_id, e.shape, e.dtype, e.kind, e.nbytes, e.pinned, pages)

    def tensor_ids(self) -> list[str]:
        """Return the ids of the allocated tensors (allocation order)."""
        with self._cond:
            return [e.tensor_id for e in self._table.entries()]

    # --- internals: placement ---------------------------------------------------------
    def _settle(
        self,
        pages: list[PageRecord],
        target: str,
        exclude: set[str],
        *,
        advisory: bool,
        down_only: bool = False,
        limit: float | None = None,
    ) -> bool:
        """Move ``pages`` to ``target`` hop by hop, making room as needed; the one
        placement loop behind allocate, acquire, evict and prefetch.

        Called under the lock; waits on the condition. Pages of ``exclude`` tensors are
        never chosen as victims; with ``limit``, only pages whose next use is further
        than ``limit`` are. Returns True when done. A blocking caller that lacks slots
        counts itself in ``_starved`` while it does. Advisory callers (prefetch) count a
        page read already on its way to the host as done, and get False instead of an
        error when stuck, when a job failed, or when a blocking caller is starved.
        """
        pages = list({id(p): p for p in pages}.values())  # a tensor may be listed twice
        jobs: list[IoJob] = []
        starving = False
        try:
            while True:
                self._check_open()
                for job in jobs:
                    if job.done and job.error is not None:
                        if advisory:
                            return False
                        raise job.error
                if advisory and self._starved:
                    return False
                todo = []
                for p in pages:
                    if p.state is S.FREED:
                        if advisory:
                            return False
                        raise KeyError(f"tensor {p.tensor_id!r} was freed while being placed")
                    issued = advisory and target == "host" and p.state is S.IN_FLIGHT_IN
                    if not (issued or self._placed(p, target, down_only)):
                        todo.append(p)
                if not todo:
                    return True
                acted = False
                lacking: dict[str, list[PageRecord]] = {name: [] for name in TIER_ORDER}
                for p in todo:
                    if p.state in IN_FLIGHT:
                        continue
                    dst = self._next_hop(p, target)
                    tier = self._tiers[dst]
                    if tier.has_free():
                        self._hop(p, dst, tier.take(), jobs, evicting=False)
                        acted = True
                    else:
                        lacking[dst].append(p)
                if not advisory and starving != any(lacking.values()):
                    starving = not starving
                    self._starved += 1 if starving else -1
                if any(lacking.values()):
                    acted = self._make_room(lacking, exclude, jobs, limit) or acted
                if acted:
                    continue
                if not self._io_busy():
                    if advisory:
                        return False
                    raise self._out_of_memory(pages, target, lacking, exclude)
                self._cond.wait(WAIT_SLICE_SECONDS)
        finally:
            if starving:
                self._starved -= 1
                self._cond.notify_all()

    @staticmethod
    def _placed(page: PageRecord, target: str, down_only: bool) -> bool:
        if page.state is RESIDENT[target]:
            return True
        return (
            down_only
            and page.state in (S.ON_DEVICE, S.ON_HOST, S.ON_NVME)
            and LEVEL[page.tier] > LEVEL[target]
        )

    @staticmethod
    def _next_hop(page: PageRecord, target: str) -> str:
        if page.state is S.UNPLACED:
            return target
        here = LEVEL[page.tier]
        return TIER_ORDER[here + 1] if LEVEL[target] > here else TIER_ORDER[here - 1]

    def _below(self, tier: str) -> str | None:
        if tier == "device":
            return "host"
        if tier == "host" and self._nvme is not None:
            return "nvme"
        return None

    def _coming_free(self, tier: str) -> int:
        """Slots of ``tier`` that jobs in flight will free when they finish."""
        if tier == "host":
            return self._table.count(S.IN_FLIGHT_OUT)
        if tier == "nvme":
            return self._table.count(S.IN_FLIGHT_IN)
        return 0

    def _make_room(
        self,
        lacking: dict[str, list[PageRecord]],
        exclude: set[str],
        jobs: list[IoJob],
        limit: float | None,
    ) -> bool:
        """Start moving victims down for the slots ``lacking`` asks for, top tier first
        (a device victim that finds the host full is added to the host's wants)."""
        acted = False
        for name in TIER_ORDER:
            need = len(lacking[name]) - self._coming_free(name)
            lower = self._below(name)
            if need <= 0 or lower is None:
                continue
            for victim in self._victims(name, need, exclude, limit):
                lower_tier = self._tiers[lower]
                if lower_tier.has_free():
                    self._hop(victim, lower, lower_tier.take(), jobs, evicting=True)
                    acted = True
                else:
                    lacking[lower].append(victim)
        return acted

    def _victims(
        self, tier: str, n: int, exclude: set[str], limit: float | None
    ) -> list[PageRecord]:
        """The ``n`` pages of other, unpinned tensors to evict first from ``tier``."""
        state = RESIDENT[tier]
        candidates = (
            p
            for e in self._table.entries()
            if not e.pinned and e.tensor_id not in exclude
            for p in e.pages
            if p.state is state
        )
        return self._policy.choose(candidates, n, limit)

    def _hop(
        self, page: PageRecord, dst: str, slot: int, jobs: list[IoJob], evicting: bool
    ) -> None:
        """Start (or do) one move of ``page`` into ``slot`` of tier ``dst``."""
        state = page.state
        try:
            if state is S.UNPLACED:
                self._table.transition(page, RESIDENT[dst], slot)
                self._zero_fill(page)
            elif state is S.ON_DEVICE and dst == "host":
                self._device.copy_out(page.slots["device"], self._host.view(slot))
                self._table.transition(page, S.ON_HOST, slot)
                if evicting:
                    self._counters.add("evictions")
            elif state is S.ON_HOST and dst == "device":
                self._device.put(slot, self._host.view(page.slots["host"])[: page.payload])
                self._table.transition(page, S.ON_DEVICE, slot)
            elif state is S.ON_HOST and dst == "nvme":
                self._table.transition(page, S.IN_FLIGHT_OUT, slot)
                self._submit("write", page, page.slots["host"], slot, jobs, evicting)
            elif state is S.ON_NVME and dst == "host":
                self._table.transition(page, S.IN_FLIGHT_IN, slot)
                self._submit("read", page, slot, page.slots["nvme"], jobs, False)
            else:
                raise PageStateError(
                    f"no move from {state.name} to tier {dst!r} for page {page.index} of "
                    f"{page.tensor_id!r} (internal error)"
                )
        except BaseException:
            if page.slots.get(dst) != slot:  # the transition did not take the slot
                self._tiers[dst].release(slot)
            raise

    def _submit(
        self,
        op: str,
        page: PageRecord,
        host_slot: int,
        nvme_slot: int,
        jobs: list[IoJob],
        evicting: bool,
    ) -> None:
        assert self._io is not None and self._nvme is not None
        job = IoJob(
            op,
            page,
            self._host.buffer(host_slot, round_up(page.payload)),
            self._nvme.offset(nvme_slot),
            page.payload,
            evicting=evicting,
        )
        jobs.append(job)
        self._io.submit(job)

    def _on_io_complete(self, job: IoJob) -> None:
        """Record a finished NVMe job (runs on an I/O thread; takes the lock)."""
        with self._cond:
            page = job.page
            self._counters.add("io_seconds", job.seconds)
            if job.op == "write":
                if job.error is None:
                    page.checksum = job.crc
                    self._table.transition(page, S.ON_NVME)
                    if job.evicting:
                        self._counters.add("evictions")
                else:
                    offset = job.offset
                    self._table.transition(page, S.ON_HOST)  # the page stays where it was
                    job.error = self._write_error(page, offset, job.error)
            else:
                if job.error is None and job.crc != page.checksum:
                    job.error = PageChecksumError(
                        self.nvme_file or "",
                        job.offset,
                        page.tensor_id,
                        page.index,
                        page.checksum or 0,
                        job.crc or 0,
                    )
                elif job.error is not None:
                    err = PagingError(
                        f"I/O error reading page {page.index} of tensor {page.tensor_id!r} "
                        f"from {self.nvme_file} at offset {job.offset}: {job.error}"
                    )
                    err.__cause__ = job.error
                    job.error = err
                if job.error is None:
                    self._table.transition(page, S.ON_HOST)
                    self._table.touch(page)
                else:
                    self._table.transition(page, S.ON_NVME)  # the page stays where it was
            if job.error is not None:
                logger.warning("paging I/O failed: %s", job.error)
            job.done = True
            assert self._io is not None
            self._io.job_finished()
            self._cond.notify_all()

    def _write_error(self, page: PageRecord, offset: int, exc: BaseException) -> Exception:
        where = f"page {page.index} of tensor {page.tensor_id!r} at offset {offset}"
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            snapshot = self._snapshot(
                self._page_size,
                page.tensor_id,
                "nvme",
                "the disk under nvme_path is full (ENOSPC) before the NVMe budget was reached",
            )
            err: Exception = NvmeFullError(snapshot, self.nvme_file or "", errno.ENOSPC, where)
        else:
            err = PagingError(f"I/O error writing {where} to {self.nvme_file}: {exc}")
        err.__cause__ = exc
        return err

    def _zero_fill(self, page: PageRecord) -> None:
        if page.state is S.ON_DEVICE:
            self._device.put(page.slots["device"], self._zeros[: page.payload])
        elif page.state is S.ON_HOST:
            self._host.view(page.slots["host"])[: page.payload] = 0
        else:
            self._nvme_write_sync(page, self._zeros[: page.payload])

    def _nvme_write_sync(self, page: PageRecord, data: np.ndarray) -> None:
        """Write ``data`` (1-D uint8, the payload) to the page's NVMe slot; set its CRC."""
        assert self._nvme is not None
        n = page.payload
        self._staging_arr[:n] = data
        xfer = round_up(n)
        self._staging_arr[n:xfer] = 0
        offset = self._nvme.offset(page.slots["nvme"])
        start = time.perf_counter()
        try:
            crc = zlib.crc32(memoryview(self._staging)[:n])
            self._nvme.file.pwrite(memoryview(self._staging)[:xfer], offset)
        except OSError as exc:
            raise self._write_error(page, offset, exc) from exc
        finally:
            self._counters.add("io_seconds", time.perf_counter() - start)
        page.checksum = crc

    def _nvme_read_sync(self, page: PageRecord, out: np.ndarray) -> None:
        """Read the page's NVMe copy into ``out`` (1-D uint8, payload), checking its CRC."""
        assert self._nvme is not None
        n = page.payload
        offset = self._nvme.offset(page.slots["nvme"])
        start = time.perf_counter()
        try:
            self._nvme.file.pread_into(memoryview(self._staging)[: round_up(n)], offset)
            crc = zlib.crc32(memoryview(self._staging)[:n])
        except OSError as exc:
            raise PagingError(
                f"I/O error reading page {page.index} of tensor {page.tensor_id!r} from "
                f"{self.nvme_file} at offset {offset}: {exc}"
            ) from exc
        finally:
            self._counters.add("io_seconds", time.perf_counter() - start)
        if crc != page.checksum:
            raise PageChecksumError(
                self._nvme.file.path, offset, page.tensor_id, page.index, page.checksum or 0, crc
            )
        out[:] = self._staging_arr[:n]

    def _materialise(self, entry: TensorEntry, tier: str, writable: bool) -> np.ndarray | tf.Tensor:
        if tier == "device":
            return self._device_tensor(entry)
        if entry.acquired is not None:
            if writable:
                entry.acquired.flags.writeable = True
                entry.writable = True
            return entry.acquired
        if not entry.pages:
            arr = np.zeros(entry.shape, entry.dtype)
        elif len(entry.pages) == 1:
            view = self._host.view(entry.pages[0].slots["host"])[: entry.nbytes]
            arr = view.view(entry.dtype).reshape(entry.shape)
        else:
            buf = np.empty(entry.nbytes, np.uint8)  # (nbytes,)
            ps = self._page_size
            for page in entry.pages:
                start = page.index * ps
                buf[start : start + page.payload] = self._host.view(page.slots["host"])[
                    : page.payload
                ]
            arr = buf.view(entry.dtype).reshape(entry.shape)
        arr.flags.writeable = writable
        entry.acquired = arr
        entry.writable = writable
        return arr

    def _device_tensor(self, entry: TensorEntry) -> tf.Tensor:
        tf = self._device._tf
        with tf.device(self._device.device_name):
            tf_dtype = tf.as_dtype(entry.dtype)
            if not entry.pages:
                return tf.zeros(entry.shape, tf_dtype)
            parts = [self._device.get(p.slots["device"]) for p in entry.pages]
            flat = parts[0] if len(parts) == 1 else tf.concat(parts, 0)  # (nbytes,) uint8
            itemsize = entry.dtype.itemsize
            if tf_dtype == tf.bool:
                values = tf.cast(flat, tf.bool)
            elif itemsize == 1:
                values = tf.bitcast(flat, tf_dtype)
            else:
                values = tf.bitcast(tf.reshape(flat, [-1, itemsize]), tf_dtype)
            return tf.reshape(values, entry.shape)

    def _drop_acquire(self, entry: TensorEntry) -> None:
        entry.acquire_count -= 1
        if entry.acquire_count == 0:
            entry.acquired_tier = None
            entry.acquired = None
            entry.writable = False

    def _discard(self, entry: TensorEntry) -> None:
        for page in entry.pages:
            if page.state is not S.FREED:
                self._table.transition(page, S.FREED)
        self._table.remove(entry.tensor_id)

    def _wait_settled(self, entry: TensorEntry) -> None:
        while entry.in_flight():
            self._check_open()
            self._cond.wait(WAIT_SLICE_SECONDS)
        if entry.tensor_id not in self._table:
            raise KeyError(f"tensor {entry.tensor_id!r} was freed while waiting")

    # --- internals: prefetch -----------------------------------------
    def _prefetch_loop(self) -> None:
        with self._cond:
            while not self._closed:
                if not self._prefetch_queue or self._starved:
                    self._prefetching = False
                    self._cond.notify_all()
                    self._cond.wait(WAIT_SLICE_SECONDS)
                    continue
                ids, tier = self._prefetch_queue.popleft()
                self._prefetching = True
                ids = tuple(t for t in ids if t in self._table)
                pages = [p for t in ids for p in self._table.get(t).pages]
                limit = None
                if self._policy.ordered and ids:
                    limit = max(self._policy.distance(t) for t in ids)
                try:
                    done = self._settle(pages, tier, set(ids), advisory=True, limit=limit)
                except PoolClosedError:
                    break
                except Exception as exc:  # noqa: BLE001 - prefetch is advisory
                    logger.warning("prefetch of %s failed: %s", ids, exc)
                    done = True
                if not done and self._starved and not self._closed:
                    self._prefetch_queue.appendleft((ids, tier))  # resume after the caller
            self._prefetching = False
            self._cond.notify_all()

    # --- internals: checks and reports ------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("the paged buffer pool is closed")

    def _entry(self, tensor_id: str) -> TensorEntry:
        self._check_open()
        return self._table.get(tensor_id)

    def _check_tier(self, tier: str, allowed: Sequence[str]) -> None:
        if tier not in allowed:
            raise ValueError(f"tier must be one of {tuple(allowed)}, got {tier!r}")
        if tier == "device" and self._device.n_slots == 0:
            raise ValueError("the device tier is disabled (device_budget_bytes is 0 or None)")
        if tier == "nvme" and self._nvme is None:
            raise ValueError("the NVMe tier is disabled (no nvme_path)")

    def _check_fits(self, entry: TensorEntry, tier: str) -> None:
        """Fail fast when the tensor cannot fit on ``tier`` beside other pinned pages."""
        slots = self._tiers[tier].n_slots
        if slots is None:
            return
        pinned = sum(
            1
            for e in self._table.entries()
            if e.pinned and e is not entry
            for p in e.pages
            if tier in HOLDS[p.state]
        )
        if len(entry.pages) > slots - pinned:
            reason = (
                f"the tensor needs {len(entry.pages)} pages and the {tier} tier has {slots} "
                f"page slots, {pinned} of them held by pinned or acquired tensors"
            )
            raise PoolOutOfMemoryError(
                self._snapshot(len(entry.pages) * self._page_size, entry.tensor_id, tier, reason)
            )

    def _out_of_memory(
        self,
        pages: list[PageRecord],
        target: str,
        lacking: dict[str, list[PageRecord]],
        exclude: set[str],
    ) -> PoolOutOfMemoryError:
        stuck = next((name for name in TIER_ORDER if lacking[name]), target)
        tier = self._tiers[stuck]
        lower = self._below(stuck)
        reason = f"the {stuck} tier is full ({tier.used} of {tier.n_slots} page slots)"
        if lower is None:
            reason += "; it is the lowest tier" if stuck == "nvme" else "; there is no NVMe tier"
        elif not self._victims(stuck, 1, exclude, None):
            reason += "; none of its pages can move down (all pinned, acquired or requested)"
        else:
            reason += f"; the {lower} tier below is full too"
        tensor_ids = list(dict.fromkeys(p.tensor_id for p in pages))
        request = len(pages) * self._page_size
        return PoolOutOfMemoryError(self._snapshot(request, ",".join(tensor_ids), target, reason))

    def _snapshot(self, nbytes: int, tensor_id: str, tier: str, reason: str) -> OomSnapshot:
        holders: dict[str, dict[str, list[int]]] = {name: {} for name in TIER_ORDER}
        kinds = {}
        for entry in self._table.entries():
            kinds[entry.tensor_id] = entry.kind
            for page in entry.pages:
                for name in HOLDS[page.state]:
                    holders[name].setdefault(entry.tensor_id, [0])[0] += 1
        return OomSnapshot(
            request_bytes=nbytes,
            request_tensor_id=tensor_id,
            request_tier=tier,
            tiers={
                name: {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used * self._page_size}
                for name, t in self._tiers.items()
            },
            holders={
                name: tuple(
                    Holder(tid, kinds[tid], n[0] * self._page_size, n[0])
                    for tid, n in sorted(held.items(), key=lambda kv: -kv[1][0])[:MAX_HOLDERS]
                )
                for name, held in holders.items()
            },
            reason=reason,
        )

    def _io_busy(self) -> bool:
        return self._io is not None and self._io.busy()
