"""ZeroRuntime: the per-strategy engine state behind ``ZeroInfinityStrategy``.

It owns what happens at a step boundary: the step clock (a step ends when every local
replica has finished its optimizer-shard update), the StepStats record, the flight
recorder and the summary writer. The strategy is the public face; the optimizers call
back into the runtime from the host update.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import shutil
import threading
import time
from typing import Any

import psutil

from tb_plugin import metadata
from tb_plugin.summary import SummaryWriter
from zero_runtime import control, estimator, oom
from zero_runtime.config import ZeroConfig
from zero_runtime.devices import DeviceInfo, bfc_requested
from zero_runtime.telemetry import (
    BackgroundEmitter,
    FlightRecorder,
    PageMoveRecorder,
    ProfileSampler,
    StepStats,
    TierStats,
    Timeline,
    collective_bytes,
    overlap,
    read_probes,
)

log = logging.getLogger(__name__)


class RuntimeState(enum.Enum):
    """Lifecycle: OPEN (accepting steps) -> CLOSED (writer flushed and closed)."""

    OPEN = "open"
    CLOSED = "closed"


class ZeroRuntime:
    """Step clock, accounting and telemetry for one strategy.

    Args:
        config: the validated :class:`ZeroConfig`.
        device: the local devices and the nature of the device tier.
        num_replicas: replicas in sync (the data-parallel degree N_d).
        logdir: the run's TensorBoard directory, or None for no summaries.
        fallback_mirrored: True when the strategy runs as plain mirrored data parallelism.

    Attributes:
        control_sync: None (one process: this runtime's channel decides), or
            ``(channel, next_step) -> ControlOutcome | None`` that replaces
            ``channel.poll`` at the step boundary: multi-worker, the chief decides and
            every worker adopts its decision at the same step (set by
            ``MultiWorkerZeroInfinityStrategy``).
    """

    control_sync: Any = None

    def __init__(
        self,
        config: ZeroConfig,
        device: DeviceInfo,
        num_replicas: int,
        logdir: str | None,
        fallback_mirrored: bool = False,
    ) -> None:
        self.config = config
        self.device = device
        self.num_replicas = num_replicas
        self.logdir = logdir
        self.fallback_mirrored = fallback_mirrored
        self.recorder = FlightRecorder()
        self.state = RuntimeState.OPEN
        self._writer = SummaryWriter(logdir) if logdir else None
        self._optimizers: list[Any] = []
        # Stage 3 (zero_runtime.stage3): engines whose paged pool is the tier accounting.
        self._stage3_engines: list[Any] = []
        self._stage3_rows: list[dict[str, Any]] = []  # placement rows of the last record
        self._pending: dict[int, int] = {}  # step -> local replicas done
        self._lock = threading.Lock()
        self._last_boundary = time.time()
        self._placement_written = False
        self._host_peak = 0
        self.steps_recorded = 0
        #: Version of the active config: 0 as started, then each applied control request's.
        self.config_version = 0
        self.control = control.ControlChannel(logdir, config) if logdir else None
        # Telemetry (issue #7): False skips collecting and writing StepStats (the overhead
        # benchmark's "off"); the budget checks and post-mortems stay on.
        self.telemetry_enabled = True
        self.timeline = Timeline()  # runtime-driven intervals, time.time() clock
        self.profiler = ProfileSampler()  # sampled TF profiler traces (in-graph collectives)
        self.page_moves = PageMoveRecorder()  # the last NVMe page moves
        self._last_placement: dict[str, Any] | None = None
        # Summaries are serialised off the step's critical path (telemetry/emitter.py).
        self._emitter = BackgroundEmitter(self._emit) if self._writer is not None else None
        # OOM post-mortem (issue #10): the path written, once per runtime.
        self.postmortem_path: str | None = None
        self._postmortem: dict[str, Any] | None = None
        self.host_margin_bytes = oom.host_margin_bytes()
        oom.install_excepthook(self)
        self._write_run_info()

    # -- registration --------------------------------------------------------------------
    def set_fallback_mirrored(self, value: bool) -> None:
        """Record that the strategy runs as plain mirrored data parallelism (or not).

        Called by a partitioned optimizer whose model states are below
        ``mirrored_fallback_bytes``; run_info is written again (its tag's contract: "at
        start and when it changes").
        """
        if self.fallback_mirrored == bool(value):
            return
        self.fallback_mirrored = bool(value)
        self._write_run_info()

    def register_optimizer(self, optimizer: Any) -> None:
        """Track a partitioned optimizer whose host state counts toward the host tier.

        Also records the estimator's prediction for the optimizer's parameters as the
        ``memory_hierarchy/estimate`` event, so the view can draw predicted beside measured.
        """
        with self._lock:
            self._optimizers.append(optimizer)
        self._observe_store(optimizer.zero_state.store)
        if self._writer is not None:
            self._writer.json(metadata.TAG_ESTIMATE, 0, self.estimate(optimizer))

    def register_stage3_engine(self, engine: Any) -> None:
        """Track a :class:`~zero_runtime.stage3.Stage3Engine` (called by the engine).

        From then on the tiers record, the page counters, the placement rows and the
        device-budget check come from the engine's paged pool
        (:mod:`zero_runtime.stage3.telemetry`), and an applied ``device_budget_bytes``
        change resizes the pool's device tier (``engine.apply_config``). Its pool's NVMe
        I/O is observed like an optimizer store's.
        """
        with self._lock:
            self._stage3_engines.append(engine)
        self._observe_store(engine)

    def _live_stage3_engines(self) -> list[Any]:
        return [e for e in self._stage3_engines if not e.pool.closed]

    def estimate(self, optimizer: Any) -> dict[str, Any]:
        """The ZeRO estimator's prediction of model-state bytes for one optimizer's variables.

        Returns:
            ``{"per_replica": TierEstimate.to_dict(), "local_replicas": int,
            "per_process": {"device_bytes", "host_bytes", "nvme_bytes"}, "num_params": int,
            "precision": "fp32", "optimizer": kind, "source": str}``. ``per_process`` is the
            per-replica figure times the replicas in this process, the scope of the tier
            telemetry.
        """
        num_params = optimizer.flat_layout.total
        kind = estimator.optimizer_kind(optimizer)
        est = estimator.estimate_for_config(
            num_params, self.num_replicas, self.config, precision="fp32", optimizer=kind
        )
        local = self.device_replicas
        return {
            "per_replica": est.to_dict(),
            "local_replicas": local,
            "per_process": {
                "device_bytes": est.device_bytes * local,
                "host_bytes": est.host_bytes * local,
                "nvme_bytes": est.nvme_bytes * local,
            },
            "num_params": num_params,
            "precision": "fp32",
            "optimizer": kind,
            "source": "ZeRO (Rajbhandari et al., SC20) sections 3.1 and 5.1, "
            "zero_runtime.estimator",
        }

    # -- the step clock ------------------------------------------------------------------
    def on_shard_updated(
        self, optimizer: Any, replica: int, iteration: int, seconds: float
    ) -> None:
        """Called by a partitioned optimizer after replica ``replica`` updated its shard.

        When all local replicas have updated for ``iteration``, the step has ended: a
        StepStats record is made (every ``telemetry_every_n_steps``).

        Args:
            optimizer: the optimizer that updated.
            replica: the replica id.
            iteration: Keras's ``iterations`` before the update (the 0-based step).
            seconds: host seconds spent in the update.
        """
        del optimizer, replica
        if seconds > 0:  # the host update: runtime-driven compute
            end = time.time()
            self.timeline.add("compute", end - seconds, end)
        with self._lock:
            done = self._pending.get(iteration, 0) + 1
            if done < self.device_replicas:
                self._pending[iteration] = done
                return
            self._pending.pop(iteration, None)
        self._step_boundary(iteration)

    @property
    def device_replicas(self) -> int:
        """Replicas that run in this process."""
        return len(self.device.devices)

    def _step_boundary(self, step: int) -> None:
        now = time.time()
        step_seconds = now - self._last_boundary
        self._last_boundary = now
        if self.state is not RuntimeState.OPEN:
            return
        trace = self.profiler.stop()  # the sampled window ends with this step
        self._trace = trace
        if self.telemetry_enabled and step % self.config.telemetry_every_n_steps == 0:
            stats = self._collect(step, now, step_seconds)
            self.recorder.append(stats)
            self.steps_recorded += 1
            if self._emitter is not None:
                self._emitter.submit(stats)
        else:
            self.timeline.drain()
        self._trace = None
        self._check_memory(step)  # raises (post-mortem written) when a tier is over
        # After this step's record, before the next step runs: a change applies from it on.
        self._poll_control(step + 1)
        if self.telemetry_enabled:
            self.profiler.maybe_start(step)

    # -- live tuning ---------------------------------------------------------------------
    def _poll_control(self, next_step: int) -> None:
        """Decide on a new control request before ``next_step`` runs (zero_runtime.control).

        An applied request replaces :attr:`config` (and :attr:`config_version`); every
        decision is recorded as a ``memory_hierarchy/config_event`` summary at
        ``next_step``, the step from which an applied change is in effect.
        """
        if self.control is None:
            return
        if self.control_sync is not None:
            outcome = self.control_sync(self.control, next_step)
        else:
            outcome = self.control.poll(next_step)
        if outcome is None:
            return
        if outcome.status is control.Status.APPLIED:
            self.config = self.control.config
            self.config_version = self.control.version
            for engine in self._live_stage3_engines():  # e.g. the device tier's capacity
                engine.apply_config(self.config)
            log.info(
                "live tuning: applied version %d at step %d: %s",
                outcome.version,
                next_step,
                outcome.changes,
            )
        else:
            log.warning(
                "live tuning: %s version %d: %s",
                outcome.status.value,
                outcome.version,
                outcome.reason,
            )
        if self._writer is not None:
            self._writer.json(metadata.TAG_CONFIG_EVENT, next_step, outcome.to_dict())
            self._writer.flush()

    # -- checkpoints ---------------------------------------------------------------------
    def record_checkpoint(self, record: dict[str, Any]) -> None:
        """Write one checkpoint save or restore as a json summary (fields and units:
        docs/events.md), at step ``record["step"]`` (the optimizer step saved or restored,
        int >= 0), and flush it. The tag follows ``record["op"]``
        (:data:`tb_plugin.metadata.CHECKPOINT_OP_TAGS`): a save under
        ``memory_hierarchy/checkpoint``, a restore under ``memory_hierarchy/checkpoint_restore``,
        so a resume at the step its checkpoint was saved keeps both under TensorBoard's
        ``--load_fast`` (one value per run, tag and step). No-op without a log directory or
        after :meth:`close`. Called by ``zero_runtime.checkpoint.CheckpointManager``.

        Raises:
            ValueError: ``record["op"]`` is neither ``"save"`` nor ``"restore"``.
            TypeError: ``record`` is not JSON-serialisable.
        """
        if self._writer is None or self.state is not RuntimeState.OPEN:
            return
        tag = metadata.CHECKPOINT_OP_TAGS.get(record.get("op"))
        if tag is None:
            raise ValueError(
                f"checkpoint record op {record.get('op')!r} is not one of "
                f"{sorted(metadata.CHECKPOINT_OP_TAGS)}"
            )
        self._writer.json(tag, int(record["step"]), dict(record))
        self._writer.flush()

    # -- accounting ----------------------------------------------------------------------
    def model_param_bytes(self) -> int:
        """Bytes of one replica's trainable variables tracked by the optimizers."""
        total = 0
        for opt in self._optimizers:
            total += 4 * opt.flat_layout.total
        return total

    def host_state_bytes(self) -> tuple[int, int]:
        """(optimizer-state bytes, scratch bytes) held on the host by all optimizers."""
        return self._state_bytes_on("host")

    def _state_bytes_on(self, tier: str) -> tuple[int, int]:
        """(optimizer-state bytes, other bytes) the optimizers' stores hold on ``tier``."""
        state = other = 0
        for opt in self._optimizers:
            s, o = opt.zero_state.store.usage().get(tier, (0, 0))
            state += s
            other += o
        return state, other

    def grad_bytes(self) -> int:
        """Device bytes of gradients the local replicas keep, by the ZeRO accounting.

        Stage 1: the reduced gradient of every bucket exists in full (``4 * padded_total``
        per replica); stage 2: only the reduced shard (``4 * shard_size``), section 5.2 of
        the ZeRO paper. With accumulation (N > 1) the kept buffer is the accumulator
        (stage 1: ``padded_total``, stage 2: ``shard_size`` elements per replica). Stage 3
        with the update in backward (zero_runtime/optim/backward_update.py): one block's
        shard at a time (the largest block's ``shard_elements``), handed to the host as
        soon as it is reduced.
        """
        total = 0
        in_backward = [e for e in self._live_stage3_engines() if e.update_in_backward]
        for opt in self._optimizers:
            zs = opt.zero_state
            if zs.accumulators:
                total += zs.accumulator_bytes
                continue
            per = zs.layout.shard_size if zs.stage >= 2 else zs.layout.padded_total
            if zs.stage == 3 and in_backward:
                per = max(e.max_block_shard_elements for e in in_backward)
            total += 4 * per * self.device_replicas
        return total

    def _page_counters(self, step: int) -> dict[str, float]:
        pages: dict[str, float] = {}
        for opt in self._optimizers:
            boundary = getattr(opt.zero_state.store, "step_boundary", None)
            if boundary is None:
                continue
            for name, value in zip(metadata.PAGE_COLUMNS, boundary(step).as_row()):
                pages[name] = pages.get(name, 0.0) + value
        return pages

    def _collect(self, step: int, now: float, step_seconds: float) -> StepStats:
        readings = read_probes(self.device, self.config.nvme_path)
        param_bytes = float(self.model_param_bytes() * self.device_replicas)
        grad_bytes = float(self.grad_bytes())
        device_opt, _ = self._state_bytes_on("device")
        used = readings.framework_device_bytes
        attributed = param_bytes + grad_bytes + device_opt
        device = TierStats(
            used_bytes=used,
            capacity_bytes=_or_nan(self.config.device_budget_bytes),
            peak_bytes=readings.framework_device_peak_bytes,
            param_bytes=param_bytes,
            grad_bytes=grad_bytes,
            optimizer_bytes=float(device_opt),
            other_bytes=max(0.0, used - attributed) if math.isfinite(used) else math.nan,
        )
        state, scratch = self.host_state_bytes()
        host_used = float(state + scratch)
        self._host_peak = max(self._host_peak, int(host_used))
        host_capacity = self.config.host_budget_bytes or psutil.virtual_memory().total
        host = TierStats(
            used_bytes=host_used,
            capacity_bytes=float(host_capacity),
            peak_bytes=float(self._host_peak),
            param_bytes=0.0,
            grad_bytes=0.0,
            optimizer_bytes=float(state),
            other_bytes=float(scratch),
        )
        self._host_peak = int(host_used)
        nvme_state, _ = self._state_bytes_on("nvme")
        nvme = TierStats(
            used_bytes=float(nvme_state),
            capacity_bytes=_or_nan(self.config.nvme_budget_bytes),
            peak_bytes=float(nvme_state),
            param_bytes=0.0,
            grad_bytes=0.0,
            optimizer_bytes=float(nvme_state),
            other_bytes=0.0,
        )
        self._reset_framework_peak()
        pages = self._page_counters(step)
        tiers = {"device": device, "host": host, "nvme": nvme}
        if self._live_stage3_engines():
            tiers = self._stage3_collect(step, tiers, pages)
        trace = getattr(self, "_trace", None)
        return StepStats(
            step=step,
            wall_time=now,
            tiers=tiers,
            readings=readings,
            timing=self._timing(step_seconds, pages, trace),
            pages=pages,
            config_version=self.config_version,
            collectives=self._collectives(),
            stage=self.config.stage,
            fallback_mirrored=self.fallback_mirrored,
            profiled=trace is not None,
        )

    def _stage3_collect(
        self, step: int, tiers: dict[str, TierStats], pages: dict[str, float]
    ) -> dict[str, TierStats]:
        """Close the stage-3 pools' step: their page counters are added to ``pages``,
        their placement rows kept for :meth:`placement`, and the tiers rebuilt from their
        accounting (:func:`zero_runtime.stage3.telemetry.stage3_tiers`)."""
        from zero_runtime.stage3.telemetry import stage3_tiers

        engines = self._live_stage3_engines()
        records = [e.close_step(step) for e in engines]
        for record in records:
            for name, value in zip(metadata.PAGE_COLUMNS, record.counters.as_row()):
                pages[name] = pages.get(name, 0.0) + value
        opt_tier = {"none": "device", "cpu": "host", "nvme": "nvme"}[self.config.offload_optimizer]
        self._stage3_rows = [row for e in engines for row in e.placement_rows(opt_tier)]
        return stage3_tiers(tiers, records, float(self.grad_bytes()))

    def _reset_framework_peak(self) -> None:
        import tensorflow as tf

        try:
            tf.config.experimental.reset_memory_stats(self.device.memory_info_device)
        except (ValueError, RuntimeError):
            pass

    # -- summaries -----------------------------------------------------------------------
    def _write_run_info(self) -> None:
        if self._writer is None:
            return
        self._writer.json(
            metadata.TAG_RUN_INFO,
            0,
            {
                "stage": self.config.stage,
                "num_replicas": self.num_replicas,
                "devices": list(self.device.devices),
                "device_is_standin": self.device.is_standin,
                "device_description": self.device.description,
                "device_allocator_stats_requested": bfc_requested() or not self.device.is_standin,
                "fallback_mirrored": self.fallback_mirrored,
                "config": self.config.to_dict(),
                "host_total_bytes": psutil.virtual_memory().total,
            },
        )

    def _emit(self, stats: StepStats) -> None:
        w = self._writer
        assert w is not None
        w.matrix(
            metadata.TAG_TIERS,
            stats.step,
            {name: t.as_dict() for name, t in stats.tiers.items()},
            wall_time=stats.wall_time,
        )
        w.vector(metadata.TAG_READINGS, stats.step, stats.readings.as_dict(), stats.wall_time)
        w.vector(metadata.TAG_TIMING, stats.step, stats.timing, stats.wall_time)
        w.vector(metadata.TAG_PAGES, stats.step, stats.pages, stats.wall_time)
        w.vector(metadata.TAG_STEP_INFO, stats.step, stats.step_info(), stats.wall_time)
        if stats.collectives:
            w.vector(metadata.TAG_COLLECTIVES, stats.step, stats.collectives, stats.wall_time)
        placement = self.placement()
        if placement != self._last_placement:  # first step and whenever it changes
            w.json(metadata.TAG_PLACEMENT, stats.step, placement, stats.wall_time)
            self._last_placement = placement
            self._placement_written = True

    def placement(self) -> dict[str, Any]:
        """Where every trainable variable's parameter, gradient and optimizer state live.

        Returns:
            ``{"variables": [{"name", "shape", "dtype", "bytes", "partitioning",
            "shard_bytes_per_replica", "param_tier", "grad_tier", "optimizer_tier"}]}``
            with bytes as ints. Stage-3 variables come from the engines' pools as of the
            last step record (``Stage3Engine.placement_rows``).
        """
        rows = []
        opt_tier = {"none": "device", "cpu": "host", "nvme": "nvme"}[self.config.offload_optimizer]
        for opt in self._optimizers:
            zs = opt.zero_state
            if zs.stage >= 3:  # rows from the stage-3 engines' pools (below)
                continue
            layout = zs.layout
            n = layout.num_shards
            if zs.stage >= 2:
                text = f"optimizer state and gradient sharded 1/{n} (ZeRO-2); parameter replicated"
            else:
                text = f"optimizer state sharded 1/{n} (ZeRO-1); parameter and gradient replicated"
            for name, shape, size in zip(layout.names, layout.shapes, layout.sizes):
                rows.append(
                    {
                        "name": name,
                        "shape": list(shape),
                        "dtype": "float32",
                        "bytes": 4 * size,
                        "partitioning": text,
                        "shard_bytes_per_replica": 4 * -(-size // n),
                        "param_tier": "device",
                        "grad_tier": "device",
                        "optimizer_tier": opt_tier,
                    }
                )
        rows.extend(self._stage3_rows)
        return {"variables": rows}

    # -- telemetry: intervals, collectives (issue #7) ------------------------------------
    def _observe_store(self, store: Any) -> None:
        """Watch an optimizer-state store: its pool's NVMe I/O becomes ``comm`` intervals
        and page moves, and a ``PoolOutOfMemoryError`` from its update writes the
        post-mortem before it propagates (as a :class:`oom.TierOutOfMemoryError`).

        The pool has no public completion hook yet, so the I/O scheduler's completion
        callback (an attribute of our own scheduler object) is wrapped here.
        """
        sched = getattr(getattr(store, "pool", None), "_io", None)
        if sched is not None and hasattr(sched, "_on_complete"):
            inner = sched._on_complete

            def on_complete(job: Any, _inner=inner) -> None:
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
                _inner(job)

            sched._on_complete = on_complete
        update = getattr(store, "update", None)
        if update is not None:
            store.update = self._guard_pool_oom(update)

    def _guard_pool_oom(self, update: Any) -> Any:
        from zero_runtime.memory import PoolOutOfMemoryError

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return update(*args, **kwargs)
            except PoolOutOfMemoryError as exc:
                snap = exc.snapshot
                err = oom.TierOutOfMemoryError(str(exc), snap.request_tier)
                step = self.recorder.last(1)[0].step + 1 if len(self.recorder) else 0
                raise self._fail(err, step, cause=exc) from exc

        return guarded

    def _has_runtime_io(self) -> bool:
        return any(hasattr(o.zero_state.store, "pool") for o in self._optimizers)

    def _timing(self, step_seconds: float, pages: dict[str, float], trace: Any) -> dict[str, float]:
        """The step's TIMING_COLUMNS (seconds; ratio in [0, 1]; NaN = not measured).

        Sampled steps (``trace``): collectives and ops from the profiler trace plus the
        runtime's NVMe I/O. Other steps: only what the runtime drives itself (NVMe I/O as
        comm, the host update as compute); without an NVMe tier nothing is measured.
        Overlaps are computed per clock and summed (the trace has its own clock).
        """
        drained = self.timeline.drain()
        io = overlap(drained["comm"], drained["compute"])
        has_io = self._has_runtime_io()
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

    def _collectives(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for opt in self._optimizers:
            for k, v in collective_bytes(opt.zero_state, self.device_replicas).items():
                out[k] = out.get(k, 0.0) + v
        return out

    # -- out of memory (issue #10) -------------------------------------------------------
    def device_used_bytes(self) -> float:
        """Device-tier bytes in use: the framework's reading, else the runtime's accounting
        (parameters, gradients and device optimizer states of the local replicas). At
        stage 3, the stage-3 pools' device pages (the pool enforces the budget itself)."""
        from zero_runtime.devices import framework_memory_bytes

        engines = self._live_stage3_engines()
        if engines:  # stage 3: the device tier is the pool's, which enforces the budget
            return float(sum(e.pool.usage()["device"].used_bytes for e in engines))
        current, _ = framework_memory_bytes(self.device)
        if math.isfinite(current):
            return current
        return float(
            self.model_param_bytes() * self.device_replicas
            + self.grad_bytes()
            + self._state_bytes_on("device")[0]
        )

    def _check_memory(self, step: int) -> None:
        """Enforce the device budget and the host-memory margin at a step boundary.

        Raises:
            oom.DeviceBudgetExceededError: device used bytes > ``device_budget_bytes``.
            oom.HostMemoryLowError: available host memory < :attr:`host_margin_bytes`.
            (Both after writing the post-mortem.)
        """
        budget = self.config.device_budget_bytes
        if budget is not None:
            used = self.device_used_bytes()
            if used > budget:
                raise self._fail(oom.DeviceBudgetExceededError(int(used), budget, step), step)
        available = psutil.virtual_memory().available
        if available < self.host_margin_bytes:
            err = oom.HostMemoryLowError(available, self.host_margin_bytes, step)
            raise self._fail(err, step)

    def write_postmortem(self, exc: BaseException, step: int | None = None) -> str | None:
        """Write the OOM post-mortem for ``exc`` (e.g. a TensorFlow
        ``ResourceExhaustedError`` the caller caught); returns the JSON file's path.

        Idempotent: an error whose post-mortem this runtime already wrote (ours, or
        TensorFlow's re-raise of ours, whose message names the file) returns that path.
        The failed tier is the error's own (runtime errors, pool snapshots), else
        'device' (TensorFlow's allocator serves the device tier).
        """
        known = getattr(exc, "postmortem_path", None)
        if known is not None or (
            self.postmortem_path is not None and self.postmortem_path in str(exc)
        ):
            return known or self.postmortem_path
        if step is None:
            step = self.recorder.last(1)[0].step + 1 if len(self.recorder) else 0
        tier = getattr(exc, "tier", None)
        snapshot = getattr(exc, "snapshot", None)
        if tier is None:
            tier = snapshot.request_tier if snapshot is not None else "device"
        err = oom.OutOfMemoryError(str(exc), tier)
        self._fail(err, step, cause=exc)
        return err.postmortem_path

    def _fail(
        self, err: oom.OutOfMemoryError, step: int, cause: BaseException | None = None
    ) -> oom.OutOfMemoryError:
        """Build and write the post-mortem for ``err`` (summary + JSON file); returns
        ``err`` with the path attached, for the caller to raise."""
        try:
            report = self._postmortem_report(err, step, cause or err)
        except Exception as exc:  # noqa: BLE001 - never hide the OOM behind a report bug
            log.exception("could not build the OOM post-mortem: %s", exc)
            return err
        path = None
        if self._writer is not None and self.state is RuntimeState.OPEN:
            self._writer.json(metadata.TAG_OOM, step, report, report["wall_time"])
            self._writer.flush()
        if self.logdir:
            path = os.path.join(self.logdir, oom.OOM_FILENAME)
            oom.write_json_atomic(path, report)
        self.postmortem_path = path
        self._postmortem = report
        err.attach(path, report)
        log.error("out of memory at step %d on tier %s; post-mortem: %s", step, err.tier, path)
        return err

    def _postmortem_report(
        self, err: oom.OutOfMemoryError, step: int, cause: BaseException
    ) -> dict[str, Any]:
        snap = self._collect(step, time.time(), 0.0)  # consumes the failed step's counters
        tiers: dict[str, dict[str, Any]] = {}
        labels = {
            "param": "parameters (local replicas)",
            "grad": "gradients (local replicas)",
            "optimizer": "optimizer states",
            "other": "activations, scratch and framework (unattributed)",
        }
        for name, t in snap.tiers.items():
            holders = [
                oom.holder(labels[k], k, getattr(t, f"{k}_bytes"))
                for k in ("param", "grad", "optimizer", "other")
                if math.isfinite(getattr(t, f"{k}_bytes")) and getattr(t, f"{k}_bytes") > 0
            ]
            tiers[name] = {
                "capacity_bytes": _or_none(t.capacity_bytes),
                "used_bytes": _or_none(t.used_bytes),
                "holders": holders,
            }
        pool_snap = getattr(cause, "snapshot", None)
        request_bytes = tensor = None
        if pool_snap is not None:  # the pool's own tiers, tensor by tensor
            for name, t in pool_snap.tiers.items():
                tiers[name] = {
                    "capacity_bytes": t["capacity_bytes"],
                    "used_bytes": t["used_bytes"],
                    "holders": [
                        oom.holder(h.tensor_id, h.kind, h.bytes, h.pages)
                        for h in pool_snap.holders.get(name, ())
                    ],
                }
            request_bytes, tensor = pool_snap.request_bytes, pool_snap.request_tensor_id
        elif isinstance(err, oom.DeviceBudgetExceededError):
            tiers["device"]["used_bytes"] = err.used_bytes
        else:
            request_bytes = oom.request_from_message(str(cause))
        tier = err.tier
        failed = {
            "bytes": request_bytes,
            "tier": tier,
            "tensor": tensor,
            "op": getattr(cause, "op", None) and getattr(cause.op, "name", None),
            "error_type": type(cause).__name__,
            "message": str(cause).split("\n\npost-mortem")[0][:4000],
        }
        t = tiers[tier]
        used = int(t["used_bytes"] or 0) + int(request_bytes or 0)
        return oom.build_report(
            step=step,
            failed=failed,
            tiers=tiers,
            recent_steps=[
                {
                    "step": r.step,
                    "tiers": {
                        n: {
                            "used_bytes": _or_none(ts.used_bytes),
                            "capacity_bytes": _or_none(ts.capacity_bytes),
                        }
                        for n, ts in r.tiers.items()
                    },
                }
                for r in self.recorder.last()
            ],
            config=self.config.to_dict(),
            config_version=self.config_version,
            config_history=[o.to_dict() for o in self.control.history] if self.control else [],
            readings=snap.readings.as_dict(),
            advice=self._advice(tier, used, t, snap),
        )

    def _advice(
        self, tier: str, required: int, t: dict[str, Any], snap: StepStats
    ) -> list[dict[str, Any]]:
        from zero_runtime.strategy import IMPLEMENTED

        stats = snap.tiers[tier]
        holders = {
            k: int(getattr(stats, f"{k}_bytes"))
            for k in ("param", "grad", "optimizer")
            if math.isfinite(getattr(stats, f"{k}_bytes"))
        }
        vm = psutil.virtual_memory()
        nvme_free = None
        if self.config.nvme_path and os.path.isdir(self.config.nvme_path):
            nvme_free = shutil.disk_usage(self.config.nvme_path).free
        nvml_total = snap.readings.nvml_total_bytes
        device_physical = int(vm.total) if self.device.is_standin else _or_none(nvml_total)
        host_used = snap.tiers["host"].used_bytes
        host_cap = self.config.host_budget_bytes
        host_free = (
            int(host_cap - host_used)
            if host_cap is not None and math.isfinite(host_used)
            else int(vm.available)
        )
        return oom.advise(
            failed_tier=tier,
            required_bytes=int(required),
            capacity_bytes=_or_none(t["capacity_bytes"]),
            holders=holders,
            config=self.config,
            num_replicas=self.num_replicas,
            physical_bytes={
                "device": device_physical,
                "host": int(vm.total),
                "nvme": None if nvme_free is None else nvme_free + int(t["used_bytes"] or 0),
            },
            free_bytes={"host": host_free, "nvme": nvme_free},
            implemented=set(IMPLEMENTED),
        )

    def flush(self) -> None:
        """Write queued summaries to disk (waits for the background emitter first)."""
        if self._emitter is not None:
            self._emitter.drain()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the summary writer; idempotent."""
        if self.state is RuntimeState.CLOSED:
            return
        self.state = RuntimeState.CLOSED
        for opt in self._optimizers:
            opt.zero_state.store.close()  # e.g. the NVMe pool's files
        if self._emitter is not None:
            self._emitter.close()  # every StepStats handed over is written first
        if self._writer is not None:
            self._writer.close()


def _or_nan(value: int | None) -> float:
    return math.nan if value is None else float(value)


def _or_none(value: float | None) -> int | None:
    """An int, or None for None / NaN (the post-mortem's "unknown")."""
    if value is None or not math.isfinite(value):
        return None
    return int(value)
