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

import glob
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import psutil
import tensorflow as tf

from tb_plugin import metadata

#: File name of the post-mortem in the run directory.
OOM_FILENAME = "memory_hierarchy_oom.json"

#: Version of the post-mortem JSON object.
OOM_VERSION = 1

#: Host memory (bytes) that must stay available at a step boundary; below it the step
#: fails with :class:`HostMemoryLowError`. Override with ``$ZERO_RUNTIME_HOST_MARGIN_BYTES``.
DEFAULT_HOST_MARGIN_BYTES = 128 << 20

SPEED_COSTS = ("none", "low", "medium", "high")
HOLDER_KINDS = ("param", "grad", "optimizer", "activation", "other")


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
            f"step {step}: the device tier uses {used_bytes} bytes, over its budget "
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


# -- the report ---------------------------------------------------------------------------
_SHAPE_RE = re.compile(r"shape\s*\[([\d,\s]*)\]\s*and type (\w+)")
_DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "double": 8,
    "float64": 8,
    "half": 2,
    "bfloat16": 2,
    "int32": 4,
    "int64": 8,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "int16": 2,
}


def request_from_message(message: str) -> int | None:
    """Bytes of the tensor a TensorFlow OOM message names, or None.

    Parses ``"OOM when allocating tensor with shape[a,b] and type float ..."``.
    """
    m = _SHAPE_RE.search(message or "")
    if not m or m.group(2) not in _DTYPE_BYTES:
        return None
    dims = [int(d) for d in m.group(1).replace(" ", "").split(",") if d]
    return math.prod(dims) * _DTYPE_BYTES[m.group(2)]


def _num(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _int(x: Any) -> int | None:
    v = _num(x)
    return None if v is None else int(v)


def build_report(
    *,
    step: int,
    failed: Mapping[str, Any],
    tiers: Mapping[str, Mapping[str, Any]],
    recent_steps: list[dict[str, Any]],
    config: Mapping[str, Any],
    config_version: int,
    config_history: list[dict[str, Any]],
    readings: Mapping[str, Any],
    advice: list[dict[str, Any]],
    cause: str | None = None,
) -> dict[str, Any]:
    """Assemble the post-mortem object of the shared contract (``docs/oom.md``).

    Args:
        step: the step that failed.
        failed: ``failed_request`` (bytes, tier, tensor, op, error_type, message).
        tiers: tier -> ``{"capacity_bytes", "used_bytes", "holders": [...]}``.
        recent_steps: flight-recorder rows, oldest first.
        config: the active ZeroConfig dict.
        config_version: its version (0 = as started).
        config_history: config_event objects, oldest first.
        readings: READING_COLUMNS -> bytes or None.
        advice: ranked advice (``zero_runtime.runtime.advice.advise``).
        cause: the failure's cause in one sentence first in the
            summary and as the report's ``cause``; None: not named
            (``zero_runtime.runtime.advice.diagnose``).

    Returns:
        The JSON-serialisable report, with ``nothing_fits``, ``cause`` and a one-paragraph
        ``summary``.
    """
    tier = failed["tier"]
    t = tiers.get(tier, {})
    nothing_fits = not any(a["fits"] for a in advice)
    used, cap = t.get("used_bytes"), t.get("capacity_bytes")
    top = sorted(t.get("holders", []), key=lambda h: -h["bytes"])[:3]
    holders = ", ".join(f"{h['name']} {fmt_bytes(h['bytes'])}" for h in top) or "no known holders"
    req = failed.get("bytes")
    # The step and tier, then the cause, then the figures, holders and the best change.
    text = (
        f"Step {step} ran out of memory on the {tier} tier"
        + (f": {cause}" if cause else "")
        + f" ({failed['error_type']}; {fmt_bytes(used)} used of {fmt_bytes(cap)}"
        + (f", {fmt_bytes(req)} more requested" if req else "")
        + f"). Largest holders: {holders}. "
    )
    if nothing_fits:
        text += "No single change of this runtime's settings is verified to fit on this machine"
        maybe = [a for a in advice if a.get("verdict") == "may fit"]
        if maybe:
            m = maybe[0]
            change = ", ".join(f"{k}={json.dumps(v)}" for k, v in m["change"].items())
            short = m.get("missing_bytes")
            text += f"; {change} may fit" + (f" ({fmt_bytes(short)} short)" if short else "")
        text += "."
    else:
        best = advice[0]
        change = ", ".join(f"{k}={json.dumps(v)}" for k, v in best["change"].items())
        text += (
            f"Best single change: {change} ({best['description']}; speed cost "
            f"{best['speed_cost']})."
        )
    return {
        "version": OOM_VERSION,
        "step": int(step),
        "wall_time": time.time(),
        "failed_request": dict(failed),
        "tiers": {k: dict(v) for k, v in tiers.items()},
        "recent_steps": recent_steps,
        "config": dict(config),
        "config_version": int(config_version),
        "config_history": config_history,
        "readings": {c: _num(readings.get(c)) for c in metadata.READING_COLUMNS},
        "advice": advice,
        "nothing_fits": nothing_fits,
        "cause": cause,
        "summary": text,
    }


def fmt_bytes(n: Any) -> str:
    """``n`` bytes as text with a binary unit ("3.91 MiB"); "unknown" for None/NaN."""
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "unknown"
    n = float(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# -- files --------------------------------------------------------------------------------
def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path``: a temporary file in the same directory, fsync,
    then ``os.replace`` (readers see the old file or the new one, never a partial one)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".oom-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, sort_keys=True, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def find_report(path: str) -> str | None:
    """The newest ``memory_hierarchy_oom.json`` at ``path`` (a file, a run dir or a logdir,
    searched recursively), or None."""
    if os.path.isfile(path):
        return path
    found = glob.glob(os.path.join(glob.escape(path), "**", OOM_FILENAME), recursive=True)
    return max(found, key=os.path.getmtime) if found else None


def format_report(report: Mapping[str, Any], path: str | None = None) -> str:
    """The post-mortem as text: summary, failed request, tiers with holders, advice."""
    f = report["failed_request"]
    lines = ["OOM post-mortem" + (f" ({path})" if path else ""), "", report["summary"], ""]
    lines.append(
        f"failed request: tier {f['tier']}, {fmt_bytes(f.get('bytes')) if f.get('bytes') else '-'}"
        f", tensor {f.get('tensor') or '-'}, op {f.get('op') or '-'}, {f['error_type']}"
    )
    lines.append(f"step {report['step']}, config version {report['config_version']}")
    lines.append("")
    for name, t in report["tiers"].items():
        used, cap = fmt_bytes(t.get("used_bytes")), fmt_bytes(t.get("capacity_bytes"))
        lines.append(f"{name}: used {used} of {cap}")
        for h in sorted(t.get("holders", []), key=lambda h: -h["bytes"])[:10]:
            pages = f", {h['pages']} pages" if h.get("pages") is not None else ""
            lines.append(f"    {h['name']:<40} {h['kind']:<10} {fmt_bytes(h['bytes'])}{pages}")
    lines.append("")
    lines.append("advice (rank, change, frees, verdict, speed cost):")
    for a in report["advice"]:
        change = ", ".join(f"{k}={json.dumps(v)}" for k, v in a["change"].items())
        verdict = a.get("verdict") or ("fits" if a["fits"] else "does not fit")
        if verdict != "fits" and a.get("missing_bytes"):
            verdict += f" ({fmt_bytes(a['missing_bytes'])} short)"
        lines.append(
            f"  {a['rank']}. {change}: frees {fmt_bytes(a['frees_bytes'])}, "
            f"{verdict}, {a['speed_cost']} - {a['description']}"
        )
    if not report["advice"]:
        lines.append("  (none applies)")
    if report["nothing_fits"]:
        lines.append("nothing fits: no single change within this machine makes the step fit")
    return "\n".join(lines)


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


_OBJECT_ID = re.compile(r"#[0-9a-f]{6,}")


def display_name(tensor_id: str | None) -> str | None:
    """A pool tensor id without the Python object id that keeps it unique in the process:
    ``g/gpt.block_0.mlp_norm.gamma#7f3254ce0f10/r0`` -> ``g/gpt.block_0.mlp_norm.gamma/r0``."""
    return None if tensor_id is None else _OBJECT_ID.sub("", tensor_id)


def holder(name: str, kind: str, nbytes: float, pages: int | None = None) -> dict[str, Any]:
    """One holder row of the contract (``kind`` one of :data:`HOLDER_KINDS`); ``name``
    without Python object ids (:func:`display_name`)."""
    return {"name": display_name(name), "kind": kind, "bytes": int(nbytes), "pages": pages}
