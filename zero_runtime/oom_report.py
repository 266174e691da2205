"""The OOM post-mortem's report, without TensorFlow: its contract (``docs/oom.md``),
building it from explicit inputs, writing it atomically, finding and formatting it.

:mod:`zero_runtime.oom` (the errors and the ``sys.excepthook`` chain, which need
TensorFlow) re-exports these names; ``zero-runtime oom-report`` imports only this module,
so reading a post-mortem never loads TensorFlow.

Figures in a report are bytes. Each tier row says what its figures measure (see
:func:`tier_row`): ``used_bytes`` is the sum of the row's holders (the runtime's
accounting, with the bytes a reading found beyond it as one "unattributed" holder), and
``checked_bytes`` the figure the limit check compared with ``capacity_bytes``.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from tb_plugin import metadata

#: File name of the post-mortem in the run directory.
OOM_FILENAME = "memory_hierarchy_oom.json"

#: Version of the post-mortem JSON object.
OOM_VERSION = 1

SPEED_COSTS = ("none", "low", "medium", "high")
HOLDER_KINDS = ("param", "grad", "optimizer", "activation", "other")


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


#: Characters of an error message a report keeps (``failed_request.message``).
MESSAGE_CHARS = 4000
_STACK_LINE = re.compile(r"^\s+File \"[^\"]*\", line \d+, in ")


def short_message(message: str) -> str:
    """An error message as a report keeps it: without TensorFlow's Python stack lines
    (``  File "...", line N, in f``: a graph execution error repeats the whole Keras call
    stack once per node, which pushed the ``OOM when allocating ...`` line past the kept
    length), blank lines and the runtime's own ``post-mortem: PATH`` tail, then cut to
    :data:`MESSAGE_CHARS` characters."""
    text = (message or "").split("\n\npost-mortem")[0]
    lines = [line for line in text.splitlines() if line.strip() and not _STACK_LINE.match(line)]
    return "\n".join(lines)[:MESSAGE_CHARS]


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


#: ``checked_source`` -> what ``checked_bytes`` measures (the report's and the view's text).
CHECKED_SOURCES = {
    "allocator": "TensorFlow's allocator: bytes in use at the moment of the check (on the "
    "CPU stand-in, the BFC allocator the logical devices share); it counts activations and "
    "framework buffers alive at that moment and nothing freed before it",
    "allocator_peak": "TensorFlow's allocator: its in-step peak (high-water mark) when it "
    "refused the failed request (on the CPU stand-in, the BFC allocator the logical devices "
    "share); the request came on top of it (the allocator may refuse a little short of its "
    "cap when its free bytes are split into chunks too small for the request)",
    "pool": "the paged pool's pages on the tier (what the budget bounds at stage 3)",
    "accounting": "the runtime's accounting of its holders",
}
#: The holder that carries the bytes a reading found beyond the runtime's holders.
UNATTRIBUTED = "unattributed (activations, scratch and framework buffers in the reading)"
#: What a tier row's ``used_bytes`` measures (the report's and the view's text).
USED_MEANS = (
    "the sum of the holders: the runtime's accounting (model states as ZeRO counts them, "
    "SC20 section 3.1: each replica's parameters, gradients and optimizer states, held "
    "through the step), plus any bytes the checked reading found beyond them"
)


def tier_row(
    capacity_bytes: int | None,
    holders: list[dict[str, Any]],
    checked_bytes: int | None = None,
    checked_source: str | None = None,
) -> dict[str, Any]:
    """One tier of the report, every figure from one accounting.

    Args:
        capacity_bytes: the tier's budget or size, bytes (None: unbounded or unknown).
        holders: :func:`holder` rows, the runtime's accounting.
        checked_bytes: the figure the limit check compared with the capacity (or the
            tier's recorded reading), bytes; None when there is none.
        checked_source: what ``checked_bytes`` is, a key of :data:`CHECKED_SOURCES`.

    Returns:
        ``{"capacity_bytes", "used_bytes", "accounted_bytes", "checked_bytes",
        "checked_source", "holders"}``: ``accounted_bytes`` is the holders' sum;
        when ``checked_bytes`` exceeds it, one :data:`UNATTRIBUTED` holder (kind "other")
        carries the difference, so ``used_bytes`` = the sum of the holders =
        ``max(accounted_bytes, checked_bytes)`` (:data:`USED_MEANS`). None when there are
        neither holders nor a checked figure.

    Raises:
        ValueError: ``checked_source`` not in :data:`CHECKED_SOURCES` while
            ``checked_bytes`` is given.
    """
    if checked_bytes is not None and checked_source not in CHECKED_SOURCES:
        raise ValueError(
            f"checked_source={checked_source!r} is invalid: expected one of "
            f"{sorted(CHECKED_SOURCES)}"
        )
    rows = [dict(h) for h in holders]
    accounted = sum(int(h["bytes"]) for h in rows)
    if checked_bytes is not None and int(checked_bytes) > accounted:
        rows.append(holder(UNATTRIBUTED, "other", int(checked_bytes) - accounted))
    used = sum(int(h["bytes"]) for h in rows) if (rows or checked_bytes is not None) else None
    return {
        "capacity_bytes": _int(capacity_bytes),
        "used_bytes": used,
        "accounted_bytes": accounted,
        "checked_bytes": _int(checked_bytes),
        "checked_source": checked_source if checked_bytes is not None else None,
        "holders": rows,
    }


def request_text(failed: Mapping[str, Any]) -> str:
    """The failed request in words: its bytes, or why they are not known."""
    req = failed.get("bytes")
    if isinstance(req, (int, float)) and req > 0:
        return f"{fmt_bytes(req)} requested"
    if failed.get("error_type") == "DeviceBudgetExceededError":
        return (
            "no single request: the budget is checked at the step boundary, over the "
            "tier's whole use"
        )
    if failed.get("error_type") == "HostMemoryLowError":
        return "no single request: the machine's available memory fell below the margin"
    return "request size not known: the error named no tensor shape"


def _figures_text(t: Mapping[str, Any]) -> str:
    used, cap = t.get("used_bytes"), t.get("capacity_bytes")
    of = f"of {fmt_bytes(cap)}" if cap is not None else "(capacity unbounded)"
    text = f"{fmt_bytes(used)} by the runtime's accounting {of}"
    checked, source = t.get("checked_bytes"), t.get("checked_source")
    if checked is not None and checked != used:
        if source == "allocator_peak":
            text += f"; TensorFlow's allocator peaked at {fmt_bytes(checked)} in the step"
            return text
        who = {
            "allocator": "TensorFlow's allocator",
            "pool": "the paged pool",
            "accounting": "the accounting",
        }.get(source, "the check")
        text += f"; {who} read {fmt_bytes(checked)} at the check"
    return text


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
        tiers: tier -> a :func:`tier_row` (``capacity_bytes``, ``used_bytes`` = the sum
            of ``holders``, ``accounted_bytes``, ``checked_bytes``, ``checked_source``).
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
        The JSON-serialisable report, with ``nothing_fits``, ``cause``, ``request_text``
        (the failed request in words, :func:`request_text`), ``figures`` (what a tier
        row's ``used_bytes`` and each ``checked_source`` measure) and a one-paragraph
        ``summary``.
    """
    tier = failed["tier"]
    t = tiers.get(tier, {})
    nothing_fits = not any(a["fits"] for a in advice)
    top = sorted(t.get("holders", []), key=lambda h: -h["bytes"])[:3]
    holders = ", ".join(f"{h['name']} {fmt_bytes(h['bytes'])}" for h in top) or "no known holders"
    req = failed.get("bytes")
    # The step and tier, then the cause, then the figures, holders and the best change.
    text = (
        f"Step {step} ran out of memory on the {tier} tier"
        + (f": {cause}" if cause else "")
        + f" ({failed['error_type']}; {_figures_text(t)}"
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
            text += f"; {change} may fit" + (
                f" (within {fmt_bytes(short)} of the margin)" if short else ""
            )
        text += "."
    else:
        best = advice[0]
        change = ", ".join(f"{k}={json.dumps(v)}" for k, v in best["change"].items())
        text += (
            f"Best single change: {change} ({best['description']}; speed cost "
            f"{best['speed_cost']})."
        )
    # Explain the sources whose reading differs from the accounting somewhere.
    sources = sorted(
        {
            r.get("checked_source")
            for r in tiers.values()
            if r.get("checked_bytes") != r.get("used_bytes")
        }
        - {None}
    )
    return {
        "version": OOM_VERSION,
        "step": int(step),
        "wall_time": time.time(),
        "failed_request": dict(failed),
        "request_text": request_text(failed),
        "tiers": {k: dict(v) for k, v in tiers.items()},
        "figures": {
            "used_bytes": USED_MEANS,
            "checked_bytes": {s: CHECKED_SOURCES[s] for s in sources if s in CHECKED_SOURCES},
        },
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


def verdict_text(advice: Mapping[str, Any], capacity_bytes: int | None = None) -> str:
    """One suggestion's verdict in words, with the replayed bytes when known: "fits
    (predicted 3.2 MiB of 12.00 MiB)", "may fit (predicted 11.5 MiB: within the
    capacity, 2.1 MiB short of the margin)", "does not fit (4.0 MiB over)"."""
    verdict = advice.get("verdict") or ("fits" if advice.get("fits") else "does not fit")
    for key, value in (advice.get("change") or {}).items():
        if key.endswith("_budget_bytes") and isinstance(value, int):
            capacity_bytes = value  # a budget raise: against the raised budget
    pred, missing = advice.get("predicted_bytes"), advice.get("missing_bytes")
    of = f" of {fmt_bytes(capacity_bytes)}" if capacity_bytes is not None else ""
    if verdict == "fits" and pred is not None:
        return f"fits (predicted {fmt_bytes(pred)}{of} with the margin)"
    if verdict == "may fit":
        if pred is None:
            return "may fit (the bytes after the change are not known before it runs)"
        tail = f", {fmt_bytes(missing)} short of the margin" if missing else ""
        return f"may fit (predicted {fmt_bytes(pred)}{of}: within the capacity{tail})"
    if verdict == "does not fit" and missing:
        return f"does not fit ({fmt_bytes(missing)} over)"
    return verdict


def format_report(report: Mapping[str, Any], path: str | None = None) -> str:
    """The post-mortem as text: summary, failed request, tiers with holders, advice."""
    f = report["failed_request"]
    lines = ["OOM post-mortem" + (f" ({path})" if path else ""), "", report["summary"], ""]
    request = report.get("request_text") or request_text(f)
    lines.append(
        f"failed request: tier {f['tier']}, {request}, tensor {f.get('tensor') or '-'}, "
        f"op {f.get('op') or '-'}, {f['error_type']}"
    )
    lines.append(f"step {report['step']}, config version {report['config_version']}")
    lines.append("")
    for name, t in report["tiers"].items():
        lines.append(f"{name}: {_figures_text(t)}")
        for h in sorted(t.get("holders", []), key=lambda h: -h["bytes"])[:10]:
            pages = f", {h['pages']} pages" if h.get("pages") is not None else ""
            lines.append(f"    {h['name']:<40} {h['kind']:<10} {fmt_bytes(h['bytes'])}{pages}")
    figures = report.get("figures") or {}
    if figures:
        lines.append("")
        lines.append(f"used: {figures.get('used_bytes')}")
        for source, meaning in (figures.get("checked_bytes") or {}).items():
            lines.append(f"read at the check ({source}): {meaning}")
    lines.append("")
    lines.append("advice (rank, change, frees, verdict, speed cost):")
    cap = report["tiers"].get(f["tier"], {}).get("capacity_bytes")
    for a in report["advice"]:
        change = ", ".join(f"{k}={json.dumps(v)}" for k, v in a["change"].items())
        lines.append(
            f"  {a['rank']}. {change}: frees {fmt_bytes(a['frees_bytes'])}, "
            f"{verdict_text(a, cap)}, speed cost {a['speed_cost']} - {a['description']}"
        )
    if not report["advice"]:
        lines.append("  (none applies)")
    if report["nothing_fits"]:
        lines.append("nothing fits: no single change within this machine makes the step fit")
    return "\n".join(lines)


_OBJECT_ID = re.compile(r"#[0-9a-f]{6,}")


def display_name(tensor_id: str | None) -> str | None:
    """A pool tensor id without the Python object id that keeps it unique in the process:
    ``g/gpt.block_0.mlp_norm.gamma#7f3254ce0f10/r0`` -> ``g/gpt.block_0.mlp_norm.gamma/r0``."""
    return None if tensor_id is None else _OBJECT_ID.sub("", tensor_id)


def holder(name: str, kind: str, nbytes: float, pages: int | None = None) -> dict[str, Any]:
    """One holder row of the contract (``kind`` one of :data:`HOLDER_KINDS`); ``name``
    without Python object ids (:func:`display_name`)."""
    return {"name": display_name(name), "kind": kind, "bytes": int(nbytes), "pages": pages}
