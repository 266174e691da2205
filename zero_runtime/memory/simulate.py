"""What-if: replay a pool's recorded steps under a proposed change, predicting its effect.

The simulator rebuilds the pool's state at the start of the oldest replayed step (the
access trace's snapshot, :mod:`zero_runtime.memory.trace`) in a
:class:`~zero_runtime.memory.core.PoolCore` whose tiers only count slots (no bytes, no
TensorFlow, no files), applies the proposal, and serves the recorded operations in the
recorded order through the core's own methods: the same placement loop, victim ranking
(LRU or reuse distance over the access order), page transitions, prefetch placement and
counters as the pool. With the configuration unchanged it reproduces the recorded page
moves exactly when the pool's moves are synchronous (device and host tiers); with NVMe
the I/O completes when a placement would wait, and at each step's end.

What a proposal changes (keys of ``zero_runtime.config.TUNABLE_KEYS``):

- ``device_budget_bytes``: the device tier's capacity, set before the first replayed
  step as ``set_device_budget`` does (a shrink's moves count in that step); recorded
  budget changes inside the window are then ignored.
- ``prefetch_bucket_size`` (elements): each recorded prefetch request is re-derived: its
  tensors in request order, continued along the step's access order at the request's
  stride (the ids of the same requester interleave with other replicas' there), cut to
  the longest prefix whose elements (``nbytes / itemsize``) fit the new size; 0 drops
  the requests. The prefetch thread places them at the points it placed the recorded
  ones. A size with no recorded request to start from (prefetch was off) adds none.
- Keys read only when the model is built (``persistence_threshold``,
  ``max_live_parameters``, ``max_reuse_distance``, ``host_budget_bytes``' host tier) and
  ``telemetry_every_n_steps`` do not change the running job's paging: the prediction is
  the replay unchanged, and a note says so.

Stall is predicted as the replayed prefetch misses times the recorded stall seconds per
miss (None when the recorded steps had no miss to time).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zero_runtime.memory.core import PoolCore
from zero_runtime.memory.counters import DIRECTIONS, PageCounters
from zero_runtime.memory.errors import PoolOutOfMemoryError
from zero_runtime.memory.page_table import RESIDENT, PageRecord, TensorEntry
from zero_runtime.memory.page_table import PageState as S
from zero_runtime.memory.sim_tiers import SimCondition, SimDevice, SimHost, SimIo, SimNvme
from zero_runtime.memory.tiers import SlotTier
from zero_runtime.memory.trace import (
    LETTER_TIER,
    TRACE_DIR,
    TRACE_STEPS,
    StepTrace,
    read_steps,
    step_numbers,
)

#: Keys whose change does not alter a running job's paging (read at build time, or not
#: about memory); their prediction is the unchanged replay.
NO_PAGING_EFFECT = (
    "persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "host_budget_bytes",
    "telemetry_every_n_steps",
)
SIMULATED = ("device_budget_bytes", "prefetch_bucket_size")
__all__ = [
    "NO_PAGING_EFFECT",
    "SIMULATED",
    "TRACE_STEPS",
    "Proposal",
    "Replay",
    "ReplayError",
    "StepFigures",
    "predict",
    "predict_run",
    "replay",
    "run_records",
    "summarize",
    "usable_steps",
]
#: Per-step figures summarised (PageCounters fields).
_COUNTS = (
    *(f"{d}_{u}" for d in DIRECTIONS for u in ("pages", "bytes")),
    "evictions",
    "prefetch_hits",
    "prefetch_misses",
)


class ReplayError(ValueError):
    """The recorded steps cannot be replayed (none usable, malformed, or a proposal out of
    range); the message says which."""


# --- the replay ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Proposal:
    """A change expressed in the pool's terms.

    Attributes:
        device_slots: the device tier's capacity in pages, or None to keep the recorded.
        prefetch_elements: ``(recorded, proposed)`` prefetch sizes in elements, or None
            to replay the recorded requests.
    """

    device_slots: int | None = None
    prefetch_elements: tuple[int, int] | None = None


@dataclasses.dataclass
class StepFigures:
    """One replayed step: its counters and the tiers' peak and used bytes at its end."""

    step: int
    counters: dict[str, float]
    peak_bytes: dict[str, int]
    used_bytes: dict[str, int]


@dataclasses.dataclass
class Replay:
    """The outcome of :func:`replay`.

    Attributes:
        steps: one :class:`StepFigures` per replayed step (fewer when it ran out of memory).
        oom: None, or ``{"step", "event", "op", "tensor", "message"}``: the first
            operation the pool could not serve under the proposal.
    """

    steps: list[StepFigures]
    oom: dict[str, Any] | None = None


def _sim_core(page_size: int, slots: Mapping[str, int | None], has_nvme: bool) -> PoolCore:
    tiers: dict[str, SlotTier] = {
        "device": SimDevice("device", page_size, int(slots.get("device") or 0)),
        "host": SimHost(page_size, slots.get("host")),
        "nvme": SimNvme(page_size, slots.get("nvme"))
        if has_nvme
        else SlotTier("nvme", page_size, 0),
    }
    cond = SimCondition()
    core = PoolCore.assemble(
        tiers,
        tiers["nvme"] if has_nvme else None,  # type: ignore[arg-type]
        cond,  # type: ignore[arg-type]
        lambda: None,
        lambda: False,
        copies_bytes=False,
        traced=False,
    )
    if has_nvme:
        io = SimIo()
        io.complete = core.moves.on_io_complete
        core.moves.io = io  # type: ignore[assignment]
        cond.io = io
    return core


def _entry(tensor_id: str, nbytes: int, kind: str, page_size: int) -> TensorEntry:
    """A tensor of ``nbytes`` bytes (its pages as the pool cuts them; no dtype needed)."""
    n = int(nbytes)
    pages = [
        PageRecord(tensor_id, i, min(page_size, n - i * page_size))
        for i in range(-(-n // page_size))
    ]
    return TensorEntry(tensor_id, (n,), np.dtype(np.uint8), kind, n, pages)


def _restore(core: PoolCore, start: Mapping[str, Any], page_size: int) -> dict[str, int]:
    """Rebuild the recorded state in ``core``; returns tensor id -> itemsize."""
    itemsize = {}
    for tid, nbytes, size, kind, letters, ticks, pins, acquires, acquired_tier in start["tensors"]:
        entry = _entry(tid, nbytes, kind, page_size)
        core.table.add(entry)
        for page, letter, tick in zip(entry.pages, letters, ticks):
            tier = LETTER_TIER.get(letter)
            if letter == "c":  # clean: on NVMe, then read in (the NVMe copy kept)
                core.table.transition(page, S.ON_NVME, core.tiers["nvme"].take())
                core.table.transition(page, S.IN_FLIGHT_IN, core.tiers["host"].take())
                core.table.transition(page, S.ON_HOST_CLEAN)
                page.checksum = 0
            elif tier is not None:
                core.table.transition(page, RESIDENT[tier], core.tiers[tier].take())
                if tier == "nvme":
                    page.checksum = 0
            page.last_use_tick = int(tick)
        entry.pin_count = int(pins)
        entry.acquire_count = int(acquires)
        entry.acquired_tier = acquired_tier
        core.table.note_pins(entry)
        itemsize[tid] = int(size) or 1
    core.counters.reset(totals=True)  # restoring a clean page counted a read-in
    core.table.resume_tick(int(start["tick"]))
    core.policy.resume(start["order"], int(start["cursor"]))
    for tier in core.tiers.values():
        tier.reset_peak()
    return itemsize


def _derive_request(
    ids: Sequence[str],
    order: Sequence[str],
    itemsize: Mapping[str, int],
    sizes: Mapping[str, int],
    budget: int,
    default_stride: int,
) -> tuple[str, ...]:
    """A prefetch request re-derived for ``budget`` elements (see the module doc)."""
    if budget <= 0 or not ids:
        return ()
    positions: dict[str, list[int]] = {}
    for i, tid in enumerate(order):
        positions.setdefault(tid, []).append(i)
    seq = list(ids)
    walk = []
    p = -1
    for tid in ids:
        later = [q for q in positions.get(tid, ()) if q > p]
        if not later:
            break
        p = later[0]
        walk.append(p)
    if len(walk) == len(ids):
        stride = walk[1] - walk[0] if len(walk) > 1 else default_stride
        q = walk[-1] + max(1, stride)
        while q < len(order):
            seq.append(order[q])
            q += max(1, stride)
    out, used = [], 0
    for tid in dict.fromkeys(seq):
        if tid not in sizes:
            continue
        elements = sizes[tid] // max(1, itemsize.get(tid, 1))
        if used + elements > budget:
            break
        used += elements
        out.append(tid)
    return tuple(out)


def _default_stride(steps: Sequence[StepTrace]) -> int:
    """The most common distance, in the access order, between a request's first two ids."""
    counts: collections.Counter[int] = collections.Counter()
    for st in steps:
        order = st.start["order"]
        first = {}
        for i, tid in enumerate(order):
            first.setdefault(tid, i)
        for code, *args in st.events:
            if code == "P" and len(args[0]) > 1 and args[0][0] in first and args[0][1] in first:
                counts[first[args[0][1]] - first[args[0][0]]] += 1
    return counts.most_common(1)[0][0] if counts else 1


def replay(steps: Sequence[StepTrace], proposal: Proposal | None = None) -> Replay:
    """Replay consecutive recorded steps through the pool's core under ``proposal``.

    Args:
        steps: closed steps of one pool, consecutive, oldest first (not truncated).
        proposal: the change (None: replay as recorded).

    Returns:
        The per-step figures, and the first out-of-memory failure if any.

    Raises:
        ReplayError: no steps, a truncated step, steps not consecutive, a device
            capacity below one page.
    """
    if not steps:
        raise ReplayError("no recorded steps to replay")
    for a, b in zip(steps, steps[1:]):
        if b.step != a.step + 1:
            raise ReplayError(f"recorded steps {a.step} and {b.step} are not consecutive")
    if any(s.truncated for s in steps):
        raise ReplayError("a recorded step was truncated (too many events to keep)")
    proposal = proposal or Proposal()
    first = steps[0]
    ps = first.page_size
    slots = dict(first.start["slots"])
    core = _sim_core(ps, slots, first.has_nvme)
    itemsize = _restore(core, first.start, ps)
    sizes = {t[0]: int(t[1]) for t in first.start["tensors"]}
    out = Replay([])
    step = first.step
    event_ix, code, tid = -1, "", ""
    try:
        if proposal.device_slots is not None:
            if proposal.device_slots < 1:
                raise ReplayError(
                    f"a device capacity of {proposal.device_slots} pages is below one page"
                )
            core.set_device_slots(proposal.device_slots)
        stride = _default_stride(steps)
        queue: collections.deque = collections.deque()
        for st in steps:
            step = st.step
            for i, (code, *args) in enumerate(st.events):
                event_ix, tid = i, (args[0] if args and isinstance(args[0], str) else "")
                _serve(core, code, args, queue, itemsize, sizes, proposal, stride, ps)
            core.cond.wait()  # the step's I/O completes
            figures = core.figures()
            counters = core.close_step(step)
            out.steps.append(
                StepFigures(step, _counts(counters), figures["peak_bytes"], figures["used_bytes"])
            )
    except PoolOutOfMemoryError as exc:
        out.oom = {"step": step, "event": event_ix, "op": code, "tensor": tid, "message": str(exc)}
    return out


def _serve(
    core: PoolCore,
    code: str,
    args: list,
    queue: collections.deque,
    itemsize: dict[str, int],
    sizes: dict[str, int],
    proposal: Proposal,
    stride: int,
    ps: int,
) -> None:
    """Serve one recorded event through the core (as the pool's method of that event)."""
    get = core.table.get
    if code == "A":
        tid, nbytes, size, kind, tier = args
        itemsize[tid] = int(size) or 1
        sizes[tid] = int(nbytes)
        core.allocate(_entry(tid, nbytes, kind, ps), tier)
    elif code == "F":
        core.free(get(args[0]))
    elif code == "K":
        source = get(args[0])
        core.fork(source, _entry(args[1], source.nbytes, source.kind, ps))
        itemsize[args[1]], sizes[args[1]] = itemsize.get(args[0], 1), source.nbytes
    elif code == "Q":
        core.acquire(get(args[0]), args[1], False)
    elif code == "R":
        core.release(get(args[0]))
    elif code in ("W", "D"):
        core.use(get(args[0]))
    elif code == "P":
        ids, tier = tuple(args[0]), args[1]
        if proposal.prefetch_elements is not None:
            recorded, proposed = proposal.prefetch_elements
            if proposed != recorded:
                ids = _derive_request(ids, core.policy.order, itemsize, sizes, proposed, stride)
        if ids:
            queue.append(core.prefetcher.request(ids, tier))
    elif code == "X":
        if queue:
            core.prefetcher.place(queue.popleft())
    elif code == "E":
        core.placement.evict([get(t) for t in args[0]], args[1])
    elif code == "N":
        core.pin(get(args[0]))
    elif code == "U":
        core.unpin(get(args[0]))
    elif code == "O":
        core.policy.set_order(list(args[0]) or None)
    elif code == "B":
        if proposal.device_slots is None:
            core.set_device_slots(int(args[0]))
    else:
        raise ReplayError(f"unknown access trace event {code!r}")


def _counts(counters: PageCounters) -> dict[str, float]:
    return {f: float(getattr(counters, f)) for f in (*_COUNTS, "stall_seconds")}


# --- predictions for the tab and the bench -------------------------------------------------
def usable_steps(records: Sequence[Mapping[str, Any]]) -> list[StepTrace]:
    """The steps to replay from a run's step files (:func:`trace.read_steps`): the newest
    consecutive, untruncated steps recorded under the same tunable values (``config``)
    as the newest.

    Raises:
        ReplayError: none usable.
    """
    parsed = []
    for r in records:
        try:
            parsed.append((r.get("config"), StepTrace.from_json(r)))
        except ValueError:
            continue
    if not parsed:
        raise ReplayError("no access trace recorded yet (the job writes one per step)")
    config = parsed[-1][0]
    out: list[StepTrace] = []
    for c, st in reversed(parsed):
        if c != config or st.truncated or (out and st.step != out[-1].step - 1):
            break
        out.append(st)
    if not out:
        raise ReplayError("the newest recorded step cannot be replayed (truncated)")
    return out[::-1]


def summarize(figures: Sequence[StepFigures | Mapping[str, Any]]) -> dict[str, Any]:
    """Means per step of the counters, the highest peak and the last used bytes per tier.

    Args:
        figures: replayed :class:`StepFigures`, or recorded steps' ``measured`` dicts
            (a recorded device peak gets the step's gathered bytes outside the pool added,
            as the replay's has: the whole device tier).

    Returns:
        ``{}`` for none, else the counters' means per step (``d2h_pages`` ...
        ``prefetch_misses``, ``stall_seconds``), ``moves_per_step`` (pages by direction),
        ``peak_bytes`` (highest) and ``used_bytes`` (last) per tier, and ``steps``.
    """
    rows = []
    for f in figures:
        if isinstance(f, StepFigures):
            rows.append((f.counters, f.peak_bytes, f.used_bytes))
        else:
            f = _with_outside(f)
            rows.append((f, f["peak_bytes"], f["used_bytes"]))
    if not rows:
        return {}
    n = len(rows)
    out: dict[str, Any] = {
        k: sum(float(c.get(k, 0.0)) for c, _, _ in rows) / n for k in (*_COUNTS, "stall_seconds")
    }
    out["moves_per_step"] = {d: out[f"{d}_pages"] for d in DIRECTIONS}
    out["peak_bytes"] = {t: max(int(p.get(t, 0)) for _, p, _ in rows) for t in rows[0][1]}
    out["used_bytes"] = dict(rows[-1][2])
    out["steps"] = n
    return out


def _with_outside(measured: Mapping[str, Any]) -> Mapping[str, Any]:
    """A recorded step's figures with its gathered bytes (outside the pool) added to the
    device peak, as the replayed steps' are."""
    gathered = int((measured.get("outside_device") or {}).get("gathered_bytes", 0))
    if not gathered:
        return measured
    peak = dict(measured["peak_bytes"])
    peak["device"] = peak.get("device", 0) + gathered
    return {**measured, "peak_bytes": peak}


def predict(
    records: Sequence[Mapping[str, Any]],
    current: Mapping[str, Any],
    updates: Mapping[str, Any],
) -> dict[str, Any]:
    """The predicted effect of ``updates`` on a running job, from its recorded steps.

    Args:
        records: the run's step files (:func:`zero_runtime.memory.trace.read_steps`).
        current: the tunable values in effect (key -> value; ``prefetch_bucket_size`` is
            needed to re-derive prefetch requests).
        updates: key -> proposed value (checked ints, ``TUNABLE_KEYS``).

    Returns:
        ``{"steps": [replayed steps], "recorded": summary, "replayed": summary,
        "predicted": {"first": summary of the first step (a shrink's moves included),
        "steady": summary of the others (the first when only one)}, "oom": None | dict,
        "stall_seconds_per_miss": float | None, "notes": [str]}``. A summary holds, per
        step, the mean of each page counter (``d2h_pages`` ... ``prefetch_misses``,
        ``stall_seconds``), ``moves_per_step`` by direction (pages), ``peak_bytes`` (the
        highest) and ``used_bytes`` (at the end) per tier, in bytes. ``replayed``'s and
        ``predicted``'s ``stall_seconds`` are misses x ``stall_seconds_per_miss`` (None
        when unknown; 0 without a miss), ``recorded``'s the job's measured stall.
        ``prefetch_hits`` counts pages an acquire found already in the tier it asked for
        (prefetched or still there from an earlier use), so prefetch off leaves hits.

    Raises:
        ReplayError: nothing usable recorded, or a proposal the pool cannot take.
    """
    steps = usable_steps(records)
    notes = []
    ps = steps[0].page_size
    # The device tier outside the pool (a stage-3 step's gathered units, and the budget's
    # share kept for them and frozen weights), as the last recorded step reported it.
    outside = steps[-1].measured.get("outside_device") or {}
    gathered = int(outside.get("gathered_bytes", 0))
    reserved = int(outside.get("reserved_bytes", 0))
    proposal_args: dict[str, Any] = {}
    for key, value in updates.items():
        if key == "device_budget_bytes":
            if value is None:
                raise ReplayError("device_budget_bytes=None (the default) cannot be simulated")
            if int(value) - reserved < ps:
                outside_text = (
                    f" plus the {reserved} bytes this run holds on the device outside its "
                    "pool (gathered parameters, frozen weights)"
                    if reserved
                    else ""
                )
                raise ReplayError(
                    f"device_budget_bytes={value} is below one page of this run's pool "
                    f"({ps} bytes, page_size_bytes){outside_text}: the run cannot take it "
                    "(the key's own lower bound is for any run)"
                )
            proposal_args["device_slots"] = (int(value) - reserved) // ps
            if int(value) % ps:
                notes.append(
                    f"device_budget_bytes={value} is used as {int(value) // ps * ps} bytes: "
                    f"the pool counts whole pages of {ps} bytes"
                )
            notes.append(
                "the smallest budget this run can take is what its gathers pin on the device "
                "at once, not the key's lower bound or one page: below it the replay "
                "predicts an out-of-memory failure at that gather"
            )
        elif key == "prefetch_bucket_size":
            recorded = int(current.get("prefetch_bucket_size") or 0)
            proposal_args["prefetch_elements"] = (recorded, int(value))
            if recorded == 0 and int(value) > 0:
                notes.append("prefetch was off in the recorded steps: no request to re-derive")
            if int(value) == 0:
                notes.append(
                    "prefetch off still leaves prefetch hits: a hit is any page an acquire "
                    "found already in the tier it asked for (prefetched, or kept there from "
                    "an earlier use), so the hits left are pages still in host memory"
                )
        elif key in NO_PAGING_EFFECT:
            notes.append(f"{key} does not change the running job's paging (read at build time)")
        else:
            notes.append(f"{key} is not simulated")
    if not steps[0].has_nvme and "prefetch_elements" in proposal_args:
        notes.append("no NVMe tier: the job does not prefetch")
    baseline = replay(steps)
    proposed = replay(steps, Proposal(**proposal_args))
    if gathered:  # every figure is the whole device tier, as the tiers record shows it
        for f in (*baseline.steps, *proposed.steps):
            f.peak_bytes["device"] = f.peak_bytes.get("device", 0) + gathered
    recorded_summary = summarize([s.measured for s in steps])
    misses = sum(float(s.measured.get("prefetch_misses", 0)) for s in steps)
    stall = sum(float(s.measured.get("stall_seconds", 0)) for s in steps)
    per_miss = stall / misses if misses else None
    first = summarize(proposed.steps[:1])
    steady = summarize(proposed.steps[1:] or proposed.steps[:1])
    replayed = summarize(baseline.steps)
    # One stall model for every summary of the replay: misses x the recorded stall per
    # miss. The simulator's own waits are not the job's (its I/O is not timed), so the
    # unchanged replay's stall is comparable with the recorded one.
    for s in (first, steady, replayed):
        if s:
            s["stall_seconds"] = (
                s["prefetch_misses"] * per_miss
                if per_miss is not None
                else (0.0 if s["prefetch_misses"] == 0 else None)
            )
    exact = all(
        math.isclose(a.counters[f"{d}_pages"], float(b.measured.get(f"{d}_pages", 0)))
        for a, b in zip(baseline.steps, steps)
        for d in DIRECTIONS
    )
    if not exact:
        notes.append("the unchanged replay differs from the recorded moves (asynchronous I/O)")
    return {
        "steps": [s.step for s in steps],
        "page_size": ps,
        "recorded": recorded_summary,
        "replayed": replayed,
        "replay_exact": exact and baseline.oom is None,
        "predicted": {"first": first, "steady": steady},
        "oom": proposed.oom,
        "stall_seconds_per_miss": per_miss,
        "notes": notes,
    }


def run_records(run_dir: str, since: int = 0) -> list[dict[str, Any]]:
    """A run's recorded step files (``<run_dir>/memory_hierarchy_trace``), oldest first;
    ``since``: only steps >= it."""
    return read_steps(os.path.join(run_dir, TRACE_DIR), since)


def run_trace_steps(run_dir: str) -> list[int]:
    """The steps of a run's recorded step files (``<run_dir>/memory_hierarchy_trace``),
    ascending, by file name (nothing read); ``[]`` when none."""
    return step_numbers(os.path.join(run_dir, TRACE_DIR))


def predict_run(run_dir: str, updates: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`predict` from a run directory's step files, with the tunable values the
    newest step recorded as the current ones (``config``).

    Raises:
        ReplayError: nothing usable recorded, or a proposal the pool cannot take.
    """
    records = run_records(run_dir)
    current = records[-1].get("config") if records else None
    return predict(records, current if isinstance(current, Mapping) else {}, updates)
