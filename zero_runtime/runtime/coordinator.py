"""ZeroRuntime: the per-strategy coordinator behind ``ZeroInfinityStrategy``.

It owns no concept of its own; it wires the runtime's parts and decides *when* each runs.
At a step end (every local replica has updated its optimizer shard, the
:class:`~zero_runtime.runtime.clock.StepClock`), in this order:

1. the :class:`~zero_runtime.telemetry.collector.TelemetryCollector` builds the step's
   StepStats from the :class:`~zero_runtime.runtime.accounting.Accounting` (every
   ``telemetry_every_n_steps``), kept in the flight recorder and handed to
   :class:`~zero_runtime.telemetry.summaries.RunSummaries`;
2. the budgets are checked (:func:`~zero_runtime.runtime.postmortem.check_budgets`); a
   tier over its limit raises after the
   :class:`~zero_runtime.runtime.postmortem.PostMortem` is written;
3. the :class:`~zero_runtime.control.ControlPoller` decides on a live-tuning request,
   in effect from the next step.

The strategy is the public face; the optimizers and the stage-3 engines call back into
the runtime (``register_*``, :meth:`ZeroRuntime.on_shard_updated`,
:meth:`ZeroRuntime.write_postmortem`).
"""

from __future__ import annotations

import enum
import logging
import os
from typing import Any

from zero_runtime import control, oom
from zero_runtime.comm.watchdog import WATCHDOG
from zero_runtime.config import TUNABLE_KEYS, ZeroConfig, validate_tunable_update
from zero_runtime.devices import DeviceInfo
from zero_runtime.memory import host_malloc
from zero_runtime.memory.trace import TRACE_DIR, TraceWriter
from zero_runtime.optim import fused
from zero_runtime.runtime import accounting
from zero_runtime.runtime.accounting import Accounting
from zero_runtime.runtime.clock import StepClock, StepEnd
from zero_runtime.runtime.headroom import HeadroomController, device_capacity_bytes
from zero_runtime.runtime.postmortem import (
    PostMortem,
    check_budgets,
    plan_stage3,
)
from zero_runtime.runtime.reports import RuntimeReports
from zero_runtime.telemetry import FlightRecorder
from zero_runtime.telemetry.collector import TelemetryCollector
from zero_runtime.telemetry.summaries import RunSummaries

log = logging.getLogger(__name__)


class RuntimeState(enum.Enum):
    """Lifecycle: OPEN (accepting steps) -> CLOSED (writer flushed and closed)."""

    OPEN = "open"
    CLOSED = "closed"


class ZeroRuntime(RuntimeReports):
    """Step clock, accounting and telemetry for one strategy (a coordinator of its parts).

    Args:
        config: the validated :class:`ZeroConfig`.
        device: the local devices and the nature of the device tier.
        num_replicas: replicas in sync (the data-parallel degree N_d).
        logdir: the run's TensorBoard directory, or None for no summaries.
        fallback_mirrored: True when the strategy runs as plain mirrored data parallelism.

    Attributes:
        config: the active config (replaced by each applied live-tuning request).
        config_version: its version: 0 as started, then each applied request's.
        control: the run's :class:`control.ControlChannel`, or None without a logdir.
        control_sync: None (one process: this runtime's channel decides), or
            ``(channel, next_step) -> ControlOutcome | None`` that replaces
            ``channel.poll`` at the step boundary: multi-worker, the chief decides and
            every worker adopts its decision at the same step (set by
            ``MultiWorkerZeroInfinityStrategy``).
        telemetry_enabled: False skips collecting and writing StepStats (the overhead
            benchmark's "off"); the budget checks and post-mortems stay on.
        host_margin_bytes: host memory that must stay available at a step boundary.
        steps_recorded: StepStats records made so far.
        recorder: the flight recorder (the last StepStats, for post-mortems).
        accounting, collector, clock, postmortem: the parts (see the module docstring).
    """

    control_sync: Any = None

    def __init__(
        self,
        config: ZeroConfig,
        device: DeviceInfo,
        num_replicas: int,
        logdir: str | None,
        fallback_mirrored: bool = False,
        headroom: HeadroomController | None = None,
    ) -> None:
        self.config = config
        self.headroom = headroom
        self.device = device
        self.num_replicas = num_replicas
        self.logdir = logdir
        self.fallback_mirrored = fallback_mirrored
        self.state = RuntimeState.OPEN
        self.config_version = 0
        self.steps_recorded = 0
        self._last_step = -1  # the last step whose boundary passed (recorded or not)
        self.telemetry_enabled = True
        self.recorder = FlightRecorder()
        self.accounting = Accounting(device)
        self.clock = StepClock(len(device.devices))
        self.collector = TelemetryCollector(device, self.accounting)
        # Every guarded collective's arm -> disarm becomes a comm interval of the step.
        WATCHDOG.add_interval_listener(self.collector.record_collective)
        self._traced_builds: int | None = None  # WATCHDOG.traced_builds at the last step
        # Summaries are serialised off the step's critical path (telemetry/emitter.py).
        self.summaries = RunSummaries(logdir, self._shared_placement) if logdir else None
        self.control = control.ControlChannel(logdir, config) if logdir else None
        # The stage-3 pool's access trace, written off the step's thread (what-if).
        self._trace_writer = TraceWriter(os.path.join(logdir, TRACE_DIR)) if logdir else None
        self._poller = control.ControlPoller(self.control) if self.control else None
        self.postmortem = PostMortem(logdir, device, num_replicas, publish=self._publish_oom)
        self.host_margin_bytes = oom.host_margin_bytes()
        oom.install_excepthook(self)
        self._run_info_impl: str | None = None  # the reduce-scatter run_info last named
        self._run_info_host: dict | None = None  # the host kernels run_info last named
        self._device_capacity = device_capacity_bytes(device)  # bytes, None: unknown
        self._write_run_info()

    # -- the parts' public faces (kept for callers of the one-object runtime) -------------
    @property
    def timeline(self) -> Any:
        """The collector's runtime-driven intervals (:class:`~zero_runtime.telemetry.Timeline`)."""
        return self.collector.timeline

    @property
    def profiler(self) -> Any:
        """The collector's profiler sampler (:class:`~zero_runtime.telemetry.ProfileSampler`)."""
        return self.collector.profiler

    @property
    def page_moves(self) -> Any:
        """The collector's recent page moves (:class:`~zero_runtime.telemetry.PageMoveRecorder`)."""
        return self.collector.page_moves

    @property
    def postmortem_path(self) -> str | None:
        """The OOM post-mortem file written, or None (once per runtime, docs/oom.md)."""
        return self.postmortem.path

    @property
    def last_postmortem(self) -> dict[str, Any] | None:
        """The OOM post-mortem object written last, or None."""
        return self.postmortem.report

    @property
    def device_replicas(self) -> int:
        """Replicas that run in this process."""
        return len(self.device.devices)

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
        self.accounting.add_optimizer(optimizer)
        if self.config.stage < 3 and self.accounting.stage3_plan is None:
            # Keras is building the optimizer for its model now: the OOM advice's
            # ZeRO-Infinity candidate is sized from that model (postmortem.plan_stage3).
            self.accounting.stage3_plan = plan_stage3(optimizer, self.config, self.num_replicas)
        self._observe_store(optimizer.zero_state.store)
        if self.summaries is not None:
            self.summaries.estimate(self.estimate(optimizer))
        self._write_run_info(only_if_changed=True)  # names the reduce-scatter used

    def register_stage3_engine(self, engine: Any) -> None:
        """Track a :class:`~zero_runtime.stage3.Stage3Engine` (called by the engine).

        From then on the tiers record, the page counters, the placement rows and the
        device-budget check come from the engine's paged pool
        (:mod:`zero_runtime.stage3.telemetry`), and an applied ``device_budget_bytes``
        change resizes the pool's device tier (``engine.apply_config``). Its pool's NVMe
        I/O is observed like an optimizer store's. With a log directory, the first
        engine's pool records its access trace (``set_tracing``; written by
        :meth:`_write_access_trace` for the tab's what-if).
        """
        self.accounting.add_stage3_engine(engine)
        self._observe_store(engine)
        if self.headroom is not None and hasattr(engine, "min_device_budget"):
            self.headroom.raise_floor(engine.min_device_budget)  # never below the working set
        pool = getattr(engine, "pool", None)
        if self._trace_writer is not None and pool is not None:
            if len(self.accounting.stage3_engines) == 1:  # the first engine's pool is traced
                pool.set_tracing(True)

    def estimate(self, optimizer: Any) -> dict[str, Any]:
        """The ZeRO estimator's prediction of model-state bytes for one optimizer's
        variables (:func:`zero_runtime.runtime.accounting.estimate`)."""
        return accounting.estimate(optimizer, self.config, self.num_replicas, self.device_replicas)

    def _observe_store(self, store: Any) -> None:
        """Watch a store: its pool's NVMe I/O feeds the collector, and a
        ``PoolOutOfMemoryError`` from its update, or from the write-behinds the end of a
        stage-3 update in backward waits for (``mark_updated``), writes the post-mortem
        before it propagates (as a :class:`oom.TierOutOfMemoryError`)."""
        self.collector.watch_io(store)
        for name in ("update", "mark_updated"):
            method = getattr(store, name, None)
            if method is not None:
                setattr(store, name, self._guard_pool_oom(method))

    def _guard_pool_oom(self, update: Any) -> Any:
        from zero_runtime.memory import PoolOutOfMemoryError

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return update(*args, **kwargs)
            except PoolOutOfMemoryError as exc:
                err = oom.TierOutOfMemoryError(str(exc), exc.snapshot.request_tier)
                raise self._fail(err, self._next_step(), cause=exc) from exc

        return guarded

    # -- the step clock ------------------------------------------------------------------
    def on_shard_updated(
        self, optimizer: Any, replica: int, iteration: int, seconds: float
    ) -> None:
        """Called by a partitioned optimizer after replica ``replica`` updated its shard.

        When all local replicas have updated for ``iteration``, the step has ended: a
        StepStats record is made (every ``telemetry_every_n_steps``), the budgets are
        checked and a live-tuning request is decided on.

        Args:
            optimizer: the optimizer that updated.
            replica: the replica id.
            iteration: Keras's ``iterations`` before the update (the 0-based step).
            seconds: host seconds spent in the update (> 0: runtime-driven compute).

        Raises:
            oom.OutOfMemoryError: a tier is over its limit (post-mortem written).
        """
        del optimizer, replica
        if seconds > 0:
            self.collector.add_compute(seconds)
        end = self.clock.replica_done(iteration)
        if end is not None:
            self._step_boundary(end)

    def _step_boundary(self, end: StepEnd) -> None:
        if self.state is not RuntimeState.OPEN:
            return
        step = end.step
        if self._last_step < 0 and (
            self.config.offload_param != "none" or self.config.offload_optimizer != "none"
        ):  # the first step's dataset reset malloc's settings (memory/host_malloc.py)
            host_malloc.tune_host_malloc(reapply=True)
        self._last_step = step
        self._write_run_info(only_if_changed=True)  # e.g. a reduce-scatter fell back
        trace = self.collector.profiler.stop()  # the sampled window ends with this step
        # Traced: the process's first step, or a step that built guarded collectives.
        traced = self._traced_builds is None or WATCHDOG.traced_builds != self._traced_builds
        self._traced_builds = WATCHDOG.traced_builds
        if self.telemetry_enabled and step % self.config.telemetry_every_n_steps == 0:
            stats = self.collector.collect(
                step,
                end.wall_time,
                end.seconds,
                config=self.config,
                config_version=self.config_version,
                fallback_mirrored=self.fallback_mirrored,
                trace=trace,
                traced=traced,
            )
            self.recorder.append(stats)
            self.steps_recorded += 1
            if self.summaries is not None:
                self.summaries.step(stats)
        else:
            self.collector.skip()
        err = check_budgets(
            step,
            self.config.device_budget_bytes,
            self.accounting.device_used_bytes,
            self.host_margin_bytes,
        )
        if err is not None:
            raise self._fail(err, step)
        self._write_access_trace()
        # After this step's record, before the next step runs: a change applies from it on.
        self._poll_control(step + 1)
        if self.headroom is not None:
            self._hold_headroom(step, self.collector.last_device_peak())
        if self.telemetry_enabled:
            self.collector.profiler.maybe_start(step)

    # -- live tuning ---------------------------------------------------------------------
    def _write_access_trace(self) -> None:
        """Write the first stage-3 pool's newly closed access-trace steps into the run's
        log directory (``<logdir>/memory_hierarchy_trace/step_<step>.json``, the last
        ``TRACE_STEPS`` kept), each with the tunable values in effect (``config``) and
        ``config_version``: the tab's what-if replays them
        (:mod:`zero_runtime.memory.simulate`, docs/tuning.md). The steps are handed to a
        background writer (:class:`~zero_runtime.memory.trace.TraceWriter`); a write
        error is logged, never raised."""
        if self._trace_writer is None:
            return
        engines = self.accounting.live_stage3_engines()
        if not engines:
            return
        steps = engines[0].pool.take_trace_steps()
        if not steps:
            return
        extra = {
            "config": {k: getattr(self.config, k) for k in TUNABLE_KEYS},
            "config_version": self.config_version,
        }
        self._trace_writer.submit(steps, extra)

    def _poll_control(self, next_step: int) -> None:
        """Decide on a new control request before ``next_step`` runs (zero_runtime.control).

        An applied request replaces :attr:`config` (and :attr:`config_version`) and is
        passed to the stage-3 engines (e.g. the device tier's capacity); every decision is
        recorded as a ``memory_hierarchy/config_event`` summary at ``next_step``, the step
        from which an applied change is in effect.
        """
        if self._poller is None:
            return
        outcome = self._poller.poll(next_step, self.control_sync)
        if outcome is None:
            return
        if outcome.status is control.Status.APPLIED:
            self.config = self.control.config
            self.config_version = self.control.version
            if self.headroom is not None and "device_budget_bytes" in outcome.changes:
                self.headroom.turn_off()  # the user's budget takes over from 'auto'
                log.info("headroom: a manual device_budget_bytes change turned 'auto' off")
            for engine in self.accounting.live_stage3_engines():
                engine.apply_config(self.config)
        if self.summaries is not None:
            self.summaries.config_event(next_step, outcome.to_dict())

    def _hold_headroom(self, step: int, peak_bytes: float) -> None:
        """``device_budget_bytes='auto'``: let the controller see the step's allocator
        peak and apply its decision from the next step, like a live-tuning change
        (recorded as a config event with ``source='auto'`` and its reason)."""
        decision = self.headroom.observe(step, peak_bytes, self.config)
        if decision is None:
            return
        log.info("headroom: %s", decision.reason)
        if self.control is not None:
            outcome = self.control.apply_auto(decision.updates, step + 1, decision.reason)
            self.config = self.control.config
        else:
            self.config = validate_tunable_update(self.config, decision.updates)
            outcome = None
        if decision.updates:
            for engine in self.accounting.live_stage3_engines():
                engine.apply_config(self.config)
        if self.summaries is not None and outcome is not None:
            self.summaries.config_event(step + 1, outcome.to_dict())

    def _accepting(self) -> bool:
        """True while the runtime is OPEN (summaries may still be written)."""
        return self.state is RuntimeState.OPEN

    # -- summaries and lifecycle ---------------------------------------------------------
    def _write_run_info(self, only_if_changed: bool = False) -> None:
        impl = self.accounting.reduce_scatter_impl()
        host = fused.resolved_info()  # chosen when a host or NVMe store was built
        changed = impl != self._run_info_impl or host != self._run_info_host
        if self.summaries is None or (only_if_changed and not changed):
            return
        self._run_info_impl, self._run_info_host = impl, host
        self.summaries.run_info(
            self.config,
            self.num_replicas,
            self.device,
            self.fallback_mirrored,
            impl,
            None if self.headroom is None else self.headroom.describe(),
            self._device_capacity,
            host,
        )

    def flush(self) -> None:
        """Write queued summaries to disk (waits for the background emitter first)."""
        if self.summaries is not None:
            self.summaries.flush()
        if self._trace_writer is not None:
            self._trace_writer.flush()

    def close(self) -> None:
        """Close the optimizers' stores, then flush and close the summaries; idempotent."""
        if self.state is RuntimeState.CLOSED:
            return
        self.state = RuntimeState.CLOSED
        WATCHDOG.remove_interval_listener(self.collector.record_collective)
        if self._trace_writer is not None:
            self._write_access_trace()  # the last steps closed
            self._trace_writer.close()
        self.accounting.close_stores()  # e.g. the NVMe pool's files
        if self.control is not None:
            self.control.mark_closed(self._last_step + 1)
        if self.summaries is not None:
            self.summaries.close()  # every StepStats handed over is written first
