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

Advice (:func:`advise`): single config changes, each with the bytes it frees on the failed
tier (by the runtime's accounting and the ZeRO paper's per-stage formulas, SC20 section
5.1), whether the step would then have fit, and its expected cost to speed.
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
        advice: ranked advice from :func:`advise`.

    Returns:
        The JSON-serialisable report, with ``nothing_fits`` and a one-paragraph ``summary``.
    """
    tier = failed["tier"]
    t = tiers.get(tier, {})
    nothing_fits = not any(a["fits"] for a in advice)
    used, cap = t.get("used_bytes"), t.get("capacity_bytes")
    top = sorted(t.get("holders", []), key=lambda h: -h["bytes"])[:3]
    holders = ", ".join(f"{h['name']} {_fmt(h['bytes'])}" for h in top) or "no known holders"
    req = failed.get("bytes")
    text = (
        f"Step {step} ran out of memory on the {tier} tier ({failed['error_type']}): "
        f"{_fmt(used)} used of {_fmt(cap)}"
        + (f", {_fmt(req)} more requested" if req else "")
        + f". Largest holders: {holders}. "
    )
    if nothing_fits:
        text += "No single change of this runtime's settings would have fit on this machine."
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
        "summary": text,
    }


def _fmt(n: Any) -> str:
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "unknown"
    n = float(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# -- advice -------------------------------------------------------------------------------
def advise(
    *,
    failed_tier: str,
    required_bytes: int,
    capacity_bytes: int | None,
    holders: Mapping[str, int],
    config: Any,
    num_replicas: int,
    physical_bytes: Mapping[str, int | None],
    free_bytes: Mapping[str, int | None],
    implemented: set[tuple[int, str]] | None = None,
) -> list[dict[str, Any]]:
    """Single config changes that would have made the failed step fit, ranked.

    Each candidate frees bytes on the failed tier by the runtime's own accounting of its
    holders and the ZeRO per-stage formulas (SC20 section 5.1): offloading the optimizer
    states frees their device bytes; stage 1 -> 2 frees ``grad * (1 - 1/N)`` (only the
    reduced gradient shard is kept); stage 2 -> 3 frees ``param * (1 - 1/N)`` (parameter
    shards). A budget raise is offered when the machine physically has the room.

    Ranking: candidates that fit first; among them, changes to the job before a change of
    the machine's budget (a budget is the constraint the user set, raised only if the
    hardware has it), then by speed cost (none < low < medium < high), then by bytes freed.

    Args:
        failed_tier: 'device' | 'host' | 'nvme'.
        required_bytes: bytes the tier needed (used plus the failed request).
        capacity_bytes: the tier's budget (None: unbounded or unknown).
        holders: kind -> bytes on the failed tier ('param', 'grad', 'optimizer', ...).
        config: the active ZeroConfig.
        num_replicas: N_d.
        physical_bytes: tier -> bytes the hardware could give the tier at most (None: unknown).
        free_bytes: tier -> bytes still free on each *target* tier (None: unbounded/unknown).
        implemented: (stage, offload_optimizer) pairs the strategy implements.

    Returns:
        ``[{"rank", "change", "description", "frees_bytes", "fits", "speed_cost"}]``,
        rank 1 = best; empty when no change applies.
    """
    n = max(1, int(num_replicas))
    cap = capacity_bytes
    # The bytes to free: from the larger of the measured need and the runtime's own
    # accounting of the holders (the framework's reading can cover less than the holders,
    # e.g. one replica's allocator), so no change is called "fits" on the smaller figure.
    attributed = sum(int(b) for b in holders.values())
    over = max(required_bytes, attributed) - cap if cap is not None else 0
    cands: list[dict[str, Any]] = []

    def add(change, frees, cost, text, target=None, machine=False):
        frees = int(max(0, frees))
        fits = cap is not None and frees >= over
        if target is not None and free_bytes.get(target) is not None:
            fits = fits and frees <= free_bytes[target]
        cands.append(
            {
                "change": change,
                "description": text,
                "frees_bytes": frees,
                "fits": bool(fits),
                "speed_cost": cost,
                "_machine": machine,
            }
        )

    def impl(stage, offload):
        return implemented is None or (stage, offload) in implemented

    opt = int(holders.get("optimizer", 0))
    grad = int(holders.get("grad", 0))
    param = int(holders.get("param", 0))
    if failed_tier == "device":
        if opt and config.offload_optimizer == "none":
            if impl(config.stage, "cpu"):
                add(
                    {"offload_optimizer": "cpu"},
                    opt,
                    "low",
                    f"offload optimizer states to host memory, freeing {_fmt(opt)} of device",
                    target="host",
                )
            if config.nvme_path and impl(config.stage, "nvme"):
                add(
                    {"offload_optimizer": "nvme"},
                    opt,
                    "high",
                    f"offload optimizer states to NVMe, freeing {_fmt(opt)} of device",
                    target="nvme",
                )
        if config.stage == 0 and (opt or grad or param):
            # Plain data parallelism: every replica holds all model states (SC20 §3.1);
            # each ZeRO stage partitions one more of them over the N replicas (§5.1).
            keep = (n - 1) / n
            if impl(1, "none"):
                add(
                    {"stage": 1},
                    opt * keep,
                    "low",
                    f"ZeRO stage 1 partitions optimizer states (1/{n} per replica)",
                )
            if impl(2, "none"):
                add(
                    {"stage": 2},
                    (opt + grad) * keep,
                    "low",
                    f"ZeRO stage 2 partitions optimizer states and gradients (1/{n})",
                )
            if impl(3, "cpu") and config.offload_param in ("none", "cpu"):
                # Parameters and states leave the device; gathered blocks remain.
                add(
                    {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"},
                    opt + grad + param,
                    "medium",
                    "ZeRO-Infinity: stage 3 with parameters and optimizer states offloaded "
                    "to host memory (only the blocks in use are gathered on the device)",
                    target="host",
                )
        if config.stage == 1 and grad and impl(2, config.offload_optimizer):
            add(
                {"stage": 2},
                grad * (n - 1) // n,
                "low",
                f"ZeRO stage 1 -> 2 keeps only the reduced gradient shard (1/{n})",
            )
        if config.stage == 2 and param and impl(3, config.offload_optimizer):
            add(
                {"stage": 3},
                param * (n - 1) // n,
                "medium",
                f"ZeRO stage 2 -> 3 partitions parameters (1/{n}), gathered per block",
            )
        if config.stage == 3 and getattr(config, "max_live_parameters", None):
            live = int(config.max_live_parameters)
            excess = max(0, over)
            new_live = max(1, live - -(-excess // 4))
            if new_live < live:
                add(
                    {"max_live_parameters": new_live},
                    4 * (live - new_live),
                    "medium",
                    f"lower max_live_parameters to {new_live} elements",
                )
    if failed_tier == "host" and opt and config.offload_optimizer == "cpu":
        if config.nvme_path and impl(config.stage, "nvme"):
            add(
                {"offload_optimizer": "nvme"},
                opt,
                "high",
                f"move optimizer states from host memory to NVMe, freeing {_fmt(opt)}",
                target="nvme",
            )
    budget_key = f"{failed_tier}_budget_bytes"
    if cap is not None and hasattr(config, budget_key):
        need = -(-required_bytes // (1 << 20)) * (1 << 20)  # rounded up to a MiB
        phys = physical_bytes.get(failed_tier)
        text = f"raise {budget_key} to {_fmt(need)} (the step's need, rounded up to a MiB)"
        fits = phys is not None and need <= phys
        if not fits:
            text += f"; this machine has {_fmt(phys)} for the tier, so it would not fit"
        cands.append(
            {
                "change": {budget_key: int(need)},
                "description": text,
                "frees_bytes": int(max(0, need - cap)),
                "fits": bool(fits),
                "speed_cost": "none",
                "_machine": True,
            }
        )
    cands.sort(
        key=lambda c: (
            not c["fits"],
            c["_machine"],
            SPEED_COSTS.index(c["speed_cost"]),
            -c["frees_bytes"],
        )
    )
    for i, c in enumerate(cands, 1):
        c.pop("_machine")
        c["rank"] = i
    return cands


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
        f"failed request: tier {f['tier']}, {_fmt(f.get('bytes')) if f.get('bytes') else '-'}"
        f", tensor {f.get('tensor') or '-'}, op {f.get('op') or '-'}, {f['error_type']}"
    )
    lines.append(f"step {report['step']}, config version {report['config_version']}")
    lines.append("")
    for name, t in report["tiers"].items():
        lines.append(f"{name}: used {_fmt(t.get('used_bytes'))} of {_fmt(t.get('capacity_bytes'))}")
        for h in sorted(t.get("holders", []), key=lambda h: -h["bytes"])[:10]:
            pages = f", {h['pages']} pages" if h.get("pages") is not None else ""
            lines.append(f"    {h['name']:<40} {h['kind']:<10} {_fmt(h['bytes'])}{pages}")
    lines.append("")
    lines.append("advice (rank, change, frees, fits, speed cost):")
    for a in report["advice"]:
        change = ", ".join(f"{k}={json.dumps(v)}" for k, v in a["change"].items())
        lines.append(
            f"  {a['rank']}. {change}: frees {_fmt(a['frees_bytes'])}, "
            f"{'fits' if a['fits'] else 'does not fit'}, {a['speed_cost']} - {a['description']}"
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


def holder(name: str, kind: str, nbytes: float, pages: int | None = None) -> dict[str, Any]:
    """One holder row of the contract (``kind`` one of :data:`HOLDER_KINDS`)."""
    return {"name": name, "kind": kind, "bytes": int(nbytes), "pages": pages}
