"""An event file writer with C checksums, for the runtime's per-step summaries.

TensorBoard's ``EventFileWriter`` frames each record with a masked CRC-32C computed in
pure Python (``tensorboard.compat.tensorflow_stub``): about 0.5 microseconds per byte,
holding the GIL, so a 1 KiB per-step record costs the background writer about 0.5 ms of
the training process's only interpreter every step. :class:`EventFileWriter` writes the
same files (same name pattern, same first ``file_version`` event, the same TFRecord
framing byte for byte) with the checksum from the ``crc32c`` package (C, the hardware
instruction; the NVMe tier's page checksums use it too, ``zero_runtime/memory/checksum.py``):
about a microsecond per record, on its own background thread.

TFRecord framing (TensorFlow ``core/lib/io/record_writer.cc``): ``uint64 length``,
``uint32 masked_crc32c(length)``, ``data``, ``uint32 masked_crc32c(data)``, little-endian;
the mask is ``((crc >> 15) | (crc << 17)) + 0xa282ead8`` modulo 2**32.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import struct
import threading
import time

import crc32c
from tensorboard.compat.proto import event_pb2

_MASK_DELTA = 0xA282EAD8
_FLUSH = object()  # queue marker: flush the file now
_CLOSE = object()  # queue marker: flush, close the file and stop
# distinguishes files one process opens in the same second; zero-padded so names sort in
# creation order (TensorBoard's directory watcher skips a file named before the last one)
_uid = itertools.count()


def masked_crc32c(data: bytes) -> int:
    """The TFRecord checksum of ``data``: CRC-32C (Castagnoli), rotated and offset.

    Returns:
        An unsigned 32-bit integer.
    """
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One TFRecord: ``data`` with its length and both checksums (see the module doc)."""
    header = struct.pack("<Q", len(data))
    return b"".join(
        (
            header,
            struct.pack("<I", masked_crc32c(header)),
            data,
            struct.pack("<I", masked_crc32c(data)),
        )
    )


class EventFileWriter:
    """Write ``Event`` protos to a new event file in ``logdir``, asynchronously.

    A drop-in for ``tensorboard.summary.writer.event_file_writer.EventFileWriter``
    (``add_event``, ``flush``, ``close``, ``get_logdir``) on local paths.

    Args:
        logdir: the directory (created if missing).
        max_queue_size: events held before :meth:`add_event` blocks (count).
        flush_secs: the file is flushed at least this often while events arrive (seconds).
        filename_suffix: appended to ``events.out.tfevents.<time>.<host>.<pid>.<n>``
            (``<n>``: six digits, counting the files this process opened).

    Raises:
        OSError: the directory or the file cannot be created. An error of the background
            thread is raised by the next :meth:`add_event`, :meth:`flush` or :meth:`close`.
    """

    def __init__(
        self,
        logdir: str,
        max_queue_size: int = 1024,
        flush_secs: float = 120.0,
        filename_suffix: str = "",
    ) -> None:
        self._logdir = str(logdir)
        os.makedirs(self._logdir, exist_ok=True)
        stamp = f"{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_uid):06d}"
        name = f"events.out.tfevents.{stamp}"
        self.path = os.path.join(self._logdir, name + filename_suffix)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by the thread
        first = event_pb2.Event(
            wall_time=time.time(),
            file_version="brain.Event:2",
            source_metadata=event_pb2.SourceMetadata(writer="tb_plugin.event_file"),
        )
        self._file.write(frame(first.SerializeToString()))
        self._file.flush()
        self._flush_secs = flush_secs
        self._queue: queue.Queue = queue.Queue(max_queue_size)
        self._error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name="memory_hierarchy-event-writer", daemon=True
        )
        self._thread.start()

    def get_logdir(self) -> str:
        """The directory the file is in."""
        return self._logdir

    def add_event(self, event: event_pb2.Event) -> None:
        """Queue one event for writing (serialised now, framed and written by the thread).

        Raises:
            TypeError: ``event`` is not an ``Event`` proto.
            OSError: the writer is closed, or the background thread failed.
        """
        if not isinstance(event, event_pb2.Event):
            raise TypeError(f"expected an event_pb2.Event proto, got {type(event)}")
        self._check()
        self._queue.put(event.SerializeToString())

    def add_serialized_event(self, data: bytes) -> None:
        """Queue one already serialised ``Event`` proto (``Event.SerializeToString()``
        or bytes equal to it) for writing, as :meth:`add_event` does after serialising.

        Raises:
            TypeError: ``data`` is not ``bytes``.
            OSError: the writer is closed, or the background thread failed.
        """
        if not isinstance(data, bytes):
            raise TypeError(f"expected the bytes of a serialised Event, got {type(data)}")
        self._check()
        self._queue.put(data)

    def add_serialized_events(self, events: list[bytes]) -> None:
        """Queue several serialised ``Event`` protos as one item: the thread writes them
        in order with one wake-up.

        Raises:
            TypeError: an element of ``events`` is not ``bytes``.
            OSError: the writer is closed, or the background thread failed.
        """
        for data in events:
            if not isinstance(data, bytes):
                raise TypeError(f"expected the bytes of a serialised Event, got {type(data)}")
        self._check()
        self._queue.put(list(events))

    def flush(self) -> None:
        """Block until every event queued so far is written and the file flushed."""
        self._check()
        self._queue.put(_FLUSH)
        self._queue.join()
        self._check()

    def close(self) -> None:
        """Write everything queued, close the file and stop the thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_CLOSE)
        self._thread.join()
        if self._error is not None:
            raise OSError(f"writing {self.path} failed: {self._error}") from self._error

    def _check(self) -> None:
        if self._error is not None:
            raise OSError(f"writing {self.path} failed: {self._error}") from self._error
        if self._closed:
            raise OSError(f"the event file writer of {self.path} is closed")

    def _run(self) -> None:
        """Write queued records; flush on request, on close, and ``flush_secs`` after the
        first record written since the last flush."""
        deadline = None  # when the records written since the last flush are flushed
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:  # the deadline passed: flush (nothing was taken)
                deadline = self._step(_FLUSH, deadline)
                continue
            try:
                deadline = self._step(item, deadline)
            finally:
                self._queue.task_done()
            if item is _CLOSE:
                return

    def _step(self, item: object, deadline: float | None) -> float | None:
        """Handle one queue item; returns the next flush deadline (None: nothing unflushed)."""
        if self._error is not None:
            if item is _CLOSE:
                self._file.close()
            return None
        try:
            if item is _FLUSH or item is _CLOSE:
                self._file.flush()
                deadline = None
            elif isinstance(item, list):  # add_serialized_events
                self._file.write(b"".join([frame(data) for data in item]))
                if deadline is None:
                    deadline = time.monotonic() + self._flush_secs
            else:
                self._file.write(frame(item))  # type: ignore[arg-type]
                if deadline is None:
                    deadline = time.monotonic() + self._flush_secs
        except BaseException as exc:  # noqa: BLE001 - raised to the caller by _check
            self._error = exc
        if item is _CLOSE:
            self._file.close()
        return deadline
