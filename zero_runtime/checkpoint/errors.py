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
