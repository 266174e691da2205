"""What-if in the tab: predictions from a run's access trace, and predicted beside measured.

The job writes its stage-3 pool's access trace into the run directory, one file per step
(``memory_hierarchy_trace/``, :mod:`zero_runtime.memory.trace`); the plugin replays it
here through the pool's own core (:func:`zero_runtime.memory.simulate.predict_run`, pure
Python: no TensorFlow, nothing asked of the job). A prediction made when a request is
written (``POST /tune``) is kept in the plugin's file ``memory_hierarchy_whatif.json`` in
the run directory, keyed by the request's version::

    {"predictions": {"3": {"updates": {...}, "made_at": 1.7e9, "prediction": {...},
                           "measured": {...} | null, "measured_steps": [...]}}}

and, once the job has applied that version at step N, compared with what the job measured
from step N on (the steps of the trace recorded under the applied values, up to the next
applied version): :func:`outcomes`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import zero_runtime.memory.simulate as simulate
from zero_runtime import control

PREDICTIONS_FILE = "memory_hierarchy_whatif.json"
MAX_PREDICTIONS = 50  # versions kept in the file (the newest)


def predict(run_dir: str, updates: Mapping[str, int]) -> dict[str, Any]:
    """The predicted effect of ``updates`` on the run's job (see ``simulate.predict``).

    Raises:
        zero_runtime.memory.simulate.ReplayError: nothing replayable recorded yet, or a
            value the pool cannot take.
    """
    return simulate.predict_run(run_dir, updates)


def trace_steps(run_dir: str) -> list[int]:
    """The steps of the run's recorded access trace (``memory_hierarchy_trace/``), by file
    name, ascending; ``[]`` when the run recorded none (below stage 3, or no log
    directory). A run with steps can be asked ``GET /whatif`` whether or not its job still
    runs: the replay needs nothing from the job."""
    return simulate.run_trace_steps(run_dir)


def read_predictions(run_dir: str) -> dict[str, dict[str, Any]]:
    """The stored predictions, version (a string) -> record; ``{}`` when none or unreadable."""
    try:
        with open(os.path.join(run_dir, PREDICTIONS_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    preds = data.get("predictions") if isinstance(data, dict) else None
    return (
        {k: v for k, v in preds.items() if isinstance(v, dict)} if isinstance(preds, dict) else {}
    )


def _write(run_dir: str, predictions: Mapping[str, Any]) -> None:
    newest = sorted(predictions, key=lambda k: int(k) if k.isdigit() else -1)[-MAX_PREDICTIONS:]
    body = {"predictions": {k: predictions[k] for k in newest}}
    control.write_json_atomic(os.path.join(run_dir, PREDICTIONS_FILE), body)


def record(run_dir: str, version: int, updates: Mapping[str, int]) -> dict[str, Any] | None:
    """Predict the request ``version`` (its ``updates``, as written) and keep it; returns
    the prediction, or None when the run has nothing replayable (nothing is kept then)."""
    try:
        prediction = predict(run_dir, updates)
    except simulate.ReplayError:
        return None
    stored = read_predictions(run_dir)
    stored[str(version)] = {
        "updates": dict(updates),
        "made_at": time.time(),
        "prediction": prediction,
        "measured": None,
        "measured_steps": [],
    }
    _write(run_dir, stored)
    return prediction


def _applied(events: Sequence[Mapping[str, Any]], ack: Mapping[str, Any] | None) -> list[tuple]:
    """``(version, step)`` of every applied user request, by step (config events and ack)."""
    out = {}
    for event in events:
        value = event.get("value")
        if isinstance(value, Mapping) and value.get("status") == "applied":
            if value.get("source", "user") == "user" and isinstance(value.get("version"), int):
                out.setdefault(value["version"], int(event.get("step", 0)))
    if isinstance(ack, Mapping) and ack.get("status") == "applied":
        version, step = ack.get("version"), ack.get("step")
        if isinstance(version, int) and isinstance(step, int):
            out.setdefault(version, step)
    return sorted(out.items(), key=lambda vs: (vs[1], vs[0]))


def _figures(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The compared figures of a summary: moves per step by direction and in all, the
    device peak, host peak, NVMe used bytes, misses and stall per step."""
    if not summary:
        return {}
    moves = summary["moves_per_step"]
    return {
        "moves_per_step": moves,
        "moves_total": sum(moves.values()),
        "device_peak_bytes": summary["peak_bytes"].get("device"),
        "host_peak_bytes": summary["peak_bytes"].get("host"),
        "nvme_used_bytes": summary["used_bytes"].get("nvme"),
        "prefetch_misses": summary.get("prefetch_misses"),
        "stall_seconds": summary.get("stall_seconds"),
        "steps": summary.get("steps"),
    }


def outcomes(
    run_dir: str,
    events: Sequence[Mapping[str, Any]],
    ack: Mapping[str, Any] | None,
    persist: bool = False,
) -> list[dict[str, Any]]:
    """Predicted beside measured for every stored prediction.

    Measured: the recorded steps from the version's applied step up to the next applied
    version (at most the trace's ring), their per-step means (``simulate.summarize``; the
    apply step itself left out when later steps exist, as the prediction's ``steady``;
    no longer re-read once ``TRACE_STEPS`` steps were measured); with ``persist``
    (TensorBoard may write: ``--memory_hierarchy_tuning``) kept in the file once seen,
    so a change later than the ring does not lose them.

    Args:
        run_dir: the run's directory.
        events: its ``config_event`` records (``{"step", "value"}``).
        ack: the acknowledgement file's object, or None.
        persist: write newly measured figures back to the file (default False).

    Returns:
        ``[{"version", "updates", "applied_step" (None: not applied yet), "predicted",
        "measured" (None until a step ran under it), "measured_steps", "first"}]`` newest
        version last; ``predicted``/``measured`` as :func:`_figures` (moves per step by
        direction, ``moves_total``, device and host peak bytes, NVMe used bytes, misses and
        stall seconds per step), ``first`` the predicted figures of the apply step itself.
    """
    stored = read_predictions(run_dir)
    if not stored:
        return []
    applied = _applied(events, ack)
    changed = False
    out = []
    for key in sorted(stored, key=lambda k: int(k) if k.isdigit() else -1):
        entry = stored[key]
        version = int(key) if key.isdigit() else -1
        step = next((s for v, s in applied if v == version), None)
        done = len(entry.get("measured_steps") or []) >= simulate.TRACE_STEPS
        if step is not None and not done:
            later = [s for v, s in applied if s > step]
            end = min(later) if later else None
            records = simulate.run_records(run_dir, since=step)
            rows = [r for r in records if end is None or r.get("step", -1) < end]
            steps = [r["step"] for r in rows]
            measured = [r["measured"] for r in rows if isinstance(r.get("measured"), dict)]
            if len(steps) > len(entry.get("measured_steps") or []):
                entry["measured"] = _figures(simulate.summarize(measured[1:] or measured))
                entry["measured_steps"] = steps
                changed = True
        prediction = entry.get("prediction") or {}
        out.append(
            {
                "version": version,
                "updates": entry.get("updates"),
                "applied_step": step,
                "predicted": _figures(prediction.get("predicted", {}).get("steady", {})),
                "first": _figures(prediction.get("predicted", {}).get("first", {})),
                "oom": prediction.get("oom"),
                "measured": entry.get("measured"),
                "measured_steps": entry.get("measured_steps") or [],
            }
        )
    if changed and persist:
        try:
            _write(run_dir, stored)
        except OSError:
            pass
    return out
