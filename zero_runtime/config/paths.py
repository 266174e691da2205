"""The filesystem paths a run writes to, checked before anything trains.

A config's values are checked when the config is built (:mod:`.zero_config`), but its
paths name places on the machine that runs the job, and the same config may be built on
another (the what-if view, the estimator). So the strategy checks them when it is created
(:class:`~zero_runtime.strategy.ZeroInfinityStrategy`), before the first step: a bad
``nvme_path`` or log directory is one line at once, not a traceback at the first step.

- :func:`check_nvme_path`: the NVMe tier's directory (the slab file is created in it,
  :class:`~zero_runtime.memory.io.SlabFile`) and
- :func:`check_logdir`: the run's log directory

are created if missing (with their parents); each must end up a directory this process
can write.
"""

from __future__ import annotations

import os

from zero_runtime.config.errors import ZeroConfigError


def check_nvme_path(path: str) -> str:
    """Check that ``path`` can hold the NVMe tier's files, creating it if missing (with
    its parents, as DeepSpeed creates its swap folders).

    Args:
        path: the config's ``nvme_path`` (str, relative to the working directory or
            absolute).

    Returns:
        The absolute path.

    Raises:
        ZeroConfigError: (``key='nvme_path'``) ``path`` is a file, cannot be created, or
            this process cannot create files in it; the message names the path, what is
            wrong and what is accepted.
    """
    return _writable_directory(path, "nvme_path", ZeroConfigError)


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
    return _writable_directory(path, "logdir", ValueError)


def _writable_directory(path: str, name: str, error: type[ValueError]) -> str:
    """``path`` made absolute, created if missing, checked writable (see the callers)."""
    full = os.path.abspath(path)
    accepted = "a directory this process can create and write, on a local disk"
    problem = None
    if os.path.exists(full) and not os.path.isdir(full):
        problem = f"{full} is a file, not a directory"
    else:
        try:
            os.makedirs(full, exist_ok=True)
        except OSError as exc:
            problem = f"cannot create {full} ({exc.strerror})"
        else:
            if not os.access(full, os.W_OK | os.X_OK):
                problem = f"{full} is not writable by this process"
    if problem is None:
        return full
    message = f"{name}={path!r} is invalid: {problem}; expected {accepted}"
    if error is ZeroConfigError:
        raise ZeroConfigError(message, key=name, value=path, accepted=accepted)
    raise error(message)
