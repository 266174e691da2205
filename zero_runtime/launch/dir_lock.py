"""One job per checkpoint directory: an exclusive ``flock`` on the directory itself.

``zero-runtime launch --checkpoint-dir DIR`` holds the lock for the job's whole life, across
restarts; a second job on the same directory is refused before any of its workers starts,
naming the holder (its pid and command line, from ``/proc/locks``). The lock is on the
directory's own descriptor, so nothing is written into it; the kernel releases it when
the holder exits, even when it is killed (no stale lock file).
"""

from __future__ import annotations

import fcntl
import os


class DirectoryLockedError(Exception):
    """The directory is locked by another process; the message names it."""


class DirectoryLock:
    """An exclusive lock on a directory, created (with its parents) when missing.

    Args:
        path: the directory.

    Raises (from :meth:`acquire`):
        DirectoryLockedError: another process holds the lock.
        NotADirectoryError: ``path`` exists and is not a directory.
        OSError: the directory cannot be created or opened.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        """Take the lock (non-blocking); returns self."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise NotADirectoryError(f"checkpoint directory {self.path!r} is not a directory")
        os.makedirs(self.path, exist_ok=True)
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            stat = os.fstat(fd)
            os.close(fd)
            raise DirectoryLockedError(
                f"checkpoint directory {self.path!r} is in use by another job "
                f"({holder(stat.st_dev, stat.st_ino)}): wait for it to end, or use another "
                "directory (nothing was changed)"
            ) from None
        self._fd = fd
        return self

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holder(dev: int, inode: int) -> str:
    """``"pid P: <command line>"`` of the process holding a ``flock`` on the file
    ``(dev, inode)``, from ``/proc/locks``; ``"holder unknown"`` when not found."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{inode}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return "holder unknown"
    for line in lines:
        fields = line.split()
        if "FLOCK" in fields and want in fields:
            pid = fields[fields.index(want) - 1]
            return f"pid {pid}: {_command(pid)}"
    return "holder unknown"


def _command(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return "?"
    return " ".join(w.decode(errors="replace") for w in words if w)[:300]
