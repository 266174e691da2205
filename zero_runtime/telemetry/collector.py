"""The telemetry collector: one :class:`StepStats` record from its explicit inputs.

At a step end the coordinator (``zero_runtime.runtime.ZeroRuntime``) hands the collector
the step, its duration, the active config and the sampled profiler trace; the collector
takes the readings (:mod:`~zero_runtime.telemetry.probes`), asks the accounting for the
tiers and page counters (:class:`TierAccounting`, implemented by
``zero_runtime.runtime.accounting.Accounting``), and computes the step's timing from its
own timeline of runtime-driven intervals (the NVMe I/O it watches, the host update).
It owns the timeline, the profiler sampler and the page-move recorder; it holds no
config and writes nothing (``zero_runtime.telemetry.summaries`` writes).
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

from zero_runtime.config import ZeroConfig
from zero_runtime.devices import DeviceInfo
from zero_runtime.telemetry.probes import Readings, read_probes
from zero_runtime.telemetry.profile import ProfileSampler, TraceIntervals
from zero_runtime.telemetry.recorder import PageMoveRecorder
from zero_runtime.telemetry.stats import StepStats, TierStats
from zero_runtime.telemetry.timeline import Timeline, overlap


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
        """
        readings = read_probes(self.device, config.nvme_path)
        tiers, pages = self.accounting.close_step(step, readings, config)
        if self.reset_peak_each_step:
            self._reset_framework_peak()
        return StepStats(
            step=step,
            wall_time=wall_time,
            tiers=tiers,
            readings=readings,
            timing=self._timing(step_seconds, pages, trace),
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
        self, step_seconds: float, pages: dict[str, float], trace: TraceIntervals | None
    ) -> dict[str, float]:
        """The step's TIMING_COLUMNS (seconds; ratio in [0, 1]; NaN = not measured).

        Sampled steps (``trace``): collectives and ops from the profiler trace plus the
        runtime's NVMe I/O. Other steps: only what the runtime drives itself (NVMe I/O as
        comm, the host update as compute); without an NVMe tier nothing is measured.
        Overlaps are computed per clock and summed (the trace has its own clock).
        """
        drained = self.timeline.drain()
        io = overlap(drained["comm"], drained["compute"])
        has_io = self.accounting.has_runtime_io()
        timing = {
            "step_seconds": step_seconds,
            "stall_seconds": pages.get("stall_seconds", math.nan),
        }
        if trace is not None:
            t = overlap(trace.comm, trace.compute)
            comm = t.comm_seconds + (io.comm_seconds if has_io else 0.0)
            both = t.overlap_seconds + (io.overlap_seconds if has_io else 0.0)
            compute = t.compute_seconds
        elif has_io:
            comm, both, compute = io.comm_seconds, io.overlap_seconds, io.compute_seconds
        else:
            return timing
        timing.update(
            comm_seconds=comm,
            compute_seconds=compute,
            overlap_seconds=both,
            overlap_ratio=both / comm if comm > 0 else math.nan,
        )
        return timing

    def _reset_framework_peak(self) -> None:
        import tensorflow as tf  # lazy: the telemetry package imports without TensorFlow

        try:
            tf.config.experimental.reset_memory_stats(self.device.memory_info_device)
        except (ValueError, RuntimeError):
            pass
