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
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading

import keras
import numpy as np
import psutil
import tensorflow as tf

from zero_runtime import comm
from zero_runtime.config import ZeroConfig
from zero_runtime.lifecycle import (
    ClosePhase,
    LifecycleState,
    StrategyClosedError,
    host_function,
    resources_of,
)
from zero_runtime.memory import (
    FlatShardSpace,
    PageCounters,
    PagedBufferPool,
    PoolOutOfMemoryError,
    TierUsage,
)
from zero_runtime.memory.flat_store import SPACE_TIERS
from zero_runtime.sharded_variable import (
    PARAM_TIER,
    ShardedVariable,
    ShardState,
)
from zero_runtime.stage3 import construction, path_choice, tiling
from zero_runtime.stage3 import units as units_mod
from zero_runtime.stage3.embedding import (
    STATE_TIER,
    RowPagedEmbedding,
    row_paging_applies,
    row_paging_budget,
)
from zero_runtime.stage3.gather import UnitRunner, reduce_scatter_variables
from zero_runtime.stage3.step_clock import OutsideStepClock
from zero_runtime.stage3.units_path import UnitsPath

log = logging.getLogger(__name__)

FWD, BWD = "fwd", "bwd"
SLACK_PAGES = 8  # pages added to default tier budgets (rounding, transient placement)


@dataclasses.dataclass(frozen=True)
class PoolStep:
    """The stage-3 pool at the end of one step (see :meth:`Stage3Engine.close_step`).

    Attributes:
        step: the 0-based step.
        usage: ``{"device"|"host"|"nvme": TierUsage}``, bytes; ``peak_bytes`` is the
            step's peak.
        counters: the step's page moves (d2h/h2d/h2n/n2h pages and bytes), evictions,
            prefetch hits/misses, stall and I/O seconds.
    """

    step: int
    usage: dict[str, TierUsage]
    counters: PageCounters


@dataclasses.dataclass(frozen=True)
class Block:
    """One unit of execution.

    Attributes:
        index: position in the model.
        layer: the Keras layer (its trainable weights are ShardedVariables).
        variables: the layer's trainable variables, in ``layer.trainable_variables`` order.
        elements: non-persistent parameter elements (what is gathered and released).
        persistent_elements: elements of its persistent parameters.
    """

    index: int
    layer: keras.layers.Layer
    variables: tuple[ShardedVariable, ...]
    elements: int
    persistent_elements: int

    @property
    def shard_elements(self) -> int:
        """Elements of one replica's shards of all the block's variables."""
        return sum(v.shard_elements for v in self.variables)


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """The static schedule of one training step.

    Attributes:
        uses: ``(phase, block)`` per use, phase 'fwd' or 'bwd', in execution order.
        keep: per use, True when the block's non-persistent parameters stay gathered
            after it (reused within ``max_reuse_distance`` elements, within
            ``max_live_parameters``).
        gathers: per use, True when the use gathers (its block was not kept).
    """

    uses: tuple[tuple[str, int], ...]
    keep: tuple[bool, ...]
    gathers: tuple[bool, ...]

    @classmethod
    def make(cls, elements: dict[int, int], max_reuse_distance: int, max_live: int) -> BlockPlan:
        """Plan F0..F(L-1), B(L-1)..B0 for the blocks in ``elements`` (block index ->
        non-persistent elements; blocks without parameters are left out).

        A use keeps its block gathered when the elements of other blocks used before
        the block's next use (the reuse distance) are <= ``max_reuse_distance`` and the
        live elements stay <= ``max_live``.

        Raises:
            ValueError: a single block has more than ``max_live`` elements.
        """
        ids = sorted(elements)
        for i, e in elements.items():
            if e > max_live:
                raise ValueError(
                    f"block {i} has {e} parameter elements, more than max_live_parameters="
                    f"{max_live}; raise max_live_parameters or split the block"
                )
        uses = [(FWD, i) for i in ids] + [(BWD, i) for i in reversed(ids)]
        keep, gathers, live = [], [], set()
        for k, (_, b) in enumerate(uses):
            gathers.append(b not in live)
            live.add(b)
            nxt = next((j for j in range(k + 1, len(uses)) if uses[j][1] == b), None)
            if nxt is None:
                keep.append(False)
                live.discard(b)
                continue
            distance = sum(elements[uses[j][1]] for j in range(k + 1, nxt))
            peak = max(
                [sum(elements[x] for x in live | {uses[j][1]}) for j in range(k + 1, nxt)]
                or [sum(elements[x] for x in live)]
            )
            ok = distance <= max_reuse_distance and peak <= max_live
            keep.append(ok)
            if not ok:
                live.discard(b)
        return cls(tuple(uses), tuple(keep), tuple(gathers))


class Stage3Engine:
    """Shards a model's parameters and runs it block by block (ZeRO stage 3).

    A ``keras.Sequential`` or a functional chain (no BatchNormalization, dropout or shared
    weights) whose config needs the block engine
    (:func:`~zero_runtime.stage3.path_choice.block_engine_reasons`: NVMe parameters,
    row-paged tables, the update during backward, a device budget, a tight
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
        self.pool = self._make_pool(
            layers if specs is None else [u.layer for u in specs], config, specs is None
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
        blocks = []
        # Embedding tables of >= embedding_row_paging_threshold elements: row-paged, only
        # the batch's rows move (zero_runtime/stage3/embedding.py); block without gathers.
        self.row_paged: dict[int, RowPagedEmbedding] = {}
        for i, layer in enumerate(layers or ()):
            if row_paging_applies(layer, config):
                old = layer.embeddings
                self.row_paged[i] = RowPagedEmbedding(
                    layer,
                    self.pool,
                    self.num_shards,
                    config,
                    local_replicas=self.local_replicas,
                    gather_remote=self._gather_remote if remote else None,
                )
                _replace_variable(layer, old, self.row_paged[i].table)
                blocks.append(Block(i, layer, (), 0, 0))
                continue
            new_vars = []
            for v in list(layer.trainable_variables):
                size = math.prod(v.shape)
                sv = self.shard_variable(v, remote, persistent=size < config.persistence_threshold)
                _replace_variable(layer, v, sv)
                new_vars.append(sv)
            elements = sum(math.prod(v.shape) for v in new_vars if not v.persistent)
            persistent = sum(math.prod(v.shape) for v in new_vars if v.persistent)
            blocks.append(Block(i, layer, tuple(new_vars), elements, persistent))
        self.blocks = tuple(blocks)
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

    # -- construction helpers ------------------------------------------------------------
    def _make_pool(self, layers: list, config: ZeroConfig, row_paging: bool) -> PagedBufferPool:
        page = config.page_size_bytes
        n = self.num_shards
        local = len(self.local_replicas)  # replicas whose shards and buffers this pool holds

        def pages(elements: int) -> int:
            return max(1, -(-4 * elements // page))

        per_block_shard_pages, per_block_gathered_pages = [], []
        window_pages = []  # per block, what an NVMe-tier step holds on the host at once
        state_tier = STATE_TIER[config.offload_optimizer]
        state_tier = "host" if state_tier == "nvme" and self.tier != "nvme" else state_tier
        row_states = dict.fromkeys(("device", "host", "nvme"), 0)  # row optimizer pages
        row_shard_pages = []  # per row-paged table, its row pages
        packed_elements = 0  # shard elements of one replica in the flat space (host/NVMe)
        for layer in layers:
            if row_paging and row_paging_applies(layer, config):
                # A row-paged table is never gathered whole: its row pages on their tier,
                # a row cache on the device, its row states (embedding.row_paging_budget).
                b = row_paging_budget(tuple(layer.embeddings.shape), page, n, local)
                row_shard_pages.append(b.shard_pages)
                per_block_shard_pages.append(b.shard_pages)
                per_block_gathered_pages.append(b.cache_pages)
                window_pages.append(b.cache_pages)
                row_states[state_tier] += b.state_pages
                continue
            shard_pages = gathered = elements = 0
            for v in layer.trainable_variables:
                shape = tuple(v.shape) or (1,)
                d = 0  # the axis shard_variable splits (see shard_variable)
                rows = -(-shape[d] // n)
                rest = math.prod(shape[:d] + shape[d + 1 :])
                shard_pages += local * pages(rows * rest)
                gathered += local * pages(n * rows * rest)
                elements += rows * rest
            packed_elements += elements
            if self.tier in SPACE_TIERS:
                # Packed in the flat space: the block's range, + one chunk it may straddle.
                shard_pages = local * (pages(elements) + 1) if elements else 0
            per_block_shard_pages.append(shard_pages)
            per_block_gathered_pages.append(gathered)
            window_pages.append(shard_pages)
        all_shards = sum(per_block_shard_pages)
        if self.tier in SPACE_TIERS:  # the flat space: whole chunks, one partial per replica
            all_shards = sum(row_shard_pages) + local * pages(packed_elements)
        all_gathered = sum(per_block_gathered_pages)
        device = config.device_budget_bytes
        if device is None:
            device_pages = all_gathered + SLACK_PAGES + (all_shards if self.tier == "device" else 0)
            device = (device_pages + row_states["device"]) * page
        host = config.host_budget_bytes
        if host is None:
            if self.tier == "nvme":
                # A window: the two largest blocks' shards (the block in use and the one
                # prefetched next) + slack. prefetch_bucket_size is not added: a deeper
                # prefetch competes for this window (the pool evicts LRU host pages to
                # NVMe) instead of growing the default host reservation.
                window = sorted(window_pages)[-2:]
                host = (sum(window) + SLACK_PAGES + row_states["host"]) * page
            else:
                # The shards + room for gathered buffers the pool moves down under device
                # pressure (a device budget below them, given or lowered live), capped so
                # the reservation stays within half of the memory available now.
                base = all_shards + SLACK_PAGES + row_states["host"]
                room = psutil.virtual_memory().available // 2 // page - base
                host = (base + max(0, min(all_gathered, room))) * page
        self.default_device_budget = device
        return PagedBufferPool(
            host_budget_bytes=host,
            page_size_bytes=page,
            device_budget_bytes=device,
            nvme_path=str(config.nvme_path) if self.tier == "nvme" else None,
            nvme_budget_bytes=config.nvme_budget_bytes if self.tier == "nvme" else None,
        )

    def shard_variable(self, v, remote: bool, **kwargs) -> ShardedVariable:
        """A :class:`ShardedVariable` of Keras variable ``v`` in this engine's pool (on
        its ``offload_param`` tier, over its replicas; ``remote``: other workers hold
        some replicas' shards). A deferred variable (``strategy.zero_init``) is
        initialized here, on the host, one at a time (``construction.consume``).
        Split along the axis with the least padding (:func:`least_padding_dim`): a
        ``(1, 1, C_in, C_out)`` kernel along ``C_out``, not its first axis.
        ``kwargs``: more ShardedVariable arguments (``persistent``, ``devices``)."""
        kwargs.setdefault("shard_dim", 0)  # least_padding_dim breaks resharding checkpoints (CI)
        return ShardedVariable(
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
    def variables(self) -> list[ShardedVariable]:
        """Every sharded variable, block by block (unit by unit, each once)."""
        if self.runner is not None:
            return self.runner.variables
        return [v for b in self.blocks for v in b.variables]

    def in_step(self) -> bool:
        """True while this engine's own traced forward runs on the current replica (its
        tape is then the step's, not a user's)."""
        return self.runner is not None and self.runner.in_step()

    # -- the step (replica context) --------------------------------------------------------
    def forward_backward(self, x, loss_fn, training: bool = True, update=None):
        """Run forward and backward on this replica; return ``(y_pred, loss, grads)``.

        Args:
            x: the replica's input batch.
            loss_fn: ``y_pred -> scalar loss`` (runs under the tape).
            training: passed to layers whose ``call`` takes ``training``.
            update: a :class:`~zero_runtime.optim.backward_update.BackwardShardUpdate`
                for this replica, or None (default). Given, each block's reduced
                gradient shard updates the block's parameter shards as soon as it
                exists, during backward, and is freed then (the device never holds more
                than the blocks being reduced).

        Returns:
            ``y_pred``, the loss, and the gradients: without ``update``,
            ``{id(variable): float32 [shard_elements]}``, the replica's reduced (summed
            over replicas) gradient shard of every variable; with ``update``, a float32
            scalar 0.0 that exists once every block's update has run.

        Raises:
            RuntimeError: outside replica context or with a non-static replica id.
        """
        replica = _replica_id()
        # Telemetry: the collectives this step's trace issues, counted by their real
        # dtype over the local replicas (traced one after the other).
        if replica == self.local_replicas[0]:
            self.group.start_tally()
        try:
            return self._forward_backward(x, loss_fn, training, update, replica)
        finally:
            if replica == self.local_replicas[-1]:
                self.group.stop_tally()

    def _forward_backward(self, x, loss_fn, training: bool, update, replica: int):
        if self.runner is not None:
            self.update_in_backward = update is not None
            return self.units.forward_backward(x, loss_fn, training, update)
        self.update_in_backward = update is not None
        anchor = tf.zeros([], tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(anchor)
            h = x
            for block in self.blocks:
                h = self._block(block, h, anchor, replica, training, update)
            y_pred = h
            loss = loss_fn(y_pred)
        self._prev_release.pop(replica, None)
        d_anchor = tape.gradient(loss, anchor)
        if update is not None:  # every block's update feeds d_anchor (a 0.0 each)
            return y_pred, loss, d_anchor
        grads = {}
        for block in self.blocks:
            if not block.variables:
                continue
            pieces = self._grad_pieces.pop((replica, block.index))
            for v, g in zip(block.variables, pieces):
                with tf.control_dependencies([d_anchor]):
                    grads[id(v)] = tf.identity(g)
        return y_pred, loss, grads

    def forward(self, x, training: bool = False):
        """Forward only, block by block on this replica (gather, run, release)."""
        if self.runner is not None:
            return self.units.forward(x, training)
        replica = _replica_id()
        h = x
        for block in self.blocks:
            if block.index in self.row_paged:
                h = self.row_paged[block.index].forward(h, replica)
                continue
            if not block.variables:
                h = self._call(block, [], h, training)
                continue
            values = self._materialize(block, replica, None, _dep(h), gather_all=True)
            h = self._call(block, values, h, training)
            done = _host_call(
                functools.partial(self._release_all, block.index, replica), [_dep(h)], tf.float32
            )
            done.set_shape([])  # a scalar: keeps h's static rank (Keras losses need it)
            h = h + tf.cast(done, h.dtype)  # done == 0.0: a data dependency on the release
        return h

    def _block(self, block: Block, x, anchor, replica: int, training: bool, update=None):
        if block.index in self.row_paged:  # only the batch's rows move
            return self.row_paged[block.index].block(x, anchor, replica)
        if not block.variables:  # nothing to gather: an ordinary op under the outer tape
            return self._call(block, [], x, training)
        fwd_use = self.plan.uses.index((FWD, block.index))
        bwd_use = self.plan.uses.index((BWD, block.index))
        float_x = x.dtype.is_floating

        @tf.custom_gradient
        def run(x, anchor):
            values = self._materialize(block, replica, fwd_use, _dep(x))
            y = self._call(block, values, x, training)
            y = self._after_use(block, replica, fwd_use, y, values)

            def grad(dy):
                values2 = self._materialize(block, replica, bwd_use, _dep(dy))
                with tf.GradientTape() as t:
                    t.watch(values2)
                    if float_x:
                        t.watch(x)
                    y2 = self._call(block, values2, x, training)
                sources = list(values2) + ([x] if float_x else [])
                gs = t.gradient(y2, sources, output_gradients=dy)
                gs = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in gs]
                gparams = [
                    g if g is not None else tf.zeros(v.shape, tf.float32)
                    for g, v in zip(gs[: len(values2)], block.variables)
                ]
                shard = self._reduce_scatter(block, gparams)  # (E,)
                # values2 too: an embedding's gradient does not read the table, and the
                # host call that finished the gather must still run (see _host_call).
                done = self._release_after(block, replica, bwd_use, [shard, *values2])
                d_anchor = tf.zeros_like(anchor) + done  # depends on the release (0.0)
                if update is not None:
                    # Updated now, on the host, after the release; the shard is freed
                    # when the update has read it. d_anchor carries its token (0.0).
                    d_anchor = d_anchor + update.update(block.variables, shard, done)
                else:
                    # The optimizer reads the shard + 0.0: a data dependency on the
                    # release. Added once to the whole shard (per piece it made a copy of
                    # each piece, kept to the step's end); _reduce_scatter's shard owns
                    # its buffer, so the add runs in place.
                    shard = shard + done
                    sizes = [v.shard_elements for v in block.variables]
                    self._grad_pieces[(replica, block.index)] = list(tf.split(shard, sizes))
                # dx waits for the release of the block whose backward ran before this
                # one: the next gather (which depends on dx) overlaps this block's
                # backward but never a third block (at most two blocks gathered).
                prev = self._prev_release.get(replica)
                dx = None
                if float_x:
                    dx = gs[-1] if prev is None else gs[-1] + tf.cast(prev, gs[-1].dtype)
                self._prev_release[replica] = done
                return dx, d_anchor

            return y, grad

        return run(x, anchor)

    def _call(self, block: Block, values: list, x, training: bool):
        layer = block.layer
        non_trainable = [v.value for v in layer.non_trainable_variables]
        kwargs = {"training": training} if getattr(layer, "_call_has_training_arg", False) else {}
        y, _ = layer.stateless_call(list(values), non_trainable, x, **kwargs)
        return y

    def _after_use(self, block: Block, replica: int, use: int, y, values: list):
        done = self._release_after(block, replica, use, [y, *values])
        return y + tf.cast(done, y.dtype)  # done == 0.0: orders the release before later uses

    def _release_after(self, block: Block, replica: int, use: int, after: list):
        deps = [_dep(t) for t in after]
        done = _host_call(functools.partial(self._release, use, replica), deps, tf.float32)
        done.set_shape([])
        return done

    # -- gather (graph side) -------------------------------------------------------------
    def _materialize(self, block: Block, replica: int, use: int | None, dep, gather_all=False):
        """Full values of the block's variables on this replica (list of float32 tensors)."""
        if use is None or gather_all:
            need = [i for i, v in enumerate(block.variables) if not v.persistent or use is None]
        else:
            gathers = self.plan.gathers[use]
            phase = self.plan.uses[use][0]
            need = [
                i
                for i, v in enumerate(block.variables)
                if (not v.persistent and gathers) or (v.persistent and phase == FWD)
            ]
        shapes = [tuple(v.shape) for v in block.variables]
        if need:
            n_elems = sum(block.variables[i].shard_elements for i in need)
            shard = _host_call(
                self._oom_guard(
                    functools.partial(self._fetch, block.index, use, replica, tuple(need))
                ),
                [dep],
                tf.float32,
                name="zero3_fetch_shards",
            )
            shard.set_shape([n_elems])
            full = comm.all_gather_flat(shard, self.group)  # (N * n_elems,)
            full.set_shape([self.num_shards * n_elems])
            inputs = [full]
            fn = self._oom_guard(functools.partial(self._finish, block.index, replica, tuple(need)))
        else:
            inputs = [dep]
            fn = functools.partial(self._read, block.index, replica)
        values = _host_call(fn, inputs, [tf.float32] * len(block.variables), name="zero3_gathered")
        values = list(values)
        for t, s in zip(values, shapes):
            t.set_shape(s)
        return values

    def _reduce_scatter(self, block: Block, grads: list) -> tf.Tensor:
        """Reduce-scatter the block's full gradients; return this replica's reduced shard,
        float32 ``[E]`` (its pieces of the block's variables, concatenated in order)."""
        return reduce_scatter_variables(block.variables, grads, self.group)

    # -- host callbacks --------------------------------------------------------------------
    def _oom_guard(self, fn):
        """``fn`` (a gather's host callback), writing the OOM post-mortem first when the
        pool cannot place a page.

        A ``PoolOutOfMemoryError`` inside a ``tf.numpy_function`` reaches Keras as a
        TensorFlow ``ResourceExhaustedError``; before that, the strategy's runtime writes
        the post-mortem (summary + JSON, docs/oom.md) and the error raised is an
        :class:`zero_runtime.oom.TierOutOfMemoryError` whose message names the file (the
        pool's error is its ``__cause__``). Without a runtime the pool's error propagates.
        """
        runtime = getattr(self.strategy, "runtime", None)
        if runtime is None or not hasattr(runtime, "write_postmortem"):
            return fn

        @functools.wraps(fn)
        def guarded(*args):
            try:
                return fn(*args)
            except PoolOutOfMemoryError as exc:
                from zero_runtime import oom

                with self._oom_lock:  # the first replica's error writes it
                    if self._oom_written is None:
                        path = runtime.write_postmortem(exc)
                        report = getattr(runtime, "last_postmortem", None) or {}
                        self._oom_written = (path, report)
                err = oom.TierOutOfMemoryError(str(exc), exc.snapshot.request_tier)
                err.attach(*self._oom_written)
                raise err from exc

        return guarded

    def _record(self, use: int | None, replica: int) -> None:
        """Record replica 0's uses during the first step (the observed access order)."""
        if use is None or replica != 0:
            return
        with self._lock:
            if not self._order_frozen:
                self.recorded_order.append(self.plan.uses[use])

    def _prefetch_after(self, use: int, replica: int) -> None:
        if self.tier != "nvme" or self.config.prefetch_bucket_size == 0:
            return
        order = self.recorded_order if len(self.recorded_order) == len(self.plan.uses) else None
        uses = order or list(self.plan.uses)
        budget = self.config.prefetch_bucket_size
        ids = []
        for k in range(use + 1, len(uses)):
            if not self.plan.gathers[k]:
                continue
            block = self.blocks[uses[k][1]]
            if block.shard_elements > budget:
                break
            budget -= block.shard_elements
            ids += [pid for v in block.variables for pid in v.page_ids(replica)]
        if ids:
            self.pool.prefetch(list(dict.fromkeys(ids)))  # a shared chunk once

    def _fetch(
        self, b: int, use: int | None, replica: int, need: tuple[int, ...], *_
    ) -> np.ndarray:
        block = self.blocks[b]
        self._record(use, replica)
        if use is not None:
            self._prefetch_after(use, replica)
        parts = []
        for i in need:
            v = block.variables[i]
            v.begin_gather(replica)
            parts.append(v.read_shard(replica))
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def _finish(self, b: int, replica: int, need: tuple[int, ...], full: np.ndarray) -> list:
        block = self.blocks[b]
        rows = full.reshape(self.num_shards, -1)  # (N, E)
        off = 0
        added = 0
        for i in need:
            v = block.variables[i]
            v.finish_gather(replica, rows[:, off : off + v.shard_elements])
            off += v.shard_elements
            if not v.persistent:
                added += math.prod(v.shape)
        with self._lock:
            self._live[replica] += added
            self.peak_live[replica] = max(self.peak_live[replica], self._live[replica])
            if self._live[replica] > self.config.max_live_parameters:
                raise RuntimeError(
                    f"replica {replica}: {self._live[replica]} gathered parameter elements "
                    f"exceed max_live_parameters={self.config.max_live_parameters}"
                )
        return self._read(b, replica)

    def _read(self, b: int, replica: int, *_) -> list:
        return [v.gathered_value(replica) for v in self.blocks[b].variables]

    def _release(self, use: int, replica: int, *_) -> np.int64:
        if self.plan.keep[use]:
            return np.float32(0.0)
        block = self.blocks[self.plan.uses[use][1]]
        freed = 0
        for v in block.variables:
            if not v.persistent and v.state(replica) is ShardState.GATHERED:
                v.release(replica)
                freed += math.prod(v.shape)
        with self._lock:
            self._live[replica] -= freed
        return np.float32(0.0)

    def _release_all(self, b: int, replica: int, *_) -> np.int64:
        for v in self.blocks[b].variables:
            if v.state(replica) is ShardState.GATHERED:
                v.release(replica)
                if not v.persistent:
                    with self._lock:
                        self._live[replica] -= math.prod(v.shape)
        return np.float32(0.0)

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
        """One placement row per sharded variable (``memory_hierarchy/placement``), and
        one per row-paged table (:meth:`RowPagedEmbedding.placement_row`).

        ``param_tier`` is where replica 0's shard pages are now, by the pool's page table
        (tiers joined with '+' when its pages are split); gradients are reduced to a shard
        on the device, held to the step's end ('device') or, when blocks are updated
        during backward, handed to the host optimizer at once ('device -> host').
        """
        grad_tier = "device -> host (in backward)" if self.update_in_backward else "device"
        rows = []
        for v in self.variables:
            tiers = sorted(
                {
                    p.tier
                    for pid in v.page_ids(self.local_replicas[0])
                    for p in self.pool.describe(pid).pages
                    if p.tier
                },
                key=("device", "host", "nvme").index,
            )
            text = f"sharded 1/{self.num_shards} along dim {v.shard_dim} (ZeRO-3)"
            if v.persistent:
                text += "; persistent: gathered once per step"
            if id(v) in self.tile_plans:
                text += "; " + self.tile_plans[id(v)].describe()
            rows.append(
                {
                    "name": v.path,
                    "shape": list(v.shape),
                    "dtype": "float32",
                    "bytes": 4 * math.prod(v.shape),
                    "partitioning": text,
                    "shard_bytes_per_replica": 4 * v.shard_elements,
                    "param_tier": "+".join(tiers) or v.tier,
                    "grad_tier": grad_tier,
                    "optimizer_tier": optimizer_tier,
                }
            )
        # One row per row-paged table: its row pages' bytes per tier, rows/pages touched.
        rows.extend(e.placement_row() for e in self.row_paged.values())
        for v in self.frozen:  # replicated on the device, no gradient, no optimizer state
            nbytes = _nbytes(v)
            rows.append(
                {
                    "name": v.path,
                    "shape": list(v.shape),
                    "dtype": str(np.dtype(v.dtype)),
                    "bytes": nbytes,
                    "partitioning": "frozen, replicated (not trainable: not sharded)",
                    "shard_bytes_per_replica": nbytes,
                    "param_tier": "device",
                    "grad_tier": "none",
                    "optimizer_tier": "none",
                }
            )
        return rows

    @property
    def frozen_bytes(self) -> int:
        """Bytes of the frozen (non-trainable) weights one replica holds on its device:
        they are replicated, not sharded (``frozen``)."""
        return sum(_nbytes(v) for v in self.frozen)

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


def _chain_or_none(model: keras.Model) -> list | None:
    """The model's blocks when it is a chain the per-block path runs (a Sequential or a
    functional chain, no shared weights, BatchNormalization or dropout); None otherwise
    (the model then runs by units)."""
    try:
        layers = _chain_layers(model)
        _check_unshared(layers)
        for layer in layers:
            _check_supported(layer)
    except NotImplementedError:
        return None
    except ValueError as exc:
        if "float32" in str(exc):
            raise
        return None
    return layers


def _chain_layers(model: keras.Model) -> list:
    """The top-level layers of ``model`` as a chain of blocks (each consumes the output
    of the one before).

    Raises:
        ValueError: a model that is not a ``keras.Sequential`` or a functional chain,
            naming the first layer that breaks the chain and why.
    """
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    if isinstance(model, keras.Sequential):
        return layers
    why = "stage 3 runs a keras.Sequential or a functional model whose top-level layers "
    why += "form a single chain (docs/zero_stages.md)"
    inputs = getattr(model, "inputs", None)
    if not inputs or not hasattr(model, "_operations"):
        raise ValueError(
            f"model {model.name!r} ({type(model).__name__}) is not a functional model: {why}"
        )
    if len(inputs) != 1:
        raise ValueError(f"model {model.name!r} has {len(inputs)} inputs: {why}")
    h = inputs[0]
    for layer in layers:
        nodes = layer._inbound_nodes  # noqa: SLF001
        args = nodes[0].input_tensors if len(nodes) == 1 else []
        if len(args) != 1 or args[0] is not h:
            reason = (
                f"is called {len(nodes)} times"
                if len(nodes) != 1
                else f"takes {len(args)} inputs"
                if len(args) != 1
                else "does not take the previous layer's output (a residual or branching graph)"
            )
            raise ValueError(f"model {model.name!r}: layer {layer.name!r} {reason}: {why}")
        h = layer.output
    return layers


def _check_unshared(layers: list) -> None:
    """Refuse a trainable weight used by two blocks (tied weights, or a layer holding
    another block's layer): stage 3 gathers, reduces and updates each weight with the
    one block that owns it.

    Raises:
        ValueError: naming the weight and both blocks.
    """
    owner: dict[int, keras.layers.Layer] = {}
    for layer in layers:
        for v in layer.trainable_variables:
            first = owner.setdefault(id(v), layer)
            if first is not layer:
                raise ValueError(
                    f"weight {v.path!r} is used by blocks {first.name!r} and {layer.name!r} "
                    "(tied or shared weights): stage 3 gathers and updates each weight with "
                    "one block; put the layers that share it in one block (one layer) or "
                    "untie it"
                )


def _check_supported(layer: keras.layers.Layer) -> None:
    for sub in layer._flatten_layers(include_self=True):  # noqa: SLF001
        if isinstance(sub, keras.layers.BatchNormalization):
            raise NotImplementedError(
                f"stage 3: layer {sub.name!r} (BatchNormalization) updates its moving "
                "statistics in call, which the recomputed backward would repeat; not "
                "implemented at stage 3 yet (train it at stage 1 or 2)"
            )
        if isinstance(sub, keras.layers.Dropout) and sub.rate > 0:
            raise NotImplementedError(
                f"stage 3: {sub.name!r} has dropout {sub.rate}: the recomputed forward "
                "would draw different masks"
            )
        if getattr(sub, "dropout", 0) and isinstance(sub, keras.layers.MultiHeadAttention):
            raise NotImplementedError(f"stage 3: {sub.name!r} has attention dropout")
        policy = sub.dtype_policy
        if policy.compute_dtype != policy.variable_dtype:
            # The block path calls layers outside Keras's __call__ (no autocast); units
            # run mixed precision as Keras does (zero_runtime/stage3/gather.py).
            raise NotImplementedError(f"stage 3: {sub.name!r} computes in {policy.name}")
    for v in layer.trainable_variables:
        if np.dtype(v.dtype) != np.float32:
            raise ValueError(f"stage 3 supports float32 weights; {v.path!r} is {v.dtype}")


def _replace_variable(layer: keras.layers.Layer, old, new) -> None:
    """Point every reference to ``old`` in ``layer`` and its sublayers at ``new``.

    Keras layers hold their weights as attributes (``Dense._kernel``), in their trackers'
    lists (``_trainable_variables``) and, under TensorFlow, in TensorFlow's checkpoint
    dependency records (a ``TrackedDict`` of names and a list of ``TrackableReference``
    pairs). All are rewritten in place, by identity, so that nothing keeps the replicated
    original alive once the sharded variable replaces it.
    """
    for sub in layer._flatten_layers(include_self=True):  # noqa: SLF001
        for name, value in list(vars(sub).items()):
            if value is old:
                object.__setattr__(sub, name, new)
            elif isinstance(value, list):
                for j, item in enumerate(value):
                    if item is old:
                        value[j] = new
                    elif getattr(item, "ref", None) is old and hasattr(item, "name"):
                        value[j] = type(item)(item.name, new)  # TrackableReference(name, ref)
            elif isinstance(value, dict):  # includes Keras's TrackedDict
                for key, item in list(value.items()):
                    if item is old:
                        value[key] = new


def _nbytes(v) -> int:
    return math.prod(v.shape) * np.dtype(v.dtype).itemsize


def _dep(t: tf.Tensor) -> tf.Tensor:
    """One element of ``t`` (flattened): a cheap data dependency for a host call."""
    return tf.reshape(t, [-1])[:1]


def _host_call(fn, inputs: list, tout, name: str = "zero3_host"):
    """``tf.numpy_function`` ordered by data dependencies only.

    Stateless on purpose: TensorFlow's automatic control dependencies run *stateful*
    ops in program order, and the replicas of a MirroredStrategy step are traced one
    after the other into one graph, so a stateful host call of replica 1 would wait for
    every stateful op of replica 0, including the all-gathers that wait for replica 1
    (a deadlock, seen as a collective timeout). Each call takes a data-dependent input
    (``_dep``), so it is neither constant-folded nor merged, and runs when its inputs
    exist. A call made for its side effect must feed a value that is used (Grappler
    prunes control dependencies on stateless ops): the releases return 0.0, added to
    the block's output. The strategy the step is traced under owns ``fn``
    (:func:`zero_runtime.lifecycle.host_function`), so the graph does not keep it alive.
    """
    return host_function(fn, inputs, tout, stateful=False, name=name)


def _replica_id() -> int:
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError("stage-3 steps run in replica context (strategy.run / fit)")
    rid = tf.get_static_value(ctx.replica_id_in_sync_group)
    if rid is None:
        raise RuntimeError("stage 3 needs a static replica id")
    return int(rid)
