"""NVMe slab files and the asynchronous I/O scheduler.

A pool's NVMe tier is one *slab file* of fixed page-sized slots, named
``zrpool-<pid>-<token>.slab`` in ``nvme_path``: the pid records the owner, and the owner
holds an exclusive ``flock`` on it for its whole life. At start, files of processes that
are gone (pid not alive *and* the lock free) are removed; files of live processes never
are.

The slab is preallocated with ``posix_fallocate``: the whole budget at start when the
tier has one (so a disk that fills up later cannot make a page-out fail), else each slot
just before its first write (so, as before preallocation, new disk space is taken only
by a slot used for the first time, and a full disk fails only that write). Writes then
land in allocated blocks and never extend the file, which keeps ``O_DIRECT`` writes off
the filesystem's block allocator. Where ``fallocate`` is not supported the file grows as
pages are written, and that is logged once.

I/O uses ``os.pwrite`` and ``os.preadv`` (``os.pread`` cannot read into a caller's
buffer, which ``O_DIRECT`` needs). ``O_DIRECT`` is tried at open with a page-aligned
(mmap) buffer; if the filesystem refuses it, buffered I/O is used. The mode is recorded
in :attr:`NvmeFile.io_mode`. With ``O_DIRECT``, offsets, lengths and buffers are
multiples of :data:`IO_ALIGN`; the pool's buffers are mmap-allocated, hence aligned.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil

from zero_runtime.memory.checksum import page_checksum
from zero_runtime.memory.errors import NvmePathError

logger = logging.getLogger(__name__)

# Alignment of O_DIRECT offsets, lengths and buffers (bytes). 4096 covers 512-byte and
# 4 KiB logical-block devices.
IO_ALIGN = 4096

# errnos of a filesystem without fallocate (the slab then grows as pages are written).
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

SLAB_PATTERN = re.compile(r"^zrpool-(\d+)-[0-9a-f]+\.slab$")


def round_up(n: int, align: int = IO_ALIGN) -> int:
    """Round ``n`` (bytes) up to a multiple of ``align``."""
    return (n + align - 1) // align * align


def cleanup_stale_files(directory: str) -> list[str]:
    """Remove slab files left in ``directory`` by processes that no longer exist.

    A file is removed only if its pid (from the name) is not this process, is not alive
    (``psutil.pid_exists``), and its ``flock`` can be taken (no process, e.g. a forked
    child that inherited the descriptor, still holds it).

    Returns:
        The paths removed.
    """
    removed = []
    me = os.getpid()
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        logger.warning("cannot list %s for stale slab files: %s", directory, exc)
        return removed
    for name in names:
        match = SLAB_PATTERN.match(name)
        if not match or int(match.group(1)) == me or psutil.pid_exists(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError as exc:
            logger.warning("could not remove stale NVMe slab file %s: %s", path, exc)
        finally:
            os.close(fd)
    if removed:
        logger.info(
            "removed %d stale NVMe slab file(s) of dead processes: %s", len(removed), removed
        )
    return removed


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Allocate ``nbytes`` of anonymous, page-aligned memory (usable for O_DIRECT)."""
    return mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))


class NvmeFile:
    """One slab file: open, ownership lock, I/O mode detection, preallocation, full-length
    pread/pwrite.

    Args:
        directory: an existing, writable directory.
        budget_bytes: bytes the tier may use (``None``: unbounded). Refused if larger
            than the free space of the filesystem; otherwise its whole slots are
            preallocated at once.
        page_size: bytes per slot; default 4 MiB.

    Raises:
        NvmePathError: the directory is missing, not a directory, read-only or not
            writable, or has less free space than ``budget_bytes`` (both numbers given),
            or the budget could not be preallocated.

    Attributes:
        path: the slab file.
        io_mode: ``"direct"`` (``O_DIRECT``) or ``"buffered"``.
        preallocated: True while ``posix_fallocate`` works on this filesystem (False:
            the file grows as pages are written).
        reserved_bytes: bytes of the file preallocated so far (the budget, or up to
            the end of the highest slot written).
    """

    def __init__(self, directory: str, budget_bytes: int | None, page_size: int = 4 << 20) -> None:
        directory = os.path.abspath(directory)
        if not os.path.exists(directory):
            raise NvmePathError(
                f"nvme_path {directory!r} does not exist (or a parent is not a directory); "
                f"create it or pass an existing directory"
            )
        if not os.path.isdir(directory):
            raise NvmePathError(f"nvme_path {directory!r} is not a directory")
        cleanup_stale_files(directory)
        self.path = os.path.join(directory, f"zrpool-{os.getpid()}-{secrets.token_hex(6)}.slab")
        try:
            self._lock_fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise NvmePathError(
                f"nvme_path {directory!r} is not writable ({errno.errorcode.get(exc.errno, '?')}:"
                f" {exc.strerror}); pass a writable directory on a local disk"
            ) from exc
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._closed = False
        self._page_size = page_size
        self._grow_lock = threading.Lock()  # guards reserved_bytes / preallocated
        self.reserved_bytes = 0
        self.preallocated = True
        free = shutil.disk_usage(directory).free
        if budget_bytes is not None and budget_bytes > free:
            self.close()
            raise NvmePathError(
                f"nvme_budget_bytes={budget_bytes} exceeds the free space under {directory!r} "
                f"({free} bytes free)"
            )
        try:
            self.fd, self.io_mode = self._open_io_fd()
            if budget_bytes is not None:
                self._reserve_budget(budget_bytes // page_size * page_size)
        except BaseException:
            self.close()
            raise

    def _reserve_budget(self, nbytes: int) -> None:
        """Preallocate the whole budget (``nbytes``) at start."""
        try:
            self._fallocate(nbytes)
        except OSError as exc:
            raise NvmePathError(
                f"could not preallocate nvme_budget_bytes={nbytes} in {self.path} "
                f"({errno.errorcode.get(exc.errno or 0, '?')}: {exc.strerror}); lower the "
                f"budget or free disk space"
            ) from exc

    def _fallocate(self, end: int) -> None:
        """Preallocate the file up to ``end`` bytes (lock held or at construction).
        Where the filesystem has no fallocate, logs it once and stops trying."""
        if not self.preallocated or end <= self.reserved_bytes:
            return
        try:
            os.posix_fallocate(self._lock_fd, self.reserved_bytes, end - self.reserved_bytes)
        except OSError as exc:
            if exc.errno not in _NO_FALLOCATE:
                raise
            self.preallocated = False
            logger.info(
                "fallocate is not supported for %s (%s); the slab file grows as pages are written",
                self.path,
                exc,
            )
            return
        self.reserved_bytes = end

    def ensure(self, end: int) -> None:
        """Make sure bytes ``[0, end)`` of the slab are allocated before writing there: a
        no-op inside the reservation, else it is extended to ``end``. Thread-safe (called
        by the I/O threads before each write).

        Raises:
            OSError: ``ENOSPC`` (or another error) from ``posix_fallocate``.
        """
        if end <= self.reserved_bytes or not self.preallocated:
            return
        with self._grow_lock:
            self._fallocate(end)

    def _open_io_fd(self) -> tuple[int, str]:
        """Open the descriptor used for I/O: O_DIRECT if an aligned probe write/read works
        (else buffered, logged once per file)."""
        if hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            except OSError as exc:
                logger.info("O_DIRECT refused on %s (%s); using buffered I/O", self.path, exc)
            else:
                probe = aligned_buffer(IO_ALIGN)
                try:
                    os.pwrite(fd, probe, 0)
                    os.preadv(fd, [probe], 0)
                    os.ftruncate(fd, 0)
                    return fd, "direct"
                except OSError as exc:
                    logger.info("O_DIRECT refused on %s (%s); using buffered I/O", self.path, exc)
                    os.close(fd)
                finally:
                    probe.close()
        os.ftruncate(self._lock_fd, 0)
        return os.dup(self._lock_fd), "buffered"

    def pwrite(self, buf: memoryview, offset: int) -> None:
        """Write all of ``buf`` at ``offset`` (bytes), preallocating first (:meth:`ensure`).

        Raises:
            OSError: as raised by ``os.pwrite`` or ``posix_fallocate``; a write that makes
                no progress (a short write on a full disk) raises ``OSError(errno.ENOSPC)``.
        """
        self.ensure(offset + len(buf))
        done = 0
        while done < len(buf):
            n = os.pwrite(self.fd, buf[done:], offset + done)
            if n <= 0:
                raise OSError(errno.ENOSPC, "short write: no space left on device", self.path)
            done += n

    def pread_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` from ``offset`` (bytes).

        Raises:
            OSError: as raised by ``os.preadv``; ``EIO`` if the file ends first.
        """
        done = 0
        while done < len(buf):
            n = os.preadv(self.fd, [buf[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short read at offset {offset + done}", self.path)
            done += n

    def disk_bytes(self) -> int:
        """Bytes the slab file occupies on disk (``st_blocks * 512``)."""
        return os.fstat(self._lock_fd).st_blocks * 512

    def close(self) -> None:
        """Close the descriptors and remove the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for fd in (getattr(self, "fd", -1), self._lock_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclasses.dataclass(eq=False)
class IoJob:
    """One page read or write on the NVMe slab.

    Attributes:
        op: ``"read"`` (NVMe -> host slot) or ``"write"`` (host slot -> NVMe).
        page: the page record (a ``PageRecord``), in flight while the job runs.
        buffer: the host slot's memory, ``round_up(payload)`` bytes.
        offset: byte offset in the slab file.
        payload: bytes covered by the checksum (the page's payload).
        evicting: the write is an eviction (counted as such when it completes).
        crc: CRC-32C of the payload (:mod:`.checksum`), computed by the job (before
            writing / after reading).
        seconds: time spent in I/O and CRC (seconds).
        error: the exception the job ended with, if any.
        done: set when the pool has processed the completion.
    """

    op: str
    page: Any
    buffer: memoryview
    offset: int
    payload: int
    evicting: bool = False
    crc: int | None = None
    seconds: float = 0.0
    error: BaseException | None = None
    done: bool = False


class IoScheduler:
    """A bounded pool of I/O threads with a bounded number of outstanding jobs.

    At most ``queue_depth`` jobs are handed to the threads at once; more wait in a FIFO
    here. Each finished job is passed to ``on_complete`` on the I/O thread, which must
    take the pool's lock, process it and call :meth:`job_finished` under that lock.

    Args:
        file: the slab file.
        threads: number of I/O threads (>= 1).
        queue_depth: maximum jobs outstanding at the threads (>= 1).
        on_complete: the pool's completion handler.
    """

    def __init__(
        self,
        file: NvmeFile,
        threads: int,
        queue_depth: int,
        on_complete: Callable[[IoJob], None],
    ) -> None:
        self._file = file
        self._depth = queue_depth
        self._on_complete = on_complete
        self._listeners: list[Callable[[IoJob], None]] = []
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zr-io")
        self._pending: collections.deque[IoJob] = collections.deque()
        self._outstanding = 0

    def add_listener(self, listener: Callable[[IoJob], None]) -> None:
        """Call ``listener(job)`` for every finished job (its ``op``, ``payload`` bytes,
        ``seconds``, ``error``), on the I/O thread, before the pool processes it; a
        listener must be quick and must not take the pool's lock."""
        self._listeners.append(listener)

    def submit(self, job: IoJob) -> None:
        """Queue ``job``; never blocks. Call under the pool's lock."""
        if self._outstanding < self._depth:
            self._outstanding += 1
            self._executor.submit(self._run, job)
        else:
            self._pending.append(job)

    def job_finished(self) -> None:
        """Account a processed completion and start queued jobs. Call under the pool's lock."""
        self._outstanding -= 1
        while self._pending and self._outstanding < self._depth:
            self._outstanding += 1
            self._executor.submit(self._run, self._pending.popleft())

    def busy(self) -> bool:
        """True while any job is queued or running."""
        return self._outstanding > 0 or bool(self._pending)

    def _run(self, job: IoJob) -> None:
        start = time.perf_counter()
        try:
            if job.op == "write":
                job.crc = page_checksum(job.buffer[: job.payload])
                self._file.pwrite(job.buffer, job.offset)
            else:
                self._file.pread_into(job.buffer, job.offset)
                job.crc = page_checksum(job.buffer[: job.payload])
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
            job.error = exc
        job.seconds = time.perf_counter() - start
        for listener in self._listeners:
            listener(job)
        self._on_complete(job)

    def shutdown(self) -> None:
        """Wait for the threads to finish their jobs and stop them."""
        self._executor.shutdown(wait=True)
