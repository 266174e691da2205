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
import threading
import time
from typing import Any

import psutil

from tb_plugin import metadata
from tb_plugin.summary import SummaryWriter
from zero_runtime import control, estimator
from zero_runtime.config import ZeroConfig
from zero_runtime.devices import DeviceInfo, bfc_requested
from zero_runtime.telemetry import FlightRecorder, StepStats, TierStats, read_probes

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
    """

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
        self._pending: dict[int, int] = {}  # step -> local replicas done
        self._lock = threading.Lock()
        self._last_boundary = time.time()
        self._placement_written = False
        self._host_peak = 0
        self.steps_recorded = 0
        #: Version of the active config: 0 as started, then each applied control request's.
        self.config_version = 0
        self.control = control.ControlChannel(logdir, config) if logdir else None
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
        if self._writer is not None:
            self._writer.json(metadata.TAG_ESTIMATE, 0, self.estimate(optimizer))

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
        del optimizer, replica, seconds
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
        if step % self.config.telemetry_every_n_steps == 0:
            stats = self._collect(step, now, step_seconds)
            self.recorder.append(stats)
            self.steps_recorded += 1
            if self._writer is not None:
                self._emit(stats)
        # After this step's record, before the next step runs: a change applies from it on.
        self._poll_control(step + 1)

    # -- live tuning ---------------------------------------------------------------------
    def _poll_control(self, next_step: int) -> None:
        """Decide on a new control request before ``next_step`` runs (zero_runtime.control).

        An applied request replaces :attr:`config` (and :attr:`config_version`); every
        decision is recorded as a ``memory_hierarchy/config_event`` summary at
        ``next_step``, the step from which an applied change is in effect.
        """
        if self.control is None:
            return
        outcome = self.control.poll(next_step)
        if outcome is None:
            return
        if outcome.status is control.Status.APPLIED:
            self.config = self.control.config
            self.config_version = self.control.version
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
        (stage 1: ``padded_total``, stage 2: ``shard_size`` elements per replica).
        """
        total = 0
        for opt in self._optimizers:
            zs = opt.zero_state
            if zs.accumulators:
                total += zs.accumulator_bytes
                continue
            per = zs.layout.shard_size if zs.stage >= 2 else zs.layout.padded_total
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
        return StepStats(
            step=step,
            wall_time=now,
            tiers={"device": device, "host": host, "nvme": nvme},
            readings=readings,
            timing={"step_seconds": step_seconds},
            pages=self._page_counters(step),
            config_version=self.config_version,
        )

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
        if not self._placement_written:
            w.json(metadata.TAG_PLACEMENT, stats.step, self.placement(), stats.wall_time)
            self._placement_written = True

    def placement(self) -> dict[str, Any]:
        """Where every trainable variable's parameter, gradient and optimizer state live.

        Returns:
            ``{"variables": [{"name", "shape", "dtype", "bytes", "partitioning",
            "shard_bytes_per_replica", "param_tier", "grad_tier", "optimizer_tier"}]}``
            with bytes as ints.
        """
        rows = []
        opt_tier = {"none": "device", "cpu": "host", "nvme": "nvme"}[self.config.offload_optimizer]
        for opt in self._optimizers:
            zs = opt.zero_state
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
        return {"variables": rows}

    def flush(self) -> None:
        """Write queued summaries to disk."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the summary writer; idempotent."""
        if self.state is RuntimeState.CLOSED:
            return
        self.state = RuntimeState.CLOSED
        for opt in self._optimizers:
            opt.zero_state.store.close()  # e.g. the NVMe pool's files
        if self._writer is not None:
            self._writer.close()


def _or_nan(value: int | None) -> float:
    return math.nan if value is None else float(value)
