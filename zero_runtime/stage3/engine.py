"""Per-block execution of a model whose parameters are sharded (ZeRO stage 3).

The model runs as a sequence of *blocks*: the layers of a ``keras.Sequential`` (a
functional model's top-level layers, which must form a chain) whose config needs this
engine (:mod:`zero_runtime.stage3.path_choice`; other models run by units,
:mod:`zero_runtime.stage3.units_path`). Every trainable weight
is replaced by a :class:`~zero_runtime.sharded_variable.ShardedVariable` whose shards live
in one paged pool. In a training step, on each replica (TF_NOTES section 5, the
``tf.custom_gradient`` path):

- forward, block i: its shards are read from the pool (paged in from host/NVMe), one
  all-gather per block (:func:`zero_runtime.comm.all_gather_flat`) assembles the full
  parameters into gathered buffers on the pool's device tier, the layer runs through
  ``layer.stateless_call`` with those values, and the buffers are released unless the
  plan keeps them (``max_reuse_distance``). Only the block's input is kept for backward.
- backward, block i: the parameters are gathered again (unless kept), the block's
  forward is recomputed from its saved input under a tape, and the parameter gradients
  are reduce-scattered at once (one collective per block), leaving the replica only the
  reduced gradient of its own shards (ZeRO, Rajbhandari et al., SC20, section 5.3).

The schedule is static (:class:`BlockPlan`): uses in the order F0..F(L-1), B(L-1)..B0;
the order actually traced in the first step is recorded and checked against it, and it
drives prefetch: when a use starts, the shards of the next uses that gather, up to
``prefetch_bucket_size`` elements, are prefetched by the pool (NVMe -> host).
Parameters with fewer than ``persistence_threshold`` elements are *persistent*: gathered
once per step and kept until the optimizer updates them. At most
``max_live_parameters`` non-persistent elements are gathered at once per replica.

This module builds the engine (shards, pool, plan, units path) and owns its lifecycle,
step boundaries, live config and placement rows. The block engine's step is
:mod:`zero_runtime.stage3.block_step`, its schedule :mod:`zero_runtime.stage3.block_plan`,
the default tier budgets :mod:`zero_runtime.stage3.pool_sizing`, and which models form a
chain :mod:`zero_runtime.stage3.chain`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import keras
import numpy as np
import tensorflow as tf

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
    PoolOutOfMemoryError,
)
from zero_runtime.memory.flat_store import SPACE_TIERS
from zero_runtime.sharded_variable import (
    PARAM_TIER,
    ShardedVariable,
    ShardState,
    least_padding_dim,
)
from zero_runtime.stage3 import construction, path_choice, placement, tiling
from zero_runtime.stage3 import units as units_mod
from zero_runtime.stage3.block_plan import BlockPlan, PoolStep, shard_blocks
from zero_runtime.stage3.block_step import BlockSteps, _replica_id
from zero_runtime.stage3.chain import _chain_or_none, _replace_variable
from zero_runtime.stage3.gather import UnitRunner
from zero_runtime.stage3.pool_sizing import gathered_pages, size_pool
from zero_runtime.stage3.step_clock import OutsideStepClock
from zero_runtime.stage3.units_path import UnitsPath

log = logging.getLogger(__name__)


class Stage3Engine(BlockSteps):
    """Shards a model's parameters and runs it block by block (ZeRO stage 3).

    A ``keras.Sequential`` or a functional chain (no BatchNormalization, dropout or shared
    weights) whose config needs the block engine
    (:func:`~zero_runtime.stage3.path_choice.block_engine_reasons`:
    row-paged tables, an int device budget, a tight
    ``max_live_parameters``) runs block by block (below); any other model runs by units:
    the model's own call with every layer that owns weights hooked (:attr:`runner`,
    :mod:`zero_runtime.stage3.gather`).

    Args:
        model: a built Keras model. Its trainable weights are replaced, in place, by
            :class:`ShardedVariable` objects; the original variables are dropped.
        strategy: the :class:`~zero_runtime.strategy.ZeroInfinityStrategy` (stage 3).

    Attributes:
        pool: the paged pool holding shards (tier from ``offload_param``) and gathered
            buffers (device tier).
        path: ``'blocks'`` (the block engine) or ``'units'`` (the units path).
        block_reasons: why a chain runs on the block engine (one sentence each; empty
            for a model run by units).
        blocks: the :class:`Block` list (empty for a model run by units).
        runner: the :class:`UnitRunner` of a model run by units, else None.
        units: the :class:`~zero_runtime.stage3.units_path.UnitsPath` of a model run by
            units (shards its units, runs its passes), else None.
        plan: the :class:`BlockPlan`.
        recorded_order: the ``(phase, block)`` uses traced in the first step.
        device_peaks: the pool's device-tier peak bytes of every finished step.
        default_device_budget: the device tier's capacity (bytes) when
            ``device_budget_bytes`` is None: every gathered buffer + slack (+ the shards
            with ``offload_param='none'``); a row-paged table counts its row cache, not
            the table (``embedding.row_paging_budget``, docs/zero_stages.md).
        last_step: the :class:`PoolStep` of the last closed step (None before).
        clock: the :class:`~zero_runtime.stage3.step_clock.OutsideStepClock` (the step
            boundary of device-tier units steps under ``fit``, reported from Python).
        state: OPEN, then CLOSED after :meth:`close` (the strategy's ``close()`` closes
            it, phase ``MODELS``: :mod:`zero_runtime.lifecycle`).

    Raises:
        ValueError: an unbuilt model, a non-float32 weight, or a block above
            ``max_live_parameters``.
        NotImplementedError: a unit that draws random numbers in its own call
            (:func:`zero_runtime.stage3.units.plan_units`).
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
        layers = _chain_or_none(model)
        # A chain runs by units too unless its config needs the block engine
        # (zero_runtime/stage3/path_choice.py): the units path is the fast one.
        self.block_reasons = (
            () if layers is None else path_choice.block_engine_reasons(layers, config)
        )
        if not self.block_reasons:
            layers = None
        self.path = "units" if layers is None else "blocks"
        log.info(
            "stage 3: model %r runs %s%s",
            model.name,
            "by units" if layers is None else "on the block engine: ",
            "; ".join(self.block_reasons),
        )
        # Any other model (a DAG, nested or subclassed, tied weights, BatchNormalization):
        # units hooked in the model's own call (zero_runtime/stage3/gather.py). Every
        # refusal comes before anything is replaced: a refused model is left unchanged.
        specs = units_mod.plan_units(model) if layers is None else None
        self.model = model
        self.runner: UnitRunner | None = None
        self.units: UnitsPath | None = None
        self.tile_plans: dict[int, tiling.TilePlan] = {}  # id(kernel) -> its tiles
        # Frozen (non-trainable) weights are not sharded: replicated on every replica's
        # device like MirroredStrategy's, and counted on that tier (placement_rows).
        self.frozen = tuple(v for v in model.weights if not v.trainable)
        self.resources = resources_of(strategy)  # the owner of the pool and host calls
        if self.resources is not None:
            self.resources.check_open(f"shard model {model.name!r}")
        self.state = LifecycleState.OPEN
        self.tier = PARAM_TIER[config.offload_param]
        self.pool, self.default_device_budget = size_pool(
            layers if specs is None else [u.layer for u in specs],
            config,
            self.tier,
            self.num_shards,
            len(self.local_replicas),
            units=specs is not None,
        )
        # Host/NVMe shards are packed into one flat space per replica (page-sized chunks):
        # page rounding costs at most one page per replica, not a page per variable.
        self.space = (
            FlatShardSpace(self.pool, self.tier, self.local_replicas, name="params")
            if self.tier in SPACE_TIERS
            else None
        )
        if self.resources is not None:
            self.resources.adopt(self, ClosePhase.MODELS, f"stage-3 engine of {model.name!r}")
        remote = len(self.local_replicas) < self.num_shards  # shards on other workers
        # Multi-worker: the group of the eager all-gather that reads a variable outside a
        # step (created here, in the same order on every worker, like every group key).
        self._worker_group = (
            comm.WorkerGroup.create(
                self.devices[0],
                self.num_shards // len(self.local_replicas),
                config.collective_timeout_seconds,
            )
            if remote
            else None
        )
        # The block engine's blocks (row-paged embedding tables among them); none by units.
        self.blocks, self.row_paged = shard_blocks(self, layers or [], remote)
        blocks = self.blocks
        self.plan = BlockPlan.make(
            {b.index: b.elements for b in blocks if b.variables},
            config.max_reuse_distance,
            config.max_live_parameters,
        )
        impl = getattr(strategy, "reduce_scatter_impl", None)
        if impl is None and not any("gpu" in d.lower() for d in self.devices):
            # Measured: the all_to_all reduce-scatter times out in this backward (blocks
            # with 3-D activations) on CPU; the all-reduce + slice path does not. Each
            # replica then holds one block's reduced gradient transiently (see docs).
            impl = "all_reduce"
        self.group = comm.CollectiveGroup.create(
            self.devices,
            impl,
            timeout_seconds=config.collective_timeout_seconds,
        )
        if specs is not None:
            self.units = UnitsPath(self, model, specs, remote, _replace_variable, _replica_id)
            self.runner = self.units.runner
            self.tile_plans = self.units.tile_plans
            self.row_paged = self.units.row_paged
        self.recorded_order: list[tuple[str, int]] = []
        self._order_frozen = False
        self._lock = threading.Lock()
        self._oom_lock = threading.Lock()  # one post-mortem for the replicas' gather OOMs
        self._oom_written: tuple[str | None, dict] | None = None  # (path, report)
        self._live = [0] * self.num_shards  # gathered non-persistent elements per replica
        self.peak_live = [0] * self.num_shards
        self.device_peaks: list[int] = []
        self._steps_done: dict[int, int] = {}
        self._grad_pieces: dict[tuple[int, int], list[tf.Tensor]] = {}
        self._prev_release: dict[int, tf.Tensor] = {}  # trace-time: last backward release
        # Set when a step is traced: True when blocks are updated during backward (the
        # gradient shard moves to the host optimizer at once; see forward_backward).
        self.update_in_backward: bool | None = None
        # One entry per chunk read (a chunk shared by several variables is acquired once
        # per variable), so the pool's position in the order follows the acquires.
        self.pool.set_access_order(
            [
                pid
                for _, b in self.plan.uses
                for v in blocks[b].variables
                for r in self.local_replicas
                for pid in v.page_ids(r)
            ]
        )
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
        """Elements of the largest block's (unit's) gradient shard (one replica), float32."""
        if self.runner is not None:
            return max(u.shard_elements for u in self.runner.units)
        return max((sum(v.shard_elements for v in b.variables) for b in self.blocks), default=0)

    @property
    def min_device_budget(self) -> int:
        """Bytes the pool's device tier must be able to pin at once in a step, all local
        replicas: on the block engine the gathered buffers of the two largest blocks
        (every variable of a block is read from the device tier when the block runs, and
        a block's backward overlaps the next block's gather), plus the shards when they
        live on the device (``offload_param='none'``). Other gathered copies (persistent
        parameters, kept blocks) may move down to the host under pressure. The units
        path's gathered views are TensorFlow tensors outside the pool: only its
        device-tier shards count. A budget below this fails at a gather
        (``PoolOutOfMemoryError``)."""
        page = self.pool.page_size
        local = len(self.local_replicas)
        shards = 0
        if self.tier == "device":
            shards = sum(local * max(1, -(-4 * v.shard_elements // page)) for v in self.variables)
        if self.runner is not None:
            return shards * page
        blocks = sorted(
            sum(gathered_pages(tuple(v.shape), self.num_shards, local, page) for v in b.variables)
            for b in self.blocks
        )
        return (shards + sum(blocks[-2:])) * page

    @property
    def variables(self) -> list[ShardedVariable]:
        """Every sharded variable, block by block (unit by unit, each once)."""
        if self.runner is not None:
            return self.runner.variables
        return [v for b in self.blocks for v in b.variables]

    def in_step(self) -> bool:
        """True while this engine's own traced forward runs on the current replica (its
        tape is then the step's, not a user's)."""
        return self.runner is not None and self.runner.in_step() and not self.runner.user_step()

    # -- optimizer side --------------------------------------------------------------------
    def release_persistent(self, replica: int) -> None:
        """Release the replica's persistent gathered copies (before their shards change)."""
        for v in self.variables:
            if v.state(replica) is ShardState.GATHERED:
                v.release(replica)

    def end_micro_step(self, replica: int) -> None:
        """Called per replica after a micro-step that only accumulated gradients
        (``gradient_accumulation_steps`` > 1): releases the replica's persistent gathered
        copies (the update releases them otherwise) and stops recording the access order
        (one forward/backward is recorded; the pool's step closes at the update)."""
        self.release_persistent(replica)
        with self._lock:
            self._order_frozen = True

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
            record = PoolStep(step, usage, self.pool.step_boundary(step))
            self.device_peaks.append(usage["device"].peak_bytes)
            self._order_frozen = True
            self.last_step = record
            return record

    def apply_config(self, config: ZeroConfig) -> None:
        """Follow a live config change (called by the runtime after an applied control
        request, at a step boundary).

        ``device_budget_bytes`` becomes the pool's device-tier capacity (None: the
        :attr:`default_device_budget`); shrinking moves pages down to the host
        (``PagedBufferPool.set_device_budget``). ``prefetch_bucket_size`` applies from
        the next prefetch. The traced plan's keys (``persistence_threshold``,
        ``max_live_parameters``, ``max_reuse_distance``) do not change a running job.

        A budget the pool cannot shrink to now (pinned pages) is logged and left as it
        was; a budget below one block's gathered pages fails at that block's next gather
        with ``PoolOutOfMemoryError``.
        """
        budget = config.device_budget_bytes
        budget = self.default_device_budget if budget is None else budget
        page = self.pool.page_size
        if budget // page != self.pool.device_tier.capacity_bytes // page:
            try:
                moved = self.pool.set_device_budget(budget)
            except PoolOutOfMemoryError as exc:
                log.warning("stage 3: device budget %d not applied: %s", budget, exc)
            else:
                log.info("stage 3: device tier capacity %d bytes (%d pages moved)", budget, moved)
        self.config = dataclasses.replace(
            self.config, prefetch_bucket_size=config.prefetch_bucket_size
        )

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

        A step aborted by an error (a collective timeout, a pool OOM in a gather, a
        failed host update) leaves some variables GATHERING or GATHERED: the host calls
        that would have finished or released them never run, and the next gather or a
        checkpoint restore would raise ``ShardStateError``. Frees their gathered buffers
        and zeroes the live-element counters; the shards are unchanged.

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
            self._live = [0] * self.num_shards
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
        if self.runner is not None:
            self.runner.remove()
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
