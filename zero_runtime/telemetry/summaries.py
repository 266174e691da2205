"""The run's Memory Hierarchy summaries: every tag the runtime writes, in one place.

:class:`RunSummaries` owns the run's :class:`tb_plugin.summary.SummaryWriter` and the
:class:`~zero_runtime.telemetry.emitter.BackgroundEmitter` that writes StepStats records
off the step's critical path. Tags, shapes and units: ``tb_plugin/metadata.py`` and
docs/events.md. Callers pass plain values; nothing here reads the runtime's state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import psutil

from tb_plugin import metadata
from tb_plugin.summary import SummaryWriter
from zero_runtime.config import ZeroConfig
from zero_runtime.devices import DeviceInfo, bfc_requested
from zero_runtime.telemetry.emitter import BackgroundEmitter
from zero_runtime.telemetry.stats import StepStats


class RunSummaries:
    """Writes one run's summaries.

    Args:
        logdir: the run's TensorBoard directory (created if missing).
        placement: returns the current placement object (``{"variables": [...]}``); called
            on the emitter thread after each record, which writes it when it changed.
    """

    def __init__(self, logdir: str, placement: Callable[[], dict[str, Any]]) -> None:
        self._writer = SummaryWriter(logdir)
        self._placement = placement
        self._last_placement: dict[str, Any] | None = None
        # Records are written in batches; each batch goes to the file writer at once.
        self._emitter = BackgroundEmitter(self._write_step, after_batch=self._writer.release)

    def run_info(
        self,
        config: ZeroConfig,
        num_replicas: int,
        device: DeviceInfo,
        fallback_mirrored: bool,
        reduce_scatter_impl: str | None = None,
        device_budget: Mapping[str, Any] | None = None,
        device_capacity_bytes: int | None = None,
        host_optimizer: Mapping[str, Any] | None = None,
    ) -> None:
        """``memory_hierarchy/run_info`` at step 0 (at start and whenever it changes): the
        stage, replicas, devices and the nature of the device tier, the config, whether
        the strategy runs as plain mirrored, the host's physical memory (bytes) and, once a
        stage-2 optimizer is built, ``reduce_scatter_impl``: the implementation its
        reduce-scatter runs ('nccl', 'all_to_all' or 'all_reduce', also after a fallback;
        zero_runtime.comm.reduce_scatter_sum_flat) and, with ``device_budget_bytes='auto'``,
        ``device_budget``: the headroom controller's settings as started
        (``HeadroomController.describe``: mode, capacity, headroom fraction, target peak)
        and, when known, ``device_capacity_bytes``: the device's memory, bytes, the limit
        TensorFlow's allocator enforces (a GPU's total memory by NVML; on the CPU stand-in
        the allocator's cap ``TF_CPU_BFC_MEM_LIMIT_IN_MB``; absent when unknown or
        unset) and, once an optimizer keeps states on the host or NVMe,
        ``host_optimizer``: the host update kernels in use
        (:func:`zero_runtime.optim.fused.backend_info`: ``backend`` 'numba' with its
        version, threading layer and threads per call, or 'numpy' with the ``reason``)."""
        info = {
            "stage": config.stage,
            "num_replicas": num_replicas,
            "devices": list(device.devices),
            "device_is_standin": device.is_standin,
            "device_description": device.description,
            "device_allocator_stats_requested": bfc_requested() or not device.is_standin,
            "fallback_mirrored": fallback_mirrored,
            "config": config.to_dict(),
            "host_total_bytes": psutil.virtual_memory().total,
        }
        if reduce_scatter_impl is not None:
            info["reduce_scatter_impl"] = reduce_scatter_impl
        if device_budget is not None:
            info["device_budget"] = dict(device_budget)
        if device_capacity_bytes is not None:
            info["device_capacity_bytes"] = int(device_capacity_bytes)
        if host_optimizer is not None:
            info["host_optimizer"] = dict(host_optimizer)
        self._writer.json(metadata.TAG_RUN_INFO, 0, info)

    def estimate(self, estimate: Mapping[str, Any]) -> None:
        """``memory_hierarchy/estimate`` at step 0 (one optimizer's predicted bytes)."""
        self._writer.json(metadata.TAG_ESTIMATE, 0, dict(estimate))

    def step(self, stats: StepStats) -> None:
        """Queue one StepStats record for the background writer (never blocks; written
        within ``emitter.DEFAULT_MAX_DELAY`` seconds, or at :meth:`flush`/:meth:`close`)."""
        self._emitter.submit(stats)

    def config_event(self, step: int, outcome: Mapping[str, Any]) -> None:
        """``memory_hierarchy/config_event`` at ``step`` (one live-tuning decision); flushed."""
        self._writer.json(metadata.TAG_CONFIG_EVENT, step, dict(outcome))
        self._writer.flush()

    def checkpoint(self, record: Mapping[str, Any]) -> None:
        """One checkpoint save or restore at ``record["step"]``, under the tag its
        ``record["op"]`` names (:data:`tb_plugin.metadata.CHECKPOINT_OP_TAGS`); flushed.

        Raises:
            ValueError: ``record["op"]`` is neither ``"save"`` nor ``"restore"``.
            TypeError: ``record`` is not JSON-serialisable.
        """
        tag = metadata.CHECKPOINT_OP_TAGS.get(record.get("op"))
        if tag is None:
            raise ValueError(
                f"checkpoint record op {record.get('op')!r} is not one of "
                f"{sorted(metadata.CHECKPOINT_OP_TAGS)}"
            )
        self._writer.json(tag, int(record["step"]), dict(record))
        self._writer.flush()

    def oom(self, step: int, report: Mapping[str, Any]) -> None:
        """``memory_hierarchy/oom`` at ``step`` (the post-mortem, docs/oom.md); flushed."""
        self._writer.json(metadata.TAG_OOM, step, dict(report), report["wall_time"])
        self._writer.flush()

    def flush(self) -> None:
        """Write everything queued to disk (waits for the background writer first)."""
        self._emitter.drain()
        self._writer.flush()

    def close(self) -> None:
        """Write every record handed over, then close the writer; idempotent."""
        self._emitter.close()
        self._writer.close()

    def _write_step(self, stats: StepStats) -> None:
        w = self._writer
        tiers = {name: t.as_dict() for name, t in stats.tiers.items()}
        vectors = {
            metadata.TAG_READINGS: stats.readings.as_dict(),
            metadata.TAG_TIMING: stats.timing,
            metadata.TAG_PAGES: stats.pages,
            metadata.TAG_STEP_INFO: stats.step_info(),
        }
        if stats.collectives:
            vectors[metadata.TAG_COLLECTIVES] = stats.collectives
        # One event per record: the tensors, and the headline figures again as standard
        # scalars (``zero/...``) for other readers.
        w.record(
            stats.step,
            matrices={metadata.TAG_TIERS: tiers},
            vectors=vectors,
            scalars=metadata.headline_scalars(tiers, stats.pages, stats.timing),
            wall_time=stats.wall_time,
            hold=True,  # handed over with the batch (BackgroundEmitter's after_batch)
        )
        placement = self._placement()
        if placement != self._last_placement:  # first step and whenever it changes
            w.json(metadata.TAG_PLACEMENT, stats.step, placement, stats.wall_time)
            self._last_placement = placement
