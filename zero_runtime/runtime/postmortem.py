"""The OOM post-mortem at runtime: the budget checks, and the report of a failure built
from explicit inputs and written once.

The report's contract, the error types and the advice rules are :mod:`zero_runtime.oom`;
this module gathers what they need at the moment of a failure (a
:class:`FailureContext` the coordinator builds: the failed step's accounting, the flight
recorder's recent steps, the config and its history) plus the machine's facts (physical
and free memory, free disk), and writes the result as the ``memory_hierarchy/oom``
summary and ``<run_dir>/memory_hierarchy_oom.json``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from zero_runtime import oom
from zero_runtime.capabilities import IMPLEMENTED
from zero_runtime.config import ZeroConfig
from zero_runtime.devices import DeviceInfo
from zero_runtime.runtime import advice as advice_mod
from zero_runtime.runtime import headroom
from zero_runtime.runtime.advice import fmt_bytes as oom_fmt
from zero_runtime.telemetry import StepStats
from zero_runtime.telemetry.probes import host_available_bytes

log = logging.getLogger(__name__)

_HOLDER_LABELS = {
    "param": "parameters (local replicas)",
    "grad": "gradients (local replicas)",
    "optimizer": "optimizer states",
    "other": "scratch buffers (the stores' tiles) and other runtime buffers",
}


def _device_source(ctx: FailureContext) -> str:
    """What the device tier's checked figure is (``oom.CHECKED_SOURCES``), as
    ``Accounting.device_used_bytes`` chooses it: the stage-3 pools' pages, else
    TensorFlow's allocator reading, else the runtime's accounting."""
    if ctx.facts is not None and ctx.facts.units:
        return "pool"
    if math.isfinite(ctx.snapshot.readings.framework_device_bytes):
        return "allocator"
    return "accounting"


@dataclasses.dataclass(frozen=True)
class FailureContext:
    """What the runtime knew when a step failed.

    Attributes:
        snapshot: the failed step's record (tiers, readings), taken at the failure.
        recent: the flight recorder's recent records, oldest first.
        config: the active config; config_version: its version (0 = as started).
        config_history: the live-tuning decisions so far (``ControlOutcome.to_dict()``).
        facts: the model's figures for the advice's replay (an
            :class:`zero_runtime.runtime.advice.Evidence` without the recorded figures, which
            :func:`advice_for` adds from ``snapshot`` and ``recent``); None: unknown.
    """

    snapshot: StepStats
    recent: list[StepStats]
    config: ZeroConfig
    config_version: int
    config_history: list[dict[str, Any]]
    facts: advice_mod.Evidence | None = None


def check_budgets(
    step: int,
    device_budget_bytes: int | None,
    device_used_bytes: Callable[[], float],
    host_margin_bytes: int,
) -> oom.OutOfMemoryError | None:
    """The error for a tier over its limit at a step boundary, or None.

    Args:
        step: the step that just ended.
        device_budget_bytes: the device budget (None: unbounded; ``device_used_bytes`` is
            then not called).
        device_used_bytes: returns the device tier's bytes in use.
        host_margin_bytes: host memory that must stay available, bytes.

    Returns:
        :class:`oom.DeviceBudgetExceededError` (used > budget) or
        :class:`oom.HostMemoryLowError` (available < margin), not yet raised; else None.
    """
    if device_budget_bytes is not None:
        used = device_used_bytes()
        if used > device_budget_bytes:
            return oom.DeviceBudgetExceededError(int(used), device_budget_bytes, step)
    available = host_available_bytes()
    if available < host_margin_bytes:
        return oom.HostMemoryLowError(available, host_margin_bytes, step)
    return None


def as_oom_error(exc: BaseException) -> oom.OutOfMemoryError:
    """The runtime's error for a caught ``exc`` (e.g. TensorFlow's
    ``ResourceExhaustedError``): its message, and the failed tier the error names
    (runtime errors, pool snapshots), else 'device' (TensorFlow's allocator serves the
    device tier)."""
    tier = getattr(exc, "tier", None)
    snapshot = getattr(exc, "snapshot", None)
    if tier is None:
        tier = snapshot.request_tier if snapshot is not None else "device"
    return oom.OutOfMemoryError(str(exc), tier)


class PostMortem:
    """Builds and writes the OOM post-mortem of one runtime.

    Args:
        logdir: the run directory for the JSON file, or None (the report is then only in
            the exception).
        device: the local devices (is the device tier a stand-in for host memory?).
        num_replicas: replicas in sync (N_d, for the advice's per-stage formulas).
        publish: writes the report as a summary, ``(step, report) -> None``; None for none.

    Attributes:
        path: the JSON file written last, or None.
        report: the report written last, or None.
    """

    def __init__(
        self,
        logdir: str | None,
        device: DeviceInfo,
        num_replicas: int,
        publish: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
        self.logdir = logdir
        self.device = device
        self.num_replicas = num_replicas
        self._publish = publish
        self.path: str | None = None
        self.report: dict[str, Any] | None = None

    def written_for(self, exc: BaseException) -> str | None:
        """The path of the post-mortem already written for ``exc`` (ours, or TensorFlow's
        re-raise of ours, whose message names the file), else None."""
        known = getattr(exc, "postmortem_path", None)
        if known is not None:
            return known
        if self.path is not None and self.path in str(exc):
            return self.path
        return None

    def fail(
        self,
        err: oom.OutOfMemoryError,
        step: int,
        cause: BaseException,
        context: Callable[[], FailureContext],
    ) -> oom.OutOfMemoryError:
        """Build and write the post-mortem of ``err``; return ``err`` (path and report
        attached) for the caller to raise.

        Args:
            err: the runtime's error, naming the failed tier.
            step: the failed step.
            cause: the original error (a pool snapshot or a TensorFlow message), or ``err``.
            context: builds the :class:`FailureContext`; called once, inside the guard (a
                failure to build the report is logged, never raised over the OOM).
        """
        try:
            report = build_report(err, step, cause, context(), self.device, self.num_replicas)
        except Exception as exc:  # noqa: BLE001 - never hide the OOM behind a report bug
            log.exception("could not build the OOM post-mortem: %s", exc)
            return err
        if self._publish is not None:
            self._publish(step, report)
        path = None
        if self.logdir:
            path = os.path.join(self.logdir, oom.OOM_FILENAME)
            oom.write_json_atomic(path, report)
        self.path, self.report = path, report
        err.attach(path, report)
        # INFO, not ERROR: the raised error's message already names the file, so a log
        # line at a visible level would print the path twice.
        log.info("out of memory at step %d on tier %s; post-mortem: %s", step, err.tier, path)
        return err


def build_report(
    err: oom.OutOfMemoryError,
    step: int,
    cause: BaseException,
    ctx: FailureContext,
    device: DeviceInfo,
    num_replicas: int,
) -> dict[str, Any]:
    """The post-mortem object (``oom.build_report``) of one failure.

    The tiers and holders come from ``ctx.snapshot``, replaced tensor by tensor by the
    pool's own snapshot when ``cause`` is a ``PoolOutOfMemoryError``; the request's bytes
    from the pool's snapshot or the TensorFlow message; the advice from
    :func:`advice_for`.
    """
    snap = ctx.snapshot
    device_source = _device_source(ctx)
    tiers: dict[str, dict[str, Any]] = {}
    for name, t in snap.tiers.items():
        # The device tier's "other" is the reading beyond the holders: tier_row adds it
        # back as the unattributed holder (one accounting: used = the holders' sum).
        kinds = ("param", "grad", "optimizer") + (() if name == "device" else ("other",))
        holders = [
            oom.holder(_HOLDER_LABELS[k], k, getattr(t, f"{k}_bytes"))
            for k in kinds
            if math.isfinite(getattr(t, f"{k}_bytes")) and getattr(t, f"{k}_bytes") > 0
        ]
        checked = or_none(t.used_bytes)
        tiers[name] = oom.tier_row(
            or_none(t.capacity_bytes),
            holders,
            checked,
            device_source if name == "device" else "accounting",
        )
    pool_snap = getattr(cause, "snapshot", None)
    request_bytes = tensor = None
    if pool_snap is not None:  # the pool's own tiers, tensor by tensor
        for name, t in pool_snap.tiers.items():
            tiers[name] = oom.tier_row(
                t["capacity_bytes"],
                [
                    oom.holder(h.tensor_id, h.kind, h.bytes, h.pages)
                    for h in pool_snap.holders.get(name, ())
                ],
                t["used_bytes"],
                "pool",
            )
        request_bytes = pool_snap.request_bytes
        tensor = oom.display_name(pool_snap.request_tensor_id)
    elif isinstance(err, oom.DeviceBudgetExceededError):
        row = tiers["device"]
        base = [h for h in row["holders"] if h["name"] != oom.UNATTRIBUTED]
        tiers["device"] = oom.tier_row(row["capacity_bytes"], base, err.used_bytes, device_source)
    else:
        request_bytes = oom.request_from_message(str(cause))
        peak = snap.readings.framework_device_peak_bytes
        if err.tier == "device" and device_source == "allocator" and math.isfinite(peak):
            # TensorFlow's allocator refused a request: the figure it failed at is its
            # in-step high-water mark, not the bytes left in use once the step unwound.
            row = tiers["device"]
            base = [h for h in row["holders"] if h["name"] != oom.UNATTRIBUTED]
            tiers["device"] = oom.tier_row(row["capacity_bytes"], base, int(peak), "allocator_peak")
    tier = err.tier
    failed = {
        "bytes": request_bytes,
        "tier": tier,
        "tensor": tensor,
        "op": getattr(cause, "op", None) and getattr(cause.op, "name", None),
        "error_type": type(cause).__name__,
        "message": oom.short_message(str(cause)),
    }
    t = tiers[tier]
    used = int(t["used_bytes"] or 0) + int(request_bytes or 0)
    evidence = evidence_for(tier, ctx, in_step=not isinstance(err, oom.DeviceBudgetExceededError))
    row = t
    if isinstance(err, oom.HostMemoryLowError):
        # The machine's available memory, not a budget, ran out: no budget raise or
        # capacity figure applies (every change is then at most "may fit").
        row = {**t, "capacity_bytes": None}
    advice = advice_for(tier, used, row, snap, ctx.config, device, num_replicas, evidence)
    if isinstance(err, oom.HostMemoryLowError):
        cause = (
            f"the machine's available memory ({oom_fmt(err.available_bytes)}) fell below "
            f"the runtime's margin of {oom_fmt(err.margin_bytes)}"
        )
    else:
        kinds: dict[str, int] = {}
        for h in t["holders"]:
            kinds[h["kind"]] = kinds.get(h["kind"], 0) + int(h["bytes"])
        cause = advice_mod.diagnose(tier, or_none(t["capacity_bytes"]), used, kinds, evidence)
        if pool_snap is not None and pool_snap.reason:
            # The pool knows why it could not place the page (a full disk, a placement
            # that thrashes, a tier full down to NVMe): said beside the holders.
            cause += f" (the pool: {pool_snap.reason})"
    return oom.build_report(
        step=step,
        failed=failed,
        tiers=tiers,
        recent_steps=[
            {
                "step": r.step,
                "tiers": {
                    n: {
                        "used_bytes": or_none(ts.used_bytes),
                        "capacity_bytes": or_none(ts.capacity_bytes),
                    }
                    for n, ts in r.tiers.items()
                },
            }
            for r in ctx.recent
        ],
        config=ctx.config.to_dict(),
        config_version=ctx.config_version,
        config_history=ctx.config_history,
        readings=snap.readings.as_dict(),
        advice=advice,
        cause=cause,
    )


def _holder_bytes(snap: StepStats, tier: str) -> dict[str, int]:
    stats = snap.tiers[tier]
    return {
        k: int(getattr(stats, f"{k}_bytes"))
        for k in ("param", "grad", "optimizer")
        if math.isfinite(getattr(stats, f"{k}_bytes"))
    }


def evidence_for(tier: str, ctx: FailureContext, in_step: bool) -> advice_mod.Evidence:
    """The advice's :class:`~zero_runtime.runtime.advice.Evidence`: ``ctx.facts`` plus the failed
    tier's checked bytes and in-step peaks of the recorded steps (the flight recorder's,
    then the failure's snapshot)."""
    used, peaks = advice_mod.recent_figures([*ctx.recent, ctx.snapshot], tier)
    facts = ctx.facts or advice_mod.Evidence()
    allocator = (
        tier == "device"
        and math.isfinite(ctx.snapshot.readings.framework_device_bytes)
        and not facts.units
    )
    return dataclasses.replace(
        facts,
        recent_used=used,
        recent_peaks=peaks,
        allocator=bool(allocator),
        in_step=in_step,
    )


def advice_for(
    tier: str,
    required: int,
    tier_row: Mapping[str, Any],
    snap: StepStats,
    config: ZeroConfig,
    device: DeviceInfo,
    num_replicas: int,
    evidence: advice_mod.Evidence | None = None,
) -> list[dict[str, Any]]:
    """Ranked advice (``advice.advise``) for a failure on ``tier`` needing ``required`` bytes.

    Args:
        tier: the failed tier.
        required: bytes it needed (used plus the failed request).
        tier_row: the report's row of the tier (``capacity_bytes``, ``used_bytes``).
        snap: the failed step's record (holders by kind; the host tier's use; NVML total).
        config: the active config.
        device: the local devices (a CPU stand-in's physical memory is the host's).
        num_replicas: replicas in sync (N_d).
        evidence: the recorded figures for the replay (:func:`evidence_for`).
    """
    holders = _holder_bytes(snap, tier)
    vm = psutil.virtual_memory()
    nvme_free = None
    if config.nvme_path and os.path.isdir(config.nvme_path):
        nvme_free = shutil.disk_usage(config.nvme_path).free
    nvml_total = snap.readings.nvml_total_bytes
    device_physical = int(vm.total) if device.is_standin else or_none(nvml_total)
    # The allocator's own limit when one is known (the CPU stand-in's cap,
    # TF_CPU_BFC_MEM_LIMIT_IN_MB): a budget raised past it cannot fit.
    device_physical = headroom.device_capacity_bytes(device) or device_physical
    host_used = snap.tiers["host"].used_bytes
    host_cap = config.host_budget_bytes
    # Host room: within the host budget (if any) and what the machine has available.
    host_free = int(vm.available)
    if host_cap is not None and math.isfinite(host_used):
        host_free = min(host_free, int(host_cap - host_used))
    return advice_mod.advise(
        failed_tier=tier,
        required_bytes=int(required),
        capacity_bytes=or_none(tier_row["capacity_bytes"]),
        holders=holders,
        config=config,
        num_replicas=num_replicas,
        physical_bytes={
            "device": device_physical,
            "host": int(vm.total),
            "nvme": None if nvme_free is None else nvme_free + int(tier_row["used_bytes"] or 0),
        },
        free_bytes={"host": host_free, "nvme": nvme_free},
        implemented=set(IMPLEMENTED),
        evidence=evidence,
    )


def plan_stage3(
    optimizer: Any, config: ZeroConfig, num_replicas: int
) -> advice_mod.Stage3Plan | None:
    """What ZeRO-Infinity would need for the model ``optimizer`` trains (stages 0-2), for
    the advice's stage-3 candidate; call while Keras builds the optimizer (its model is
    found on the call stack, ``zero_runtime.stage3.autoshard.find_trainer``).

    Args:
        optimizer: the optimizer being built.
        config: the active config (page size, persistence threshold, prefetch size).
        num_replicas: replicas in sync (N_d).

    Returns:
        The estimator's per-replica figures (``estimate_for_model`` at stage 3 with both
        offloads ``cpu``, page-rounded), or None when the model is not found or the
        estimator cannot count it (a failure here never stops training).
    """
    try:
        from zero_runtime import estimator
        from zero_runtime.stage3.autoshard import find_trainer

        model = find_trainer(optimizer)
        if model is None:
            return None
        target = config.replace(stage=3, offload_param="cpu", offload_optimizer="cpu")
        est = estimator.estimate_for_model(model, target, num_replicas, page_rounding=True)
    except Exception as exc:  # noqa: BLE001 - advice only; the run goes on without it
        log.debug("no stage-3 plan for the OOM advice: %s", exc)
        return None
    persistent = est.tiers.to_dict()["breakdown"].get("persistent_params", {}).get("bytes", 0)
    return advice_mod.Stage3Plan(
        device_bytes=int(est.working_set_bytes) + int(persistent),
        host_bytes=int(est.tiers.host_bytes),
        largest_unit=est.largest_block_name,
    )


def model_facts(acct: Any, config: ZeroConfig) -> advice_mod.Evidence:
    """The model's figures for the advice's replay, from the runtime's accounting.

    Args:
        acct: the runtime's :class:`~zero_runtime.runtime.accounting.Accounting`
            (optimizers, live stage-3 engines, local replicas).
        config: the active config (``page_size_bytes``).

    Returns:
        An :class:`~zero_runtime.runtime.advice.Evidence` with ``num_params`` (Ψ, trainable
        elements), ``local_replicas``, ``optimizer`` and, at stage 3, the units (each
        unit's gathered bytes: ``N * shard_elements`` float32 per variable rounded up to
        pages), ``shard_bytes`` and ``persistent_bytes`` (0: the units path keeps no
        parameter gathered between uses).
    """
    from zero_runtime import estimator

    page = int(config.page_size_bytes)

    def pages(nbytes: int) -> int:
        return -(-int(nbytes) // page) * page

    units, shard_bytes, persistent_bytes, stage3_params = [], 0, 0, 0
    for engine in acct.live_stage3_engines():
        seen: set[int] = set()  # a tied original counts once in the model's figures
        for unit in engine.runner.units:
            gathered = elements = 0
            for v in unit.variables:
                gathered += pages(4 * v.num_shards * v.shard_elements)
                elements += int(math.prod(v.shape))
                if id(v) not in seen:
                    seen.add(id(v))
                    stage3_params += int(math.prod(v.shape))
                    shard_bytes += pages(4 * v.shard_elements)
            if gathered:
                units.append(advice_mod.Unit(unit.layer.name, gathered, elements))
    kind = "adam"
    if acct.optimizers:
        kind = estimator.state_kind(acct.optimizers[0])
    num_params = max(acct.model_param_bytes() // 4, stage3_params) or None
    return advice_mod.Evidence(
        num_params=num_params,
        local_replicas=int(acct.local_replicas),
        units=tuple(units),
        shard_bytes=shard_bytes,
        persistent_bytes=persistent_bytes,
        optimizer=kind,
        stage3_plan=acct.stage3_plan,
    )


def or_none(value: float | None) -> int | None:
    """An int, or None for None / NaN (the post-mortem's "unknown")."""
    if value is None or not math.isfinite(value):
        return None
    return int(value)
