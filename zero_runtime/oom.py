"""Post-mortem OOM report: what failed, who held each tier, and what would have fit.

When a step runs out of memory the runtime writes one JSON object (the shared contract,
``docs/oom.md``) *before* the error propagates, in two forms: the summary
``memory_hierarchy/oom`` (the writer is flushed) and the file
``<run_dir>/memory_hierarchy_oom.json`` (written to a temporary file, then renamed).

Triggers (checked by ``zero_runtime.runtime.postmortem``, wired by ``ZeroRuntime``):

- the paged pool cannot place a page (:class:`~zero_runtime.memory.PoolOutOfMemoryError`,
  raised inside the optimizer's host update);
- the device tier's used bytes exceed ``device_budget_bytes`` at a step boundary
  (:class:`DeviceBudgetExceededError`): on the CPU stand-in the budget is enforced here;
- the host's available memory falls below a margin at a step boundary
  (:class:`HostMemoryLowError`), before the kernel's OOM killer ends the process;
- a ``tf.errors.ResourceExhaustedError`` raised by TensorFlow's own ops, when it escapes
  to the interpreter (``sys.excepthook``) or is passed to
  ``ZeroInfinityStrategy.write_postmortem(exc)``.

Errors raised here subclass both ``tf.errors.ResourceExhaustedError`` and Python's
``MemoryError``: TensorFlow maps an exception from ``tf.numpy_function`` to an error code
by its Python type (``MemoryError`` -> RESOURCE_EXHAUSTED; any other type, including an
``OpError`` subclass, becomes ``UnknownError``), so the mix-in is what lets
``model.fit`` surface a ``ResourceExhaustedError``.

Advice (``zero_runtime.runtime.advice.advise``): single config changes, each replayed
on the failed step's recorded figures and labelled "fits" (with a margin), "may fit" (with
the missing bytes) or "does not fit"; the summary names the cause first
(``zero_runtime.runtime.advice.diagnose``).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

import psutil
import tensorflow as tf

# The report's contract lives in a module without TensorFlow (``zero-runtime oom-report``
# reads reports without loading it); re-exported here for the runtime's callers.
from zero_runtime.oom_report import (  # noqa: F401
    CHECKED_SOURCES,
    HOLDER_KINDS,
    MESSAGE_CHARS,
    OOM_FILENAME,
    OOM_VERSION,
    SPEED_COSTS,
    UNATTRIBUTED,
    USED_MEANS,
    build_report,
    display_name,
    find_report,
    fmt_bytes,
    format_report,
    holder,
    request_from_message,
    request_text,
    short_message,
    tier_row,
    verdict_text,
    write_json_atomic,
)

#: Host memory (bytes) that must stay available at a step boundary; below it the step
#: fails with :class:`HostMemoryLowError`. Override with ``$ZERO_RUNTIME_HOST_MARGIN_BYTES``.
DEFAULT_HOST_MARGIN_BYTES = 128 << 20


class OutOfMemoryError(tf.errors.ResourceExhaustedError, MemoryError):
    """A runtime out-of-memory failure whose post-mortem was written.

    Attributes:
        tier: the tier that ran out ('device', 'host' or 'nvme').
        postmortem_path: the JSON post-mortem file, or None when there is no run directory.
        report: the post-mortem object (shared contract).
    """

    def __init__(self, message: str, tier: str) -> None:
        self.tier = tier
        self.postmortem_path: str | None = None
        self.report: dict[str, Any] | None = None
        super().__init__(None, None, message)

    def attach(self, path: str | None, report: dict[str, Any]) -> None:
        """Record the written post-mortem and name it in the error message."""
        self.postmortem_path = path
        self.report = report
        where = path if path else "(no logdir: report only in the exception)"
        self._message = f"{self._message}\npost-mortem: {where}"


class DeviceBudgetExceededError(OutOfMemoryError):
    """The device tier used more than ``device_budget_bytes`` at a step boundary.

    Attributes:
        used_bytes: bytes in use (framework reading, else the runtime's accounting).
        budget_bytes: the budget.
    """

    def __init__(self, used_bytes: int, budget_bytes: int, step: int) -> None:
        self.used_bytes = int(used_bytes)
        self.budget_bytes = int(budget_bytes)
        super().__init__(
            f"step {step}: the device tier's use read at the step-boundary check is "
            f"{used_bytes} bytes, over its budget "
            f"device_budget_bytes={budget_bytes} by {used_bytes - budget_bytes} bytes",
            "device",
        )


class HostMemoryLowError(OutOfMemoryError):
    """Host memory available fell below the margin at a step boundary.

    Attributes:
        available_bytes: ``psutil.virtual_memory().available``.
        margin_bytes: the margin.
    """

    def __init__(self, available_bytes: int, margin_bytes: int, step: int) -> None:
        self.available_bytes = int(available_bytes)
        self.margin_bytes = int(margin_bytes)
        super().__init__(
            f"step {step}: only {available_bytes} bytes of host memory are available, below "
            f"the margin of {margin_bytes} bytes; stopping before the kernel's OOM killer does",
            "host",
        )


class TierOutOfMemoryError(OutOfMemoryError):
    """The paged pool could not place a page (wraps ``PoolOutOfMemoryError`` as cause)."""


def host_margin_bytes() -> int:
    """The host-memory margin, bytes (:data:`DEFAULT_HOST_MARGIN_BYTES` or the env var)."""
    return int(os.environ.get("ZERO_RUNTIME_HOST_MARGIN_BYTES", DEFAULT_HOST_MARGIN_BYTES))


# -- uncaught TensorFlow OOMs -------------------------------------------------------------
_RUNTIMES: weakref.WeakSet = weakref.WeakSet()
_HOOK_LOCK = threading.Lock()
_PREVIOUS_HOOK: list = []


def install_excepthook(runtime: Any) -> None:
    """Chain ``sys.excepthook`` so an uncaught ``ResourceExhaustedError`` writes the
    post-mortem of every open runtime (``runtime.write_postmortem(exc)``) before the
    previous hook prints it. Installed once per process; runtimes are held weakly.

    Limits: only errors that reach the interpreter's top level (a script, not a notebook
    cell or a caller that catches them) trigger it; use
    ``ZeroInfinityStrategy.write_postmortem(exc)`` in an ``except`` block otherwise.
    """
    _RUNTIMES.add(runtime)
    with _HOOK_LOCK:
        if _PREVIOUS_HOOK:
            return
        _PREVIOUS_HOOK.append(sys.excepthook)
        sys.excepthook = _excepthook


def _excepthook(exc_type, exc, tb) -> None:
    if isinstance(exc, tf.errors.ResourceExhaustedError):
        for runtime in list(_RUNTIMES):
            try:
                runtime.write_postmortem(exc)
            except Exception as err:  # noqa: BLE001 - never mask the original error
                print(f"zero_runtime: could not write the OOM post-mortem: {err}", file=sys.stderr)
    _PREVIOUS_HOOK[0](exc_type, exc, tb)


def physical_host_bytes() -> int:
    """Physical host memory, bytes (psutil)."""
    return int(psutil.virtual_memory().total)
