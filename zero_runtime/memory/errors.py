"""Errors raised by the paged buffer pool.

:class:`PoolOutOfMemoryError` subclasses TensorFlow's ``ResourceExhaustedError`` so a
training loop that already catches TensorFlow OOMs catches the pool's too; it carries an
:class:`OomSnapshot` for the post-mortem report. Everything else derives from
:class:`PagingError`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf


class PagingError(RuntimeError):
    """Base class of the pool's own errors (other than out-of-memory)."""


class PoolClosedError(PagingError):
    """An operation was attempted on a pool after :meth:`PagedBufferPool.close`."""


class PageStateError(PagingError):
    """Internal error: a page was asked to make a transition its state does not allow.

    Raised by :meth:`PageTable.transition`; it means a bug in the pool, not a user error.
    """


class NvmePathError(PagingError):
    """``nvme_path`` is missing, not a directory, not writable or lacks the budgeted space."""


class PageChecksumError(PagingError):
    """A page read back from the NVMe tier does not match the CRC-32C recorded when written.

    Attributes:
        path: the slab file read.
        offset: byte offset of the page's slot in that file.
        tensor_id: the tensor the page belongs to.
        page_index: the page's index within the tensor (0-based).
        expected: CRC-32C recorded at write time (:mod:`.checksum`).
        actual: CRC-32C of the bytes read.
    """

    def __init__(
        self,
        path: str,
        offset: int,
        tensor_id: str,
        page_index: int,
        expected: int,
        actual: int,
    ) -> None:
        self.path = path
        self.offset = offset
        self.tensor_id = tensor_id
        self.page_index = page_index
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"checksum mismatch reading page {page_index} of tensor {tensor_id!r} from "
            f"{path} at offset {offset}: expected crc32c {expected:#010x}, read {actual:#010x}; "
            f"the file was modified or the disk returned bad data. The page stays on NVMe."
        )


@dataclasses.dataclass(frozen=True)
class Holder:
    """One tensor's share of a tier, as listed in an :class:`OomSnapshot`.

    Attributes:
        tensor_id: the tensor.
        kind: its accounting label ('param', 'grad', 'optimizer', 'activation', 'other').
        bytes: bytes of the tier it holds (whole pages, so a multiple of the page size).
        pages: number of its pages on the tier.
    """

    tensor_id: str
    kind: str
    bytes: int
    pages: int


@dataclasses.dataclass(frozen=True)
class OomSnapshot:
    """The state of the pool when a request could not be placed.

    Attributes:
        request_bytes: bytes requested (the tensor's size; whole pages).
        request_tensor_id: the tensor being placed or brought in.
        request_tier: the tier it was to be placed on.
        tiers: per tier name, ``{"capacity_bytes": int | None, "used_bytes": int}``
            (``None`` capacity means unbounded).
        holders: per tier name, the largest holders, biggest first (at most 10).
        reason: one sentence on why nothing could move.
    """

    request_bytes: int
    request_tensor_id: str
    request_tier: str
    tiers: dict[str, dict[str, int | None]]
    holders: dict[str, tuple[Holder, ...]]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """Return the snapshot as plain JSON-serialisable data (for the OOM report)."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """Return a multi-line human-readable summary (used as the error message)."""
        lines = [
            f"cannot place {self.request_bytes} bytes of tensor {self.request_tensor_id!r} "
            f"on tier {self.request_tier!r}: {self.reason}"
        ]
        for name, t in self.tiers.items():
            cap = "unbounded" if t["capacity_bytes"] is None else f"{t['capacity_bytes']} B"
            top = ", ".join(
                f"{h.tensor_id!r} ({h.kind}, {h.bytes} B, {h.pages} pages)"
                for h in self.holders.get(name, ())[:3]
            )
            lines.append(f"  {name}: used {t['used_bytes']} B of {cap}; largest: {top or '-'}")
        return "\n".join(lines)


class PoolOutOfMemoryError(tf.errors.ResourceExhaustedError):
    """The pool could not place a page: the tier is full and nothing could move down.

    A ``tf.errors.ResourceExhaustedError``, so ``except tf.errors.ResourceExhaustedError``
    catches it like any TensorFlow OOM.

    Attributes:
        snapshot: the :class:`OomSnapshot` of the request and of every tier.
    """

    def __init__(self, snapshot: OomSnapshot, message: str | None = None) -> None:
        self.snapshot = snapshot
        super().__init__(None, None, message or snapshot.describe())


class NvmeFullError(PoolOutOfMemoryError):
    """The disk under ``nvme_path`` ran out of space (ENOSPC) while a page was written.

    The page stays where it was (on the host tier); nothing is lost.

    Attributes:
        path: the slab file being written.
        errno: ``errno.ENOSPC``.
        snapshot: as for :class:`PoolOutOfMemoryError`.
    """

    def __init__(self, snapshot: OomSnapshot, path: str, errno_: int, detail: str) -> None:
        self.path = path
        self.errno = errno_
        super().__init__(
            snapshot,
            f"disk full (ENOSPC) writing to {path}: {detail}; the page stays on the host "
            f"tier and no data was lost. Free space under the NVMe path or lower "
            f"nvme_budget_bytes.\n{snapshot.describe()}",
        )
