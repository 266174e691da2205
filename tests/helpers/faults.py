"""Real faults for the fault tests: a small file system that fills up, and filling it.

:func:`mount_tmpfs` mounts a tmpfs (this needs root, as in CI's container);
:func:`mount_tmpfs_or_skip` skips the test when ``mount`` is refused; :func:`fill` writes
a filler file until the file system reports ``ENOSPC``, so the next write anywhere on it
fails for real.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path


def mount_tmpfs(target: Path, options: str) -> str | None:
    """Mount a tmpfs with ``mount -o options`` (``"size=1m"``, ``"ro,size=1m"``) on
    ``target`` (created if missing). Returns None on success, else ``mount``'s error."""
    target.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
        capture_output=True,
        text=True,
    )
    return None if result.returncode == 0 else (result.stderr.strip() or "mount failed")


def mount_tmpfs_or_skip(target: Path, options: str) -> Path:
    """:func:`mount_tmpfs`, skipping the calling test when ``mount`` is refused.

    Mounting needs root: these tests run as root, as CI's container does (``.ci/run``),
    and are skipped only for a non-root developer, with ``mount``'s reason.
    """
    import pytest

    error = mount_tmpfs(target, options)
    if error is not None:
        pytest.skip(f"needs root to mount a tmpfs (runs as root, e.g. in CI): {error}")
    return target


def unmount(target: Path) -> None:
    """Lazily unmount ``target`` (files still open elsewhere do not block it)."""
    subprocess.run(["umount", "-l", str(target)], check=False)


def fill(directory: Path, name: str = "filler") -> Path:
    """Write ``directory/name`` until its file system is full (``ENOSPC``); returns the
    filler's path (unlink it to free the space)."""
    path = directory / name
    block = b"\xa5" * 4096
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        for size in (512, 64, 8, 1):  # the last partial page too
            try:
                while True:
                    os.write(fd, block[:size])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)
    return path
