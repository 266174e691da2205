"""Accounting and placement: who holds how many bytes on which tier, and where each
variable's parameter, gradient and optimizer state live.

The figures come from the objects that own the memory, registered here by the
coordinator: the partitioned optimizers (their state stores, stages 1-3) and the stage-3
engines (their paged pools). Nothing here is measured by the framework; the readings
(``zero_runtime.telemetry.probes``) are shown beside these figures, never mixed in.
Everything is bytes.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from tb_plugin import metadata
from zero_runtime import estimator
from zero_runtime.config import ZeroConfig, physical_memory_bytes
from zero_runtime.devices import DeviceInfo, framework_memory_bytes
from zero_runtime.telemetry import COLLECTIVE_KINDS, Readings, TierStats, collective_bytes

#: ``offload_optimizer`` -> the tier the optimizer states live on.
OPTIMIZER_TIER = {"none": "device", "cpu": "host", "nvme": "nvme"}


class Accounting:
    """The runtime's byte accounting over the registered optimizers and stage-3 engines.

    Args:
        device: the local devices; ``len(device.devices)`` replicas run in this process.

    Attributes:
        optimizers: the registered partitioned optimizers (``zero_state`` holds the layout,
            stage, store and accumulators).
        stage3_engines: the registered :class:`~zero_runtime.stage3.Stage3Engine` objects.
        stage3_plan: at stages 0-2, what ZeRO-Infinity would need for the trained model
            (``runtime.postmortem.plan_stage3``, for the OOM advice); None when unknown.
    """

    def __init__(self, device: DeviceInfo) -> None:
        self.device = device
        self.optimizers: list[Any] = []
        self.stage3_engines: list[Any] = []
        self.stage3_plan: Any = None
        self._lock = threading.Lock()
        self._host_peak = 0  # bytes: the host tier's peak since the last record
        self._stage3_rows: list[dict[str, Any]] = []  # placement rows of the last record
        # Per-step figures that change only with the optimizers (recomputed on a key change).
        self._collectives_key: tuple | None = None
        self._collectives: dict[str, float] = {}
        self._rows_key: tuple | None = None
        self._rows: list[dict[str, Any]] = []

    @property
    def local_replicas(self) -> int:
        """Replicas that run in this process."""
        return len(self.device.devices)

    # -- registration --------------------------------------------------------------------
    def add_optimizer(self, optimizer: Any) -> None:
        """Count ``optimizer``'s parameters, gradients and state store from now on.

        An optimizer registered before over any of the same variables (the model's
        previous optimizer: Keras's recompile with a new one, a fine-tuning phase) is no
        longer counted: the placement rows, the tiers and the step's collectives describe
        the optimizers that train the variables now. Optimizers over disjoint variables
        (a GAN's two) are all counted."""
        held = _variable_ids(optimizer)
        with self._lock:
            self.optimizers = [o for o in self.optimizers if not _variable_ids(o) & held]
            self.optimizers.append(optimizer)

    def add_stage3_engine(self, engine: Any) -> None:
        """Take the stage-3 tiers, page counters and placement rows from ``engine``'s pool."""
        with self._lock:
            self.stage3_engines.append(engine)

    def live_stage3_engines(self) -> list[Any]:
        """The registered stage-3 engines whose pool is still open."""
        return [e for e in self.stage3_engines if not e.pool.closed]

    def reduce_scatter_impl(self) -> str | None:
        """How stage 2 reduce-scatters gradients: the implementation the first registered
        optimizer's collective group runs (``CollectiveGroup.impl_used``: 'nccl',
        'all_to_all', or 'all_reduce', also after a fallback), or None without one."""
        groups = [o.zero_state.group for o in self.optimizers if o.zero_state.stage == 2]
        return next((g.impl_used for g in groups if g is not None), None)

    def close_stores(self) -> None:
        """Close every optimizer's state store (e.g. the NVMe pool's files)."""
        for opt in self.optimizers:
            opt.zero_state.store.close()

    # -- bytes ---------------------------------------------------------------------------
    def model_param_bytes(self) -> int:
        """Bytes of one replica's trainable variables tracked by the optimizers (fp32)."""
        return sum(4 * opt.flat_layout.total for opt in self.optimizers)

    def state_bytes_on(self, tier: str) -> tuple[int, int]:
        """(optimizer-state bytes, other bytes) the optimizers' stores hold on ``tier``."""
        return self._state_bytes().get(tier, (0, 0))

    def _state_bytes(self) -> dict[str, tuple[int, int]]:
        """Tier -> (optimizer-state bytes, other bytes) over the optimizers' stores, each
        store asked once."""
        out: dict[str, tuple[int, int]] = {}
        for opt in self.optimizers:
            for tier, (s, o) in opt.zero_state.store.usage().items():
                state, other = out.get(tier, (0, 0))
                out[tier] = (state + s, other + o)
        return out

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
        in_backward = [e for e in self.live_stage3_engines() if e.update_in_backward]
        for opt in self.optimizers:
            zs = opt.zero_state
            if zs.accumulators:
                total += zs.accumulator_bytes
                continue
            if zs.stage == 0:  # mirrored: every replica's full gradient
                per = zs.layout.total
            else:
                per = zs.layout.shard_size if zs.stage >= 2 else zs.layout.padded_total
            if zs.stage == 3 and in_backward:
                per = max(e.max_block_shard_elements for e in in_backward)
            total += 4 * per * self.local_replicas
        return total

    def device_used_bytes(self) -> float:
        """Device-tier bytes in use: the framework's reading, else this accounting
        (parameters, gradients and device optimizer states of the local replicas). At
        stage 3, the stage-3 pools' device pages (the pool enforces the budget itself)."""
        engines = self.live_stage3_engines()
        if engines:
            return float(sum(e.pool.usage()["device"].used_bytes for e in engines))
        current, _ = framework_memory_bytes(self.device)
        if math.isfinite(current):
            return current
        return float(
            self.model_param_bytes() * self.local_replicas
            + self.grad_bytes()
            + self.state_bytes_on("device")[0]
        )

    def has_runtime_io(self) -> bool:
        """True when an optimizer's store pages through a pool (NVMe I/O the runtime drives)."""
        return any(hasattr(o.zero_state.store, "pool") for o in self.optimizers)

    def collectives(self) -> dict[str, float]:
        """``<kind>_bytes`` / ``<kind>_calls`` of one step: summed over the optimizers at
        stages 0-2; at stage 3 what the engines' traced step issues (its per-use
        all-gathers and reduce-scatters, by their real dtype: ``CollectiveGroup.step_tally``;
        the stage-3 optimizer updates local shards and adds no collective).

        The optimizers' sum is computed again only when an input changed (the optimizers,
        their layouts, stages, accumulation steps, or a stage-2 group's implementation
        after a fallback); a new dict each call (records keep it)."""
        engines = self.live_stage3_engines()
        if engines:
            out = {f"{k}_{u}": 0.0 for k in COLLECTIVE_KINDS for u in ("bytes", "calls")}
            for e in engines:
                for k, v in e.group.step_tally.items():
                    out[k] = out.get(k, 0.0) + v
            return out
        key = tuple(
            (
                id(zs),
                id(zs.layout),
                zs.stage,
                zs.accumulation_steps,
                getattr(zs.group, "impl_used", None),
            )
            for zs in (opt.zero_state for opt in self.optimizers)
        )
        if key != self._collectives_key:
            out = {}
            for opt in self.optimizers:
                for k, v in collective_bytes(opt.zero_state, self.local_replicas).items():
                    out[k] = out.get(k, 0.0) + v
            self._collectives, self._collectives_key = out, key
        return dict(self._collectives)

    # -- one step's record -----------------------------------------------------------------
    def close_step(
        self, step: int, readings: Readings, config: ZeroConfig
    ) -> tuple[dict[str, TierStats], dict[str, float]]:
        """The tiers and page counters of the step that just ended, and start the next.

        Consumes the step's counters: the host peak restarts at the current use, the
        stores' page counters and the stage-3 pools' step records are closed (their
        placement rows are kept for :meth:`placement`).

        Args:
            step: the step that ended.
            readings: the framework's device figures (``used`` and ``peak``) at its end.
            config: the active config (budgets, ``offload_optimizer``).

        Returns:
            ``({"device"|"host"|"nvme": TierStats}, {PAGE_COLUMNS name: value})``.
        """
        param_bytes = float(self.model_param_bytes() * self.local_replicas)
        grad_bytes = float(self.grad_bytes())
        by_tier = self._state_bytes()
        device_opt, _ = by_tier.get("device", (0, 0))
        used = readings.framework_device_bytes
        attributed = param_bytes + grad_bytes + device_opt
        device = TierStats(
            used_bytes=used,
            capacity_bytes=_or_nan(config.device_budget_bytes),
            peak_bytes=readings.framework_device_peak_bytes,
            param_bytes=param_bytes,
            grad_bytes=grad_bytes,
            optimizer_bytes=float(device_opt),
            other_bytes=max(0.0, used - attributed) if math.isfinite(used) else math.nan,
        )
        state, scratch = by_tier.get("host", (0, 0))
        host_used = float(state + scratch)
        self._host_peak = max(self._host_peak, int(host_used))
        host = TierStats(
            used_bytes=host_used,
            capacity_bytes=float(config.host_budget_bytes or physical_memory_bytes()),
            peak_bytes=float(self._host_peak),
            param_bytes=0.0,
            grad_bytes=0.0,
            optimizer_bytes=float(state),
            other_bytes=float(scratch),
        )
        self._host_peak = int(host_used)
        nvme_state, _ = by_tier.get("nvme", (0, 0))
        nvme = TierStats(
            used_bytes=float(nvme_state),
            capacity_bytes=_or_nan(config.nvme_budget_bytes),
            peak_bytes=float(nvme_state),
            param_bytes=0.0,
            grad_bytes=0.0,
            optimizer_bytes=float(nvme_state),
            other_bytes=0.0,
        )
        pages = self._page_counters(step)
        tiers = {"device": device, "host": host, "nvme": nvme}
        engines = self.live_stage3_engines()
        if engines:
            tiers = self._stage3_close(step, engines, tiers, pages, config)
        return tiers, pages

    def _page_counters(self, step: int) -> dict[str, float]:
        pages: dict[str, float] = {}
        for opt in self.optimizers:
            boundary = getattr(opt.zero_state.store, "step_boundary", None)
            if boundary is None:
                continue
            for name, value in zip(metadata.PAGE_COLUMNS, boundary(step).as_row()):
                pages[name] = pages.get(name, 0.0) + value
        return pages

    def _stage3_close(
        self,
        step: int,
        engines: list[Any],
        tiers: dict[str, TierStats],
        pages: dict[str, float],
        config: ZeroConfig,
    ) -> dict[str, TierStats]:
        """Close the stage-3 pools' step: their page counters are added to ``pages``,
        their placement rows kept for :meth:`placement`, and the tiers rebuilt from their
        accounting (:func:`zero_runtime.stage3.telemetry.stage3_tiers`), with the
        engines' frozen weights on the device tier."""
        from zero_runtime.stage3.telemetry import stage3_tiers  # lazy: stage 3 only

        records = [e.close_step(step) for e in engines]
        for record in records:
            for name, value in zip(metadata.PAGE_COLUMNS, record.counters.as_row()):
                pages[name] = pages.get(name, 0.0) + value
        opt_tier = OPTIMIZER_TIER[config.offload_optimizer]
        self._stage3_rows = [row for e in engines for row in e.placement_rows(opt_tier)]
        # Frozen weights are replicated on each local replica's device, outside the pool.
        frozen = sum(e.frozen_bytes for e in engines) * self.local_replicas
        return stage3_tiers(tiers, records, float(self.grad_bytes()), float(frozen))

    # -- placement -----------------------------------------------------------------------
    def placement(self, offload_optimizer: str, copy: bool = True) -> dict[str, Any]:
        """Where every trainable variable's parameter, gradient and optimizer state live.

        Args:
            offload_optimizer: the active config's ``offload_optimizer``.
            copy: True (default): every row is a new dict the caller may change. False:
                the stage 0-2 rows are the dicts cached since their inputs last changed
                (the optimizers, their stages, layouts and offload ratio), shared between
                calls and not to be modified; the per-step summary writer compares them
                with the last written placement without rebuilding them.

        Returns:
            ``{"variables": [{"name", "shape", "dtype", "bytes", "partitioning",
            "shard_bytes_per_replica", "param_tier", "grad_tier", "optimizer_tier"}]}``
            with bytes as ints; with partial offload (``offload_optimizer_ratio`` < 1) a
            row also has ``"optimizer_host_fraction"`` (the ratio: that fraction of each
            shard's states is on ``optimizer_tier``, the rest on the device). Stage-3
            variables come from the engines' pools as of the last step record
            (``Stage3Engine.placement_rows``). An optimizer with Keras's ``use_ema`` adds
            one row per variable for its average, ``"<name> (EMA average)"``
            (``zero_runtime.optim.ema.ShardEma.zero_ema_rows``).
        """
        key = (offload_optimizer,) + tuple(
            (id(zs), id(zs.layout), zs.stage, _offload_ratio(zs))
            for zs in (opt.zero_state for opt in self.optimizers)
        )
        if key != self._rows_key:
            self._rows, self._rows_key = self._optimizer_rows(offload_optimizer), key
        rows = [dict(r) for r in self._rows] if copy else list(self._rows)
        rows.extend(self._stage3_rows)
        return {"variables": rows}

    def _optimizer_rows(self, offload_optimizer: str) -> list[dict[str, Any]]:
        """The placement rows of the stage 0-2 optimizers' variables (:meth:`placement`)."""
        rows = []
        opt_tier = OPTIMIZER_TIER[offload_optimizer]
        for opt in self.optimizers:
            zs = opt.zero_state
            ema_rows = getattr(opt, "zero_ema_rows", None)  # use_ema's averages (optim/ema.py)
            if ema_rows is not None:
                rows.extend(ema_rows(opt_tier))
            if zs.stage >= 3:  # rows from the stage-3 engines' pools (placement)
                continue
            layout = zs.layout
            n = layout.num_shards
            if zs.stage == 0:
                text = "replicated (data parallel, no ZeRO partitioning)"
            elif zs.stage >= 2:
                text = f"optimizer state and gradient sharded 1/{n} (ZeRO-2); parameter replicated"
            else:
                text = f"optimizer state sharded 1/{n} (ZeRO-1); parameter and gradient replicated"
            ratio = _offload_ratio(zs)
            extra = {"optimizer_host_fraction": ratio} if ratio < 1.0 else {}
            for name, shape, size in zip(layout.names, layout.shapes, layout.sizes):
                rows.append(
                    extra
                    | {
                        "name": name,
                        "shape": list(shape),
                        "dtype": "float32",
                        "bytes": 4 * size,
                        "partitioning": text,
                        "shard_bytes_per_replica": 4 * size if zs.stage == 0 else 4 * -(-size // n),
                        "param_tier": "device",
                        "grad_tier": "device",
                        "optimizer_tier": "device" if zs.stage == 0 else opt_tier,
                    }
                )
        return rows


def _variable_ids(optimizer: Any) -> set[int]:
    """``id`` of each variable ``optimizer`` was built over (Keras's
    ``_trainable_variables``: Keras variables at stages 0-2, ShardedVariables at 3)."""
    return {id(v) for v in getattr(optimizer, "_trainable_variables", ())}


def _offload_ratio(zero_state: Any) -> float:
    """The share of a partitioned optimizer's states on its offload tier (1.0 at stage 0)."""
    return zero_state.config.offload_optimizer_ratio if zero_state.stage > 0 else 1.0


def estimate(
    optimizer: Any, config: ZeroConfig, num_replicas: int, local_replicas: int
) -> dict[str, Any]:
    """The ZeRO estimator's prediction of model-state bytes for one optimizer's variables.

    Args:
        optimizer: a partitioned optimizer (``flat_layout.total`` parameters).
        config: the active config.
        num_replicas: replicas in sync (N_d).
        local_replicas: replicas in this process (the scope of the tier telemetry).

    Returns:
        ``{"per_replica": TierEstimate.to_dict(), "local_replicas": int,
        "per_process": {"device_bytes", "host_bytes", "nvme_bytes"}, "num_params": int,
        "precision": "fp32", "optimizer": kind, "source": str, "per_process_peak":
        {"device_bytes", "host_bytes", "nvme_bytes"}, "peak_source": str,
        "not_modelled": {tier: [str]}}`` (:func:`not_modelled`).
        ``per_process`` is the per-replica figure times ``local_replicas``.
        ``per_process_peak`` is the predicted in-step peak of model states: every replica
        holds its full fp32 gradient (4 bytes x Ψ) between the backward pass and the
        reduce-scatter. Stages 0-1 count it already (SC20: gΨ); at stage 2, which counts
        only the reduced shard, the device peak adds ``4 Ψ`` per local replica. Host and
        NVMe peaks equal their boundary figures. At stage 3 the gathered units are not
        known here and the device peak is None. Activations are not counted.
    """
    num_params = optimizer.flat_layout.total
    kind = estimator.state_kind(optimizer)
    est = estimator.estimate_for_config(
        num_params, num_replicas, config, precision="fp32", optimizer=kind
    )
    # Stages 0-1 already count the full gradient; stage 2 counts only the reduced shard.
    transient_grad = {0: 0, 1: 0, 2: 4 * num_params}.get(config.stage)
    return {
        "per_replica": est.to_dict(),
        "local_replicas": local_replicas,
        "per_process_peak": {
            "device_bytes": (
                None
                if transient_grad is None
                else (est.device_bytes + transient_grad) * local_replicas
            ),
            "host_bytes": est.host_bytes * local_replicas,
            "nvme_bytes": est.nvme_bytes * local_replicas,
        },
        "peak_source": "model states with each replica's full fp32 gradient before its "
        "reduce-scatter (stages 0-2; none at stage 3); activations not counted",
        "per_process": {
            "device_bytes": est.device_bytes * local_replicas,
            "host_bytes": est.host_bytes * local_replicas,
            "nvme_bytes": est.nvme_bytes * local_replicas,
        },
        "num_params": num_params,
        "precision": "fp32",
        "optimizer": kind,
        "source": "ZeRO (Rajbhandari et al., SC20) sections 3.1 and 5.1, zero_runtime.estimator",
        "not_modelled": not_modelled(config),
    }


def not_modelled(config: ZeroConfig) -> dict[str, list[str]]:
    """What the Ψ-only prediction of :func:`estimate` leaves out that this runtime's
    measured tiers hold, per tier (the view shows it beside "predicted vs measured").

    The estimator counts model states from Ψ alone (SC20 section 3.1, fp32 bytes per
    element divided as section 5.1 says). The paged pool (stage 3, and NVMe optimizer
    states at stages 1-2) differs from that in ways named here: page rounding (pool tensors
    take whole ``page_size_bytes`` pages; stage 3's host/NVMe parameter shards are packed,
    at most one partly filled page per replica), the host window the pool
    keeps for NVMe pages, and stage 3's update in backward (gradient shards leave the
    device block by block).

    Args:
        config: the active config.

    Returns:
        ``{"device"|"host"|"nvme": [sentence, ...]}``, only tiers with something to say.
    """
    out: dict[str, list[str]] = {}
    kib = config.page_size_bytes // 1024
    rounding = f"page rounding: paged tensors take whole pages of {kib} KiB (page_size_bytes)"
    packed = (
        f"page rounding: the parameter shards are packed into one flat space per replica "
        f"of {kib} KiB pages (page_size_bytes), at most one partly filled page per replica; "
        "each variable is padded to a multiple of the replicas along its split axis"
    )
    paged_nvme = config.offload_optimizer == "nvme" or (
        config.stage == 3 and config.offload_param == "nvme"
    )
    if config.stage == 3:
        out["device"] = [
            "gathered parameters: the paged pool holds the units in use on the device, "
            "within the budget, and frees them by the step boundary",
            "the update in backward: reduced gradient shards leave the device block by "
            "block, so fewer than Ψ/N are there at once",
        ]
        tier = {"cpu": "host", "nvme": "nvme"}.get(config.offload_param)
        if tier:
            out.setdefault(tier, []).append(packed)
    if config.offload_optimizer == "nvme":
        out.setdefault("nvme", []).append(rounding)
    if paged_nvme:
        if config.stage == 3 and config.offload_param == "nvme":
            out["nvme"].append(
                "in-step spill: when the device budget and the host window are full, the "
                "pool pages gathered buffers and cached copies down to NVMe within the "
                "step (the in-step peak), freed again by its end"
            )
        if config.host_budget_bytes is None:
            out.setdefault("host", []).append(
                "the paged pool's host window for NVMe pages: copies of the pages in use "
                "and prefetched (the two largest blocks' shards plus slack), kept full as "
                "a cache"
            )
    if config.stage == 3 and config.offload_optimizer == "cpu":
        out.setdefault("host", []).append(rounding)
    return {k: v for k, v in out.items() if v}


def _or_nan(value: int | None) -> float:
    return math.nan if value is None else float(value)
