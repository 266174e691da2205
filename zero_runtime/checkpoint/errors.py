"""Errors raised by :mod:`zero_runtime.checkpoint`; each message names the bad value."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of checkpoint errors."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for: a missing directory, tag or ``latest``."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files do not match its index: a missing shard file, a size or
    SHA-256 checksum mismatch, an unreadable or newer-than-known index."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the model or optimizer it is restored onto (variable
    count, shape, optimizer slots)."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save could not write a file (a full disk, a quota, no permission, an I/O error).

    An ``OSError`` with the failing call's ``errno``, ``strerror`` and ``filename``; the
    message names the file and, for a full file system (``ENOSPC``, ``EDQUOT``, ``EFBIG``),
    the bytes the save needed and the bytes free. The save's temporary directory is
    removed first and the published checkpoints and ``latest`` are untouched, so the next
    save (with room) works.

    Attributes:
        path: the file being written.
        bytes_needed: bytes this worker's save writes (its shard files), or None.
        bytes_free: bytes free on the file system after the clean-up, or None.
    """

    def __init__(
        self,
        message: str,
        errno_: int | None,
        path: str,
        bytes_needed: int | None = None,
        bytes_free: int | None = None,
    ) -> None:
        OSError.__init__(self, errno_, message, path)
        self.message = message
        self.path = path
        self.bytes_needed = bytes_needed
        self.bytes_free = bytes_free

    def __str__(self) -> str:
        return self.message
