"""The stage-3 engine: a model's parameters sharded, its units run per use (ZeRO stage 3).

Every layer of the model that owns trainable weights directly is a *unit*
(:mod:`zero_runtime.stage3.units`); its weights are replaced by
:class:`~zero_runtime.sharded_variable.ShardedVariable` objects whose shards live on the
tier ``offload_param`` selects, and its ``call`` is hooked so that each use inside a
step gathers it by one all-gather and reduce-scatters its gradient in backward
(:mod:`zero_runtime.stage3.gather`, driven by :mod:`zero_runtime.stage3.units_path`):
the model's own call runs, under ``fit``, ``train_step`` in ``strategy.run`` and a
user's own ``tf.GradientTape`` alike. An ``Embedding`` at or above
``embedding_row_paging_threshold`` elements is row-paged
(:mod:`zero_runtime.stage3.embedding`), a ``Dense``/``EinsumDense``/``Embedding`` wider
than the tile budget runs as column tiles (:mod:`zero_runtime.stage3.tiling`), and
blocks may be checkpointed (:mod:`zero_runtime.stage3.checkpointing`).

This module builds the engine (the device plan, the pool, the shards, the units path)
and owns its lifecycle, step boundaries, live config and placement rows. The device
tier's plan and its refusals are :mod:`zero_runtime.stage3.device_plan`, the default
tier budgets :mod:`zero_runtime.stage3.pool_sizing`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import keras
import numpy as np

from zero_runtime import comm
from zero_runtime.config import ZeroConfig
from zero_runtime.lifecycle import (
    ClosePhase,
    LifecycleState,
    StrategyClosedError,
    resources_of,
)
from zero_runtime.memory import (
    FlatShardSpace,
    PageCounters,
    PoolOutOfMemoryError,
    TierUsage,
)
from zero_runtime.memory.flat_store import SPACE_TIERS
from zero_runtime.sharded_variable import (
    PARAM_TIER,
    ShardedVariable,
    ShardState,
    least_padding_dim,
)
from zero_runtime.stage3 import construction, device_plan, placement, tiling
from zero_runtime.stage3 import units as units_mod
from zero_runtime.stage3.gather import UnitRunner
from zero_runtime.stage3.pool_sizing import size_pool
from zero_runtime.stage3.step_clock import OutsideStepClock
from zero_runtime.stage3.units_path import UnitsPath, replica_id

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PoolStep:
    """The stage-3 pool at the end of one step (see :meth:`Stage3Engine.close_step`).

    Attributes:
        step: the 0-based step.
        usage: ``{"device"|"host"|"nvme": TierUsage}``, bytes; ``peak_bytes`` is the
            step's peak.
        counters: the step's page moves (d2h/h2d/h2n/n2h pages and bytes), evictions,
            prefetch hits/misses, stall and I/O seconds.
        gathered_bytes: the step's gathered parameters on the device tier, outside the
            pool (:attr:`DevicePlan.gathered`: the plan's bound, not a reading), bytes.
        reserved_bytes: the device tier's capacity outside the pool (gathered and
            frozen weights: the budget minus the pool's device capacity), bytes.
    """

    step: int
    usage: dict[str, TierUsage]
    counters: PageCounters
    gathered_bytes: int = 0
    reserved_bytes: int = 0


class Stage3Engine:
    """Shards a model's parameters and runs its units per use (ZeRO stage 3).

    Any Keras model (Sequential, functional DAGs with several inputs and outputs, nested
    and subclassed models, tied weights, BatchNormalization): the model's own call with
    every layer that owns weights hooked (:attr:`runner`,
    :mod:`zero_runtime.stage3.gather`).

    Args:
        model: a built Keras model. Its trainable weights are replaced, in place, by
            :class:`ShardedVariable` objects; the original variables are dropped.
        strategy: the :class:`~zero_runtime.strategy.ZeroInfinityStrategy` (stage 3).

    Attributes:
        pool: the paged pool holding shards (tier from ``offload_param``), row-paged
            tables' row pages and their row states.
        runner: the :class:`UnitRunner` (the hooks).
        units: the :class:`~zero_runtime.stage3.units_path.UnitsPath` (shards the units,
            runs the passes).
        row_paged: ``{unit index: RowPagedEmbedding}`` of the row-paged tables.
        tile_plans: ``{id(kernel): TilePlan}`` of the tiled units.
        device_plan: the :class:`~zero_runtime.stage3.device_plan.DevicePlan`: the
            device tier a step needs (shards, frozen weights, gathered units, row caches).
        device_peaks: the pool's device-tier peak bytes of every finished step.
        default_device_budget: the device tier's capacity (bytes) when
            ``device_budget_bytes`` is None: the pool's default (device-tier shards, row
            caches and states, slack; ``pool_sizing.size_pool``) + the plan's gathered
            units and frozen weights.
        last_step: the :class:`PoolStep` of the last closed step (None before).
        clock: the :class:`~zero_runtime.stage3.step_clock.OutsideStepClock` (the step
            boundary of device-tier steps under ``fit``, reported from Python).
        state: OPEN, then CLOSED after :meth:`close` (the strategy's ``close()`` closes
            it, phase ``MODELS``: :mod:`zero_runtime.lifecycle`).

    Raises:
        ValueError: an unbuilt model, a non-float32 weight, an int
            ``device_budget_bytes`` below the step's device plan, or a unit above
            ``max_live_parameters`` that does not tile
            (:mod:`zero_runtime.stage3.device_plan`).
        NotImplementedError: a unit that draws random numbers in its own call
            (:func:`zero_runtime.stage3.units.plan_units`), a weight constraint, a tied
            row-paged table.
    """

    def __init__(self, model: keras.Model, strategy) -> None:
        if not model.built:
            raise ValueError(f"model {model.name!r} must be built before sharding")
        _refuse_constraints(model)
        config: ZeroConfig = strategy.config
        self.config = config
        self.strategy = strategy
        self.num_shards = strategy.num_replicas_in_sync
        self.devices = tuple(strategy.extended.worker_devices)
        # The replicas of this process (all of them in one process; a worker's own under
        # MultiWorkerMirroredStrategy): their shards are the only ones this pool holds.
        self.local_replicas = tuple(
            getattr(strategy, "local_replica_ids", range(len(self.devices)))
        )
        local = len(self.local_replicas)
        # Every refusal comes before anything is replaced: a refused model is unchanged.
        specs = units_mod.plan_units(model)
        self.model = model
        # Frozen (non-trainable) weights are not sharded: replicated on every replica's
        # device like MirroredStrategy's, and counted on that tier (placement_rows).
        self.frozen = tuple(v for v in model.weights if not v.trainable)
        self.device_plan = device_plan.plan_device(
            specs, config, self.num_shards, local, self.frozen_bytes
        )
        device_plan.check_max_live(specs, config, self.num_shards)
        device_plan.check_budget(self.device_plan, config, model.name)
        log.info("stage 3: model %r needs %s", model.name, self.device_plan.describe())
        self.resources = resources_of(strategy)  # the owner of the pool and host calls
        if self.resources is not None:
            self.resources.check_open(f"shard model {model.name!r}")
        self.state = LifecycleState.OPEN
        self.tier = PARAM_TIER[config.offload_param]
        self.pool, pool_default = size_pool(
            [u.layer for u in specs],
            config,
            self.tier,
            self.num_shards,
            local,
            self.device_plan.outside_pool,
        )
        self.default_device_budget = pool_default + self.device_plan.outside_pool
        # Host/NVMe shards are packed into one flat space per replica (page-sized chunks):
        # page rounding costs at most one page per replica, not a page per variable.
        self.space = (
            FlatShardSpace(self.pool, self.tier, self.local_replicas, name="params")
            if self.tier in SPACE_TIERS
            else None
        )
        if self.resources is not None:
            self.resources.adopt(self, ClosePhase.MODELS, f"stage-3 engine of {model.name!r}")
        remote = local < self.num_shards  # shards on other workers
        # Multi-worker: the group of the eager all-gather that reads a variable outside a
        # step (created here, in the same order on every worker, like every group key).
        self._worker_group = (
            comm.WorkerGroup.create(
                self.devices[0],
                self.num_shards // local,
                config.collective_timeout_seconds,
            )
            if remote
            else None
        )
        impl = getattr(strategy, "reduce_scatter_impl", None)
        if impl is None and not any("gpu" in d.lower() for d in self.devices):
            # Measured: the all_to_all reduce-scatter times out in this backward (units
            # with 3-D activations) on CPU; the all-reduce + slice path does not. Each
            # replica then holds one unit's reduced gradient transiently (see docs).
            impl = "all_reduce"
        self.group = comm.CollectiveGroup.create(
            self.devices,
            impl,
            timeout_seconds=config.collective_timeout_seconds,
        )
        self.units = UnitsPath(self, model, specs, remote)
        self.runner: UnitRunner = self.units.runner
        self.tile_plans: dict[int, tiling.TilePlan] = self.units.tile_plans
        self.row_paged = self.units.row_paged
        self._lock = threading.Lock()
        self.device_peaks: list[int] = []
        self._steps_done: dict[int, int] = {}
        # Set when a step is traced: True when units are updated during backward (the
        # gradient shard moves to the host optimizer at once; see forward_backward).
        self.update_in_backward: bool | None = None
        self.last_step: PoolStep | None = None
        self.clock = OutsideStepClock(self)  # device-tier steps' boundary, from Python
        runtime = getattr(strategy, "runtime", None)
        if runtime is not None and hasattr(runtime, "register_stage3_engine"):
            runtime.register_stage3_engine(self)  # tiers, pages, placement from this pool

    def shard_variable(self, v, remote: bool, **kwargs) -> ShardedVariable:
        """A :class:`ShardedVariable` of Keras variable ``v`` in this engine's pool (on
        its ``offload_param`` tier, over its replicas; ``remote``: other workers hold
        some replicas' shards). A deferred variable (``strategy.zero_init``) is
        initialized here, on the host, one at a time (``construction.consume``).
        Split along the axis with the least padding (:func:`least_padding_dim`): a
        ``(1, 1, C_in, C_out)`` kernel along ``C_out``, not its first axis.
        ``kwargs``: more ShardedVariable arguments (``persistent``, ``devices``)."""
        kwargs.setdefault("shard_dim", least_padding_dim(tuple(v.shape), self.num_shards))
        sharded = ShardedVariable(
            np.asarray(construction.consume(v), np.float32),
            pool=self.pool,
            num_shards=self.num_shards,
            tier=self.tier,
            name=v.name,
            path=v.path,
            local_replicas=self.local_replicas,
            gather_remote=self._gather_remote if remote else None,
            space=self.space,
            autocast=bool(getattr(v, "_autocast", True)),  # Keras keeps no public getter
            **kwargs,
        )
        # A weight regularizer (kernel_regularizer=...) stays on the variable: Keras's
        # model.losses reads it, a gathered read with a backward inside a step.
        sharded.regularizer = getattr(v, "regularizer", None)
        return sharded

    def _gather_remote(self, local: dict[int, np.ndarray]) -> np.ndarray:
        """Every replica's shard of one variable, from every worker (outside a step)."""
        return comm.gather_local_shards(local, self._worker_group)

    @property
    def max_block_shard_elements(self) -> int:
        """Elements of the largest unit's gradient shard (one replica), float32."""
        return max(u.shard_elements for u in self.runner.units)

    @property
    def min_device_budget(self) -> int:
        """Bytes a step needs on the device tier, all local replicas: the device plan's
        total (:attr:`DevicePlan.total`: device-tier shards, frozen weights,
        ``UNITS_LIVE`` gathered units, minimum row caches). An int
        ``device_budget_bytes`` below it is refused; ``device_budget_bytes='auto'``
        never goes below it."""
        return self.device_plan.total

    @property
    def variables(self) -> list[ShardedVariable]:
        """Every sharded variable, unit by unit (each once; row-paged tables excluded)."""
        return self.runner.variables

    def in_step(self) -> bool:
        """True while this engine's own traced forward runs on the current replica (its
        tape is then the step's, not a user's)."""
        return self.runner.in_step() and not self.runner.user_step()

    # -- the step (replica context) --------------------------------------------------------
    def forward_backward(self, x, loss_fn, training: bool = True, update=None):
        """Run forward and backward on this replica; return ``(y_pred, loss, grads)``
        (:meth:`~zero_runtime.stage3.units_path.UnitsPath.forward_backward`).

        Args:
            x: the replica's input batch.
            loss_fn: ``y_pred -> scalar loss`` (runs under the tape).
            training: passed to the model's call.
            update: a :class:`~zero_runtime.optim.backward_update.BackwardShardUpdate`
                for this replica, or None (default): the update during backward.

        Returns:
            ``y_pred``, the loss, and the gradients: without ``update``,
            ``{id(variable): float32 [shard_elements]}``, the replica's reduced gradient
            shard of every variable; with ``update``, a float32 scalar 0.0 that exists
            once every update is queued.

        Raises:
            RuntimeError: outside replica context or with a non-static replica id.
        """
        replica = replica_id()
        # Telemetry: the collectives this step's trace issues, counted by their real
        # dtype over the local replicas (traced one after the other).
        if replica == self.local_replicas[0]:
            self.group.start_tally()
        try:
            self.update_in_backward = update is not None
            return self.units.forward_backward(x, loss_fn, training, update)
        finally:
            if replica == self.local_replicas[-1]:
                self.group.stop_tally()

    def user_forward(self, x, training: bool = False):
        """The model's call under a user's own ``tf.GradientTape`` (a custom loop), on
        this replica: :meth:`~zero_runtime.stage3.units_path.UnitsPath.user_forward`."""
        return self.units.user_forward(x, training)

    def forward(self, x, training: bool = False):
        """Forward only on this replica (evaluate, predict): the model's own call, its
        units gathered per use."""
        return self.units.forward(x, training)

    # -- step boundaries -------------------------------------------------------------------
    def end_step(self, replica: int, step: int) -> None:
        """Called once per replica after its update; the last one closes the pool's step
        (:meth:`close_step`), unless the runtime's step record already did."""
        with self._lock:
            done = self._steps_done.get(step, 0) + 1
            if done < len(self.local_replicas):
                self._steps_done[step] = done
                return
            self._steps_done.pop(step, None)
        self.close_step(step)

    def close_step(self, step: int) -> PoolStep:
        """Close step ``step`` of the pool once; later calls for it return the same record.

        Takes the pool's usage (the step's peak included) before its
        ``step_boundary`` resets the counters and peaks, and appends the device-tier peak
        to :attr:`device_peaks`. Called by the runtime's step record (telemetry, which
        runs after the optimizer's update and before :meth:`end_step`) and by
        :meth:`end_step` for steps without a record.

        Returns:
            The :class:`PoolStep` (usage in bytes per tier, the step's page counters).
        """
        with self._lock:
            last = self.last_step
            if last is not None and last.step == step:
                return last
            usage = self.pool.usage()
            capacity = usage["device"].capacity_bytes or 0
            outside = {
                "gathered_bytes": self.device_plan.gathered,
                "reserved_bytes": max(0, self._device_budget() - capacity),
            }
            # The bytes outside the pool go with the step's trace: a what-if replay of a
            # device budget then predicts the whole device tier (memory/simulate.py).
            record = PoolStep(step, usage, self.pool.step_boundary(step, outside), **outside)
            self.device_peaks.append(usage["device"].peak_bytes)
            self.last_step = record
            return record

    def apply_config(self, config: ZeroConfig) -> None:
        """Follow a live config change (called by the runtime after an applied control
        request, at a step boundary).

        ``device_budget_bytes`` (None: the :attr:`default_device_budget`) minus what the
        step holds outside the pool (:attr:`DevicePlan.outside_pool`: gathered units,
        frozen weights) becomes the pool's device-tier capacity; shrinking moves pages
        down to the host (``PagedBufferPool.set_device_budget``). ``prefetch_bucket_size``
        applies from the next prefetch. The traced plan's keys (``tile_size``,
        ``max_live_parameters``) do not change a running job.

        A budget below the device plan (:attr:`min_device_budget`), or one the pool
        cannot shrink to now (pinned pages), is logged and not applied.
        """
        self.config = dataclasses.replace(
            self.config, prefetch_bucket_size=config.prefetch_bucket_size
        )
        budget = self._device_budget(config)
        if budget < self.device_plan.total:
            log.warning(
                "stage 3: device budget %d not applied: the step needs %s",
                budget,
                self.device_plan.describe(),
            )
            return
        pool_budget = budget - self.device_plan.outside_pool
        page = self.pool.page_size
        if pool_budget // page != self.pool.device_tier.capacity_bytes // page:
            try:
                moved = self.pool.set_device_budget(pool_budget)
            except PoolOutOfMemoryError as exc:
                log.warning("stage 3: device budget %d not applied: %s", budget, exc)
                return
            log.info("stage 3: device tier capacity %d bytes (%d pages moved)", budget, moved)
        self.config = dataclasses.replace(
            self.config, device_budget_bytes=config.device_budget_bytes
        )

    def _device_budget(self, config: ZeroConfig | None = None) -> int:
        """The device tier's capacity in bytes: ``config.device_budget_bytes`` (default
        the engine's config) when an int, else :attr:`default_device_budget`."""
        budget = (config or self.config).device_budget_bytes
        return budget if isinstance(budget, int) else self.default_device_budget

    def placement_rows(self, optimizer_tier: str) -> list[dict]:
        """One placement row per sharded variable, row-paged table and frozen weight
        (``memory_hierarchy/placement``; :func:`zero_runtime.stage3.placement.placement_rows`)."""
        return placement.placement_rows(self, optimizer_tier)

    @property
    def frozen_bytes(self) -> int:
        """Bytes of the frozen (non-trainable) weights one replica holds on its device:
        they are replicated, not sharded (``frozen``)."""
        return sum(placement.variable_nbytes(v) for v in self.frozen)

    def recover(self) -> dict[str, int]:
        """Return every local replica's variables to SHARDED/RELEASED after a failed step.

        A step aborted by an error (a collective timeout, a pool OOM in a host read, a
        failed host update) may leave a variable GATHERING or GATHERED (an on-demand
        read cut short), and the next read or a checkpoint restore would raise
        ``ShardStateError``; it also forgets the per-step counts of the aborted step. The
        shards are unchanged.

        Returns:
            ``{"gathering": n, "gathered": m}``: how many (variable, replica) pairs were
            reset from each state.
        """
        counts = {"gathering": 0, "gathered": 0}
        for v in self.variables:
            for r in self.local_replicas:
                before = v.reset(r)
                if before in (ShardState.GATHERING, ShardState.GATHERED):
                    counts[before.value] += 1
        with self._lock:
            self._steps_done.clear()
        return counts

    def check_open(self, action: str) -> None:
        """Raise :class:`~zero_runtime.lifecycle.StrategyClosedError` naming ``action``
        after :meth:`close`."""
        if self.state is not LifecycleState.OPEN:
            raise StrategyClosedError(
                f"cannot {action}: the stage-3 model was closed (ShardedModel.close() or "
                "strategy.close()) and its parameter shards are gone"
            )

    def close(self) -> None:
        """OPEN -> CLOSED: close the pool (prefetch and I/O threads stopped, pages freed,
        NVMe slab file and its descriptors removed). The model's weights are lost.
        Idempotent."""
        if self.state is LifecycleState.CLOSED:
            return
        self.state = LifecycleState.CLOSED
        runner = self.__dict__.get("runner")  # None: the units path refused the model
        if runner is not None:
            runner.remove()
        if self.space is not None:
            self.space.close()
        self.pool.close()


def _refuse_constraints(model: keras.Model) -> None:
    """Raise when a trainable weight of ``model`` has a constraint (``kernel_constraint``).

    Keras applies a constraint to the whole variable after each update
    (``optimizer.apply``); at stage 3 each replica updates only its shard, and a
    constraint such as ``MaxNorm`` needs the whole tensor, so the update would silently
    skip it.

    Raises:
        NotImplementedError: naming the first constrained weight; nothing is changed.
    """
    for v in model.trainable_weights:
        if getattr(v, "constraint", None) is not None:
            raise NotImplementedError(
                f"stage 3: weight {v.path!r} has a constraint "
                f"({type(v.constraint).__name__}), which Keras applies to the whole "
                "variable after each update; at stage 3 each replica updates only its "
                "shard, so it cannot be applied. Remove the constraint, or train at "
                "stage 1 or 2"
            )
