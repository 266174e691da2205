"""The telemetry collector: one :class:`StepStats` record from its explicit inputs.

At a step end the coordinator (``zero_runtime.runtime.ZeroRuntime``) hands the collector
the step, its duration, the active config and the sampled profiler trace; the collector
takes the readings (:mod:`~zero_runtime.telemetry.probes`), asks the accounting for the
tiers and page counters (:class:`TierAccounting`, implemented by
``zero_runtime.runtime.accounting.Accounting``), and computes the step's timing on every
step from the runtime's own intervals (:func:`step_timing`): the collectives it issues
(arm -> disarm of their deadline host callbacks, handed to :meth:`record_collective`), the
NVMe I/O it watches and the host update. Sampled steps use the profiler's op intervals
instead (op-level detail). It owns the timeline, the profiler sampler and the page-move
recorder; it holds no config and writes nothing (``zero_runtime.telemetry.summaries``
writes).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Protocol

from zero_runtime.config import ZeroConfig
from zero_runtime.devices import DeviceInfo
from zero_runtime.telemetry.probes import Readings, read_probes
from zero_runtime.telemetry.profile import ProfileSampler, TraceIntervals
from zero_runtime.telemetry.recorder import PageMoveRecorder
from zero_runtime.telemetry.stats import StepStats, TierStats
from zero_runtime.telemetry.timeline import (
    Interval,
    Timeline,
    intersect_merged,
    overlap,
    total,
    union,
)


class TierAccounting(Protocol):
    """What the collector needs from the byte accounting."""

    def close_step(
        self, step: int, readings: Readings, config: ZeroConfig
    ) -> tuple[dict[str, TierStats], dict[str, float]]:
        """The ended step's tiers and page counters (consumes the step's counters)."""

    def has_runtime_io(self) -> bool:
        """True when the runtime drives NVMe I/O of its own."""

    def collectives(self) -> dict[str, float]:
        """One step's collective bytes and calls per kind."""


class TelemetryCollector:
    """Builds StepStats records; owns the runtime-driven timeline.

    Args:
        device: the local devices (probe sources; the allocator whose peak is reset).
        accounting: the tier accounting (:class:`TierAccounting`).

    Attributes:
        timeline: runtime-driven ``comm`` / ``compute`` intervals (``time.time()`` clock).
        profiler: samples TF profiler traces (in-graph collectives and ops).
        page_moves: the last NVMe page moves observed (:meth:`watch_io`).
        reset_peak_each_step: when True (default), the framework allocator's peak is reset
            after each record, so each record's device peak covers one step. A class-wide
            switch: a measurement of the peak over whole runs sets it to False before the
            strategy is created (bench/bench_max_model.py, tests/helpers/step_peak_job.py).
    """

    reset_peak_each_step: bool = True

    def __init__(self, device: DeviceInfo, accounting: TierAccounting) -> None:
        self.device = device
        self.accounting = accounting
        self.timeline = Timeline()
        self.profiler = ProfileSampler()
        self.page_moves = PageMoveRecorder()
        self._lanes_lock = threading.Lock()
        self._lanes: dict[object, list[Interval]] = {}
        self._last_peak = math.nan

    def record_collective(self, lane: object, start: float, end: float) -> None:
        """One in-graph collective of replica ``lane`` ran from ``start`` (its input existed)
        to ``end`` (its result existed), ``time.time()`` seconds; thread-safe, O(1).

        Fed by the collective watchdog's host callbacks
        (``zero_runtime.comm.watchdog.CollectiveWatchdog.add_interval_listener``)."""
        with self._lanes_lock:
            lane_list = self._lanes.setdefault(lane, [])
            if len(lane_list) < 100_000:
                lane_list.append((start, end))

    def _drain_lanes(self) -> list[list[Interval]]:
        with self._lanes_lock:
            lanes, self._lanes = self._lanes, {}
        return list(lanes.values())

    def collect(
        self,
        step: int,
        wall_time: float,
        step_seconds: float,
        *,
        config: ZeroConfig,
        config_version: int,
        fallback_mirrored: bool,
        trace: TraceIntervals | None = None,
        traced: bool = False,
    ) -> StepStats:
        """The record of the step that just ended; consumes its counters and intervals.

        Args:
            step: the 0-based step.
            wall_time: seconds since the epoch at its end.
            step_seconds: its duration, seconds (0.0 when unknown, e.g. a post-mortem).
            config: the active config.
            config_version: its version (0 = as started).
            fallback_mirrored: whether the strategy runs as plain mirrored.
            trace: the profiler trace sampled over this step, or None.
            traced: True when the step traced its step function (step 0, a retrace).
        """
        readings = read_probes(self.device, config.nvme_path)
        self._last_peak = readings.framework_device_peak_bytes
        tiers, pages = self.accounting.close_step(step, readings, config)
        if self.reset_peak_each_step:
            self._reset_framework_peak()
        return StepStats(
            step=step,
            wall_time=wall_time,
            tiers=tiers,
            readings=readings,
            timing=self._timing(wall_time, step_seconds, pages, trace) | {"traced": float(traced)},
            pages=pages,
            config_version=config_version,
            collectives=self.accounting.collectives(),
            stage=config.stage,
            fallback_mirrored=fallback_mirrored,
            profiled=trace is not None,
        )

    def skip(self) -> None:
        """A step without a record: drop its intervals (the next record starts clean)."""
        self.timeline.drain()
        self._drain_lanes()

    def add_compute(self, seconds: float) -> None:
        """Record ``seconds`` of runtime-driven compute that ended now (the host update)."""
        end = time.time()
        self.timeline.add("compute", end - seconds, end)

    def watch_io(self, store: Any) -> None:
        """Watch a store's pool: its NVMe I/O becomes ``comm`` intervals and page moves
        (through ``PagedBufferPool.add_io_listener``). A store without a pool, or whose
        pool has no NVMe tier, is left alone."""
        pool = getattr(store, "pool", None)
        if pool is not None:
            pool.add_io_listener(self._record_io)

    def _record_io(self, job: Any) -> None:
        """One finished NVMe job (an ``IoJob``) as an interval and a page move."""
        end = time.time()
        self.timeline.add("comm", end - job.seconds, end)
        self.page_moves.append(
            {
                "wall_time": end,
                "direction": "h2n" if job.op == "write" else "n2h",
                "bytes": int(job.payload),
                "tensor": getattr(job.page, "tensor_id", None),
                "page": getattr(job.page, "index", None),
                "seconds": float(job.seconds),
                "ok": job.error is None,
            }
        )

    def _timing(
        self,
        wall_time: float,
        step_seconds: float,
        pages: dict[str, float],
        trace: TraceIntervals | None,
    ) -> dict[str, float]:
        """The step's TIMING_COLUMNS (seconds; ratio in [0, 1]; NaN = not measured).

        Every step: :func:`step_timing` of the runtime's own intervals over the step's
        window ``[wall_time - step_seconds, wall_time]``. Sampled steps (``trace``): the
        profiler's op intervals instead, plus the runtime's NVMe I/O (the trace has its
        own clock, so the two overlaps are summed).
        """
        drained = self.timeline.drain()
        lanes = self._drain_lanes()
        has_io = self.accounting.has_runtime_io()
        io = drained["comm"] if has_io else []
        stall = pages.get("stall_seconds", math.nan)
        timing = {"step_seconds": step_seconds, "stall_seconds": stall}
        if has_io:
            timing["io_seconds"] = total(io)
        if trace is not None:
            t = overlap(trace.comm, trace.compute)
            o = overlap(io, drained["compute"])
            comm, both = t.comm_seconds + o.comm_seconds, t.overlap_seconds + o.overlap_seconds
            timing.update(
                comm_seconds=comm,
                compute_seconds=t.compute_seconds,
                overlap_seconds=both,
                overlap_ratio=both / comm if comm > 0 else math.nan,
            )
            return timing
        if step_seconds > 0 and (lanes or io):
            window = (wall_time - step_seconds, wall_time)
            timing.update(step_timing(window, lanes, io, drained["compute"], stall))
        return timing

    def last_device_peak(self) -> float:
        """The framework allocator's peak in-use bytes of the step last collected, once:
        NaN when no step was collected since the last call (or the allocator does not
        report a peak)."""
        peak, self._last_peak = self._last_peak, math.nan
        return peak

    def _reset_framework_peak(self) -> None:
        import tensorflow as tf  # lazy: the telemetry package imports without TensorFlow

        try:
            tf.config.experimental.reset_memory_stats(self.device.memory_info_device)
        except (ValueError, RuntimeError):
            pass


def step_timing(
    window: Interval,
    lanes: list[list[Interval]],
    io: list[Interval],
    host_compute: list[Interval],
    stall_seconds: float = math.nan,
) -> dict[str, float]:
    """A step's comm/compute breakdown from host-observed intervals (no profiler).

    Definitions (every interval clipped to ``window``; the overlap is HTA's
    ``|union(comm) ∩ union(compute)| / |union(comm)|``, :mod:`.timeline`):

    - comm: the union of every replica's collectives (``lanes``: one list of
      ``(arm, disarm)`` intervals per replica) and the NVMe I/O (``io``);
    - blocked: the times when *every* replica was inside a collective (intersection of the
      lanes' unions): nothing the host observes can be computing then;
    - compute: the window minus blocked, plus the host update (``host_compute``);
    - overlap: ``|comm ∩ compute|``, less one replica's share of ``stall_seconds`` (the
      pool's page waits, summed over the replicas' threads: I/O that computation did not
      hide), clamped at 0.

    A lower bound of the true overlap: ops a replica runs alongside its own collective
    inside the graph are not seen (the sampled profiler steps see them).

    Args:
        window: the step's ``(start, end)``, ``time.time()`` seconds.
        lanes: per replica, its collectives' intervals (any order, may be empty).
        io: NVMe I/O job intervals.
        host_compute: host optimizer update intervals.
        stall_seconds: seconds the pool waited for pages, summed over the replicas'
            threads (NaN: none known).

    Returns:
        ``comm_seconds``, ``compute_seconds``, ``overlap_seconds`` (seconds) and
        ``overlap_ratio`` in [0, 1] (NaN when there was no communication).
    """
    lo, hi = window
    if not hi > lo:
        raise ValueError(f"window={window!r} is empty: expected (start, end) with end > start")

    def clip(intervals: list[Interval]) -> list[Interval]:
        return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]

    unions = [union(clip(lane)) for lane in lanes if lane]
    comm = union([iv for u in unions for iv in u] + clip(io))
    blocked = unions[0] if unions else []
    for u in unions[1:]:
        blocked = intersect_merged(blocked, u)
    free: list[Interval] = []
    cursor = lo
    for s, e in blocked:
        if s > cursor:
            free.append((cursor, s))
        cursor = max(cursor, e)
    if cursor < hi:
        free.append((cursor, hi))
    compute = union(free + clip(host_compute))
    c = sum(e - s for s, e in comm)
    both = sum(e - s for s, e in intersect_merged(comm, compute))
    if stall_seconds == stall_seconds and stall_seconds > 0:  # not NaN
        # the pool sums its page waits over the replicas' threads: a replica's share
        both = max(0.0, both - stall_seconds / max(1, len(unions)))
    return {
        "comm_seconds": c,
        "compute_seconds": sum(e - s for s, e in compute),
        "overlap_seconds": both,
        "overlap_ratio": both / c if c > 0 else math.nan,
    }
