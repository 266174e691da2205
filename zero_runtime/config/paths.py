"""The filesystem paths a run writes to, checked before anything trains.

A config's values are checked when the config is built (:mod:`.zero_config`), but its
paths name places on the machine that runs the job, and the same config may be built on
another (the what-if view, the estimator). So the strategy checks them when it is created
(:class:`~zero_runtime.strategy.ZeroInfinityStrategy`), before the first step: a bad
``nvme_path`` or log directory is one line at once, not a traceback at the first step.

- :func:`check_nvme_path`: the NVMe tier's directory must exist, be a directory and be
  writable (the slab file is created in it, :class:`~zero_runtime.memory.io.SlabFile`).
- :func:`check_logdir`: the run's log directory is created if missing; it must end up a
  writable directory.
"""

from __future__ import annotations

import os

from zero_runtime.config.errors import ZeroConfigError


def check_nvme_path(path: str) -> str:
    """Check that ``path`` can hold the NVMe tier's files.

    Args:
        path: the config's ``nvme_path`` (str, relative to the working directory or
            absolute).

    Returns:
        The absolute path.

    Raises:
        ZeroConfigError: (``key='nvme_path'``) ``path`` does not exist, is not a
            directory, or this process cannot create files in it; the message names the
            path, what is wrong and what is accepted.
    """
    full = os.path.abspath(path)
    accepted = "an existing directory this process can write, on a local disk"
    problem = None
    if not os.path.exists(full):
        problem = "does not exist (create it first: mkdir -p)"
    elif not os.path.isdir(full):
        problem = "is a file, not a directory"
    elif not os.access(full, os.W_OK | os.X_OK):
        problem = "is not writable by this process"
    if problem is not None:
        raise ZeroConfigError(
            f"nvme_path={path!r} is invalid: {full} {problem}; expected {accepted}",
            key="nvme_path",
            value=path,
            accepted=accepted,
        )
    return full


def check_logdir(path: str) -> str:
    """Create the run's log directory ``path`` if missing and check that it is writable.

    Args:
        path: the ``logdir`` given to the strategy (str).

    Returns:
        The absolute path.

    Raises:
        ValueError: ``path`` is a file, cannot be created, or is not writable; the
            message names the path and the cause.
    """
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise ValueError(f"logdir={path!r} is invalid: {full} is a file, not a directory")
    try:
        os.makedirs(full, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"logdir={path!r} is invalid: cannot create {full} ({exc.strerror}); pass a "
            "directory this process can write"
        ) from exc
    if not os.access(full, os.W_OK | os.X_OK):
        raise ValueError(
            f"logdir={path!r} is invalid: {full} is not writable by this process; pass a "
            "directory this process can write"
        )
    return full
