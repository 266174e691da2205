"""Partitioned Keras optimizers: each replica updates only its shard (ZeRO stages 1 and 2).

These are Keras 3 optimizers (subclasses of ``keras.optimizers.Adam``/``AdamW``/``SGD``)
whose per-step update is replaced, through Keras's ``_backend_update_step`` hook
(TF_NOTES section 4), by the ZeRO update (Rajbhandari et al., SC20, section 5):

1. the replica's gradients are flattened bucket by bucket (:mod:`.layout`) and reduced
   across replicas, one collective per bucket in backward order (:mod:`zero_runtime.comm`):
   stage 1 all-reduces each bucket and takes its piece; stage 2 reduce-scatters, so the
   replica only ever holds the reduced gradient of its own shard;
2. the replica updates its shard of the parameters with optimizer states that exist only
   for that shard, on the tier ``offload_optimizer`` chooses: device variables ('none',
   TensorFlow ops in the step's graph), host numpy buffers ('cpu', ZeRO-Offload) or NVMe
   pages streamed by sub-group through the paged pool ('nvme', ZeRO-Infinity);
3. the updated shards are all-gathered and assigned to the replicated variables.

Everything else Keras does around the update (loss scaling, clipping, weight decay,
learning-rate schedules, EMA, the iteration counter) is Keras's own code, so behaviour
matches the stock optimizer; the update math follows Keras's operation order
(``zero_runtime.optim.kernels``). Keras clips each replica's gradients before the hook
(as stock Keras does under ``MirroredStrategy``), so clipping matches Keras by
construction.

Gradient accumulation (``ZeroConfig.gradient_accumulation_steps`` = N > 1) is done here,
not by Keras: stage 1 accumulates the N micro-batch gradients locally (one device buffer
of the padded flat size per replica) and reduces once; stage 2 reduce-scatters every
micro-batch and accumulates only its shard, so it never holds a full gradient (ZeRO-2's
memory contract). The optimizer step (bias correction, learning-rate schedule, weight
decay) counts updates, ``iterations // N``, so N micro-batches equal one step on the
N-times-larger batch.

A model whose states are smaller than ``mirrored_fallback_bytes`` runs the stock Keras
update (plain mirrored data parallelism) and the runtime records ``fallback_mirrored``.

Vocabulary (flat buffer, bucket, piece, shard) as in :mod:`zero_runtime.optim.layout`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from zero_runtime import comm, estimator
from zero_runtime.config import ZeroConfig
from zero_runtime.lifecycle import ClosePhase, host_function, resources_of
from zero_runtime.optim import kernels, registry
from zero_runtime.optim.device_state import DeviceOptimizerState
from zero_runtime.optim.ema import ShardEma
from zero_runtime.optim.flat_update import FlatShardUpdate, iteration_gate
from zero_runtime.optim.host_state import HostOptimizerState
from zero_runtime.optim.keras_saving import KerasSaving, TrackedZeroStates
from zero_runtime.optim.layout import FlatLayout, layout_from_sharded
from zero_runtime.optim.mirrored import MirroredOptimizerState
from zero_runtime.optim.nvme_state import NvmeOptimizerState
from zero_runtime.optim.registry import (  # noqa: F401  (re-exported)
    PARTITIONED_BY_NAME,
    PARTITIONED_FOR_KERAS,
    register_partitioned,
)
from zero_runtime.optim.replica_context import replica_id
from zero_runtime.optim.shard_update import ShardedUpdate
from zero_runtime.optim.split_state import SplitOptimizerState
from zero_runtime.optim.transaction import StepJournals, TransactionalUpdate
from zero_runtime.sharded_variable import ShardedVariable, is_deferred, resolve

_BaseOptimizer = keras.optimizers.Optimizer
_OPTIMIZER_IDS = itertools.count()


def model_state_bytes(num_params: int, kind: str) -> int:
    """Bytes of the unpartitioned fp32 model states of one replica: ``(4 + 4 + K) * Ψ``.

    ZeRO (SC20) section 3.1 with p = g = 4 and K from ``estimator.OPTIMIZER_STATE_BYTES``
    (stage 0 of :func:`zero_runtime.estimator.estimate`, precision 'fp32'); the quantity
    compared with ``ZeroConfig.mirrored_fallback_bytes``.
    """
    return estimator.estimate(
        max(1, num_params), 1, stage=0, precision="fp32", optimizer=kind
    ).total_bytes


@dataclasses.dataclass
class ZeroOptimizerState:
    """Everything the ZeRO update keeps for one optimizer (one record, one owner).

    Attributes:
        config: the active configuration (the strategy's, or the defaults).
        stage: 1, 2 or 3 (3: the variables are ShardedVariables, see ``apply_shard_gradients``).
        layout: the flat layout (buckets, shards) of the trainable variables.
        store: the optimizer-state shards on their tier (device, host or NVMe).
        group: the raw-collective group (stage 2's reduce-scatter, the all-gather of the
            updated shards, the collectives inside ``tf.cond``).
        devices: the local replicas' devices, index = replica id.
        accumulators: per replica, the device gradient accumulator (float32
            ``[padded_total]`` at stage 1, ``[shard_size]`` at stage 2) when N > 1.
        runtime: the strategy's ``ZeroRuntime`` or None.
        journals: the step transactions (:mod:`zero_runtime.optim.transaction`) when
            the store has them (NVMe), else None.
    """

    config: ZeroConfig
    stage: int
    layout: FlatLayout
    store: Any
    group: comm.CollectiveGroup | None
    devices: tuple[str, ...]
    accumulators: tuple[tf.Variable, ...]
    runtime: Any
    journals: StepJournals | None = None

    @property
    def accumulation_steps(self) -> int:
        """N, micro-batches per optimizer step."""
        return self.config.gradient_accumulation_steps

    @property
    def accumulator_bytes(self) -> int:
        """Device bytes of the gradient accumulators over the local replicas."""
        return sum(4 * int(a.shape[0]) for a in self.accumulators)


class _PartitionedUpdate(
    KerasSaving, ShardEma, FlatShardUpdate, ShardedUpdate, TransactionalUpdate
):
    """Mixin holding the ZeRO update; combine with a Keras optimizer class.

    Lifecycle: unbuilt -> :meth:`build` (the ZeRO state, or stock Keras below the
    fallback size) -> steps (:class:`~zero_runtime.optim.flat_update.FlatShardUpdate` at
    stages 1-2, :class:`~zero_runtime.optim.shard_update.ShardedUpdate` at stage 3, each
    a transaction with NVMe states: :class:`~zero_runtime.optim.transaction.
    TransactionalUpdate`).

    Keras's ``use_ema`` average is one more partitioned state (:class:`~.ema.ShardEma`).

    Subclasses define ``_zero_slots`` (names of state buffers), ``_zero_scalars(lr)``,
    ``_zero_host_step(slots, scratch, param, grad, scalars)`` (numpy, in place, one tile)
    and ``_zero_device_delta(slots, param, grad, scalars, mask)`` (TensorFlow ops: the
    step's decrement ``u``, the new parameters being ``param - u``; see
    :meth:`_zero_device_step`).
    """

    _zero_slots: tuple[str, ...] = ()
    #: False for a class with no partitioned update (zero_runtime/optim/adopt.py).
    _zero_supported: bool = True
    _zero: ZeroOptimizerState | None = None
    _zero_fallback: bool = False
    _zero_mirrored: MirroredOptimizerState | None = None  # the record in fallback mode

    # -- building ------------------------------------------------------------------------
    def build(self, variables: list) -> None:
        """Create Keras's counters and the ZeRO state (or, below the fallback size, the
        stock optimizer's slot variables).

        Raises:
            NotImplementedError: ``amsgrad=True`` (Adam); ``use_ema`` where the average
                cannot be kept partitioned (:meth:`~.ema.ShardEma._zero_ema_refuse`).
            NotImplementedError: Keras's own ``gradient_accumulation_steps`` at stages
                1-3, naming ``ZeroConfig(gradient_accumulation_steps=N)``; raised before
                anything is built or sharded.
            ValueError: at stages 0-2, a variable created outside ``strategy.scope()``
                (:func:`_refuse_outside_scope`).
            ValueError: a variable built inside ``strategy.zero_init()`` has no value yet
                (the model was not passed through ``strategy.shard_model``); at stage 3,
                unsharded variables the strategy cannot shard (``autoshard_stage3``).
            NotImplementedError: at stage 3, a layer the engine cannot run yet.
            zero_runtime.memory.NvmePathError: ``offload_optimizer='nvme'`` with an
                unusable ``nvme_path``.
        """
        if self.built:
            return
        # Originals a loop read before stage 3 sharded their model: their sharded variables.
        variables = [resolve(v) for v in variables]
        strategy = self._distribution_strategy
        runtime = getattr(strategy, "runtime", None)
        config = runtime.config if runtime is not None else ZeroConfig()
        if runtime is None:
            # No ZeroInfinityStrategy (a model loaded or used outside one): nothing to
            # partition, the stock Keras optimizer.
            self._zero_fallback = True
            super().build(variables)
            return
        if not self._zero_supported:
            self._zero_refuse_unsupported(variables, config)
        if self.gradient_accumulation_steps and config.stage >= 1:
            raise NotImplementedError(_keras_accumulation_refusal(self, config.stage))
        if config.stage < 3:
            _refuse_outside_scope(strategy, variables)
        if config.stage == 3 and not all(isinstance(v, ShardedVariable) for v in variables):
            # Stage 3 through plain compile/fit (also a model built in zero_init()): the
            # strategy shards the model that is building this optimizer
            # (zero_runtime/stage3/autoshard.py), or refuses before the first step; never
            # the stage-1/2 update below.
            variables = strategy.autoshard_stage3(self, list(variables))
        deferred = [v for v in variables if is_deferred(v)]
        if deferred:
            raise ValueError(
                f"{len(deferred)} variable(s) (first: {deferred[0].path!r}) were built inside "
                "strategy.zero_init() and have no value until sharded: train the model "
                "returned by strategy.shard_model(model), not the model itself"
            )
        if variables and all(isinstance(v, ShardedVariable) for v in variables):
            self._zero3_build(variables, strategy, runtime, config)
            return
        num_params = sum(int(np.prod(v.shape)) for v in variables if v.trainable)
        kind = estimator.state_kind(self)
        small = model_state_bytes(num_params, kind) < config.mirrored_fallback_bytes
        if config.stage == 0 or small:
            # Stage 0 (plain data parallelism) or a model below the fallback size: the
            # stock Keras update, still recorded step by step (optim/mirrored.py).
            self._zero_fallback = True
            super().build(variables)
            if runtime is not None:
                if config.stage > 0:
                    runtime.set_fallback_mirrored(True)
                with tf.init_scope():
                    self._zero_mirrored = MirroredOptimizerState.from_optimizer(
                        self,
                        list(variables),
                        config,
                        tuple(strategy.extended.worker_devices),
                        runtime,
                    )
                runtime.register_optimizer(self)
            return
        self._zero_ema_refuse(variables, config, config.stage, _workers(strategy))
        self._zero_keras_build(_BaseOptimizer.build, variables)
        with tf.init_scope():
            devices = tuple(strategy.extended.worker_devices)
            n = strategy.num_replicas_in_sync
            stage = 2 if config.stage >= 2 else 1
            layout = FlatLayout.from_variables(
                self._trainable_variables, n, bucket_size=config.reduce_bucket_size
            )
            store = self._zero_make_store(config, layout, devices)
            # Stage 2's reduce-scatter, the all-gather of the updated shards (one raw
            # CollectiveGatherV2: the strategy's all_gather also gathers the lengths and
            # copies twice to pad and unpad) and the collectives inside tf.cond.
            impl = getattr(strategy, "reduce_scatter_impl", None)
            group = comm.CollectiveGroup.create(
                devices, impl, timeout_seconds=config.collective_timeout_seconds
            )
            accumulators = []
            if config.gradient_accumulation_steps > 1:
                size = layout.shard_size if stage >= 2 else layout.padded_total
                for d in devices:
                    with tf.device(d):
                        accumulators.append(_plain_variable(tf.zeros([size], tf.float32)))
            self._zero = ZeroOptimizerState(
                config, stage, layout, store, group, devices, tuple(accumulators), runtime
            )
            self._zero_attach_journals()
            if runtime is not None:
                runtime.register_optimizer(self)
        # tf.train.Checkpoint(optimizer=...) saves the states gathered (keras_saving).
        self._zero_checkpoint_states = TrackedZeroStates(self)

    def _zero_refuse_unsupported(self, variables: list, config: ZeroConfig) -> None:
        """Raise unless this unsupported optimizer may run as stock Keras here (stage 0,
        or stages 1-2 below ``mirrored_fallback_bytes``).

        Raises:
            NotImplementedError: naming the class, the stage and the supported classes.
        """
        if config.stage == 0:
            return
        num_params = sum(int(np.prod(v.shape)) for v in variables if v.trainable)
        kind = estimator.state_kind(self)
        if (
            config.stage < 3
            and model_state_bytes(num_params, kind) < config.mirrored_fallback_bytes
        ):
            return
        raise NotImplementedError(registry.refusal(type(self), config.stage))

    def _zero3_build(self, variables: list, strategy, runtime, config: ZeroConfig) -> None:
        """Stage 3: the variables are ShardedVariables; the optimizer shard of a replica is
        its shards of every variable (:func:`~zero_runtime.optim.layout.layout_from_sharded`).

        Gradient accumulation and clipping at stage 3 are done by the train step
        (:mod:`zero_runtime.stage3.accumulation`, :mod:`zero_runtime.stage3.clipping`).

        Raises:
            NotImplementedError: ``use_ema`` with a row-paged embedding table
                (:meth:`~.ema.ShardEma._zero_ema_refuse`).
        """
        self._zero_ema_refuse(variables, config, 3, _workers(strategy))
        self._zero_keras_build(_BaseOptimizer.build, variables)
        with tf.init_scope():
            devices = tuple(strategy.extended.worker_devices)
            layout = layout_from_sharded(self._zero3_variables, strategy.num_replicas_in_sync)
            store = self._zero_make_store(config, layout, devices)
            self._zero = ZeroOptimizerState(config, 3, layout, store, None, devices, (), runtime)
            self._zero_attach_journals()
            if runtime is not None:
                runtime.register_optimizer(self)
        # tf.train.Checkpoint(optimizer=...) saves the states gathered (keras_saving).
        self._zero_checkpoint_states = TrackedZeroStates(self)

    def _var_key(self, variable):
        if isinstance(variable, ShardedVariable):
            return id(variable)  # Keras's TF key reads .value, which would gather
        return super()._var_key(variable)

    def _zero_make_store(self, config: ZeroConfig, layout: FlatLayout, devices: tuple[str, ...]):
        tier = config.offload_optimizer
        if tier == "none":
            return DeviceOptimizerState(layout, self._zero_store_slots(), devices)
        if tier == "nvme":
            store = NvmeOptimizerState(
                layout,
                self._zero_store_slots(),
                nvme_path=str(config.nvme_path),
                sub_group_size=config.sub_group_size,
                page_size_bytes=config.page_size_bytes,
                host_budget_bytes=config.optimizer_host_budget_bytes,
                nvme_budget_bytes=config.nvme_budget_bytes,
                prefix=f"{type(self).__name__}{next(_OPTIMIZER_IDS)}",
            )
            owner = resources_of(self._distribution_strategy)  # strategy.close() closes it
            if owner is not None:
                owner.adopt(store, ClosePhase.OPTIMIZER_STATES, f"{self.name} NVMe states")
            return store
        if config.offload_optimizer_ratio < 1.0:  # partial offload (stages 1-2, config)
            split = SplitOptimizerState(
                layout, self._zero_slots, devices, config.offload_optimizer_ratio
            )
            owner = resources_of(self._distribution_strategy)  # stops its worker threads
            if owner is not None:
                owner.adopt(split, ClosePhase.OPTIMIZER_STATES, f"{self.name} split states")
            return split
        return HostOptimizerState(layout, self._zero_store_slots())

    @property
    def zero_state(self) -> ZeroOptimizerState | MirroredOptimizerState:
        """The ZeRO state; in fallback mode (stage 0, or below ``mirrored_fallback_bytes``)
        the :class:`~zero_runtime.optim.mirrored.MirroredOptimizerState` the runtime
        accounts (stage 0). Raises AttributeError before ``build`` (or in fallback mode
        without a runtime)."""
        if self._zero is not None:
            return self._zero
        if self._zero_mirrored is not None:
            return self._zero_mirrored
        raise AttributeError("the optimizer is not built, or runs as stock without a runtime")

    @property
    def host_state(self):
        """The optimizer-state store (host, NVMe or device; AttributeError before build)."""
        return self.zero_state.store

    @property
    def flat_layout(self) -> FlatLayout:
        """The flat layout of the trainable variables (available after ``build``)."""
        return self.zero_state.layout

    @property
    def fallback_mirrored(self) -> bool:
        """True when the model was small enough to run the stock (mirrored) update."""
        return self._zero_fallback

    # -- the step ------------------------------------------------------------------------
    def apply(self, grads: list, trainable_variables: list | None = None):
        """Keras's ``apply``, with ``tf.IndexedSlices`` gradients densified first.

        The ZeRO update works on the dense summed gradient; densifying before Keras's
        clipping also makes ``global_clipnorm`` use the norm of the dense gradient (Keras's
        norm of an IndexedSlices with duplicate indices counts the duplicates separately).
        In fallback mode the gradients are passed through unchanged (stock Keras). At
        stage 3 a variable the loop read before the model was sharded stands for its
        sharded variable (:func:`~zero_runtime.sharded_variable.resolve`).
        """
        if trainable_variables is not None:
            trainable_variables = [resolve(v) for v in trainable_variables]
        if not self.built and trainable_variables is not None:
            # Build before deciding (the fallback is decided in build): every replica must
            # trace the same collectives, so none may densify while another does not.
            trainable_variables = list(trainable_variables)
            self.build(trainable_variables)
        if self._zero is not None and self._zero.stage == 3 and tf.inside_function():
            # A custom loop's apply_gradients at stage 3: the gradients are the reduced
            # shards the user's tape returned (zero_runtime/stage3/units_path.py).
            variables = list(trainable_variables or self._trainable_variables)
            sharded = getattr(variables[0], "_zero_sharded_model", None) if variables else None
            if sharded is not None and tf.distribute.get_replica_context() is not None:
                return sharded.apply_user_gradients(self, list(grads), variables)
        if not self._zero_fallback:
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        with iteration_gate():  # closed after Keras's iterations.assign_add(1)
            result = super().apply(grads, trainable_variables)
        if self._zero_mirrored is not None and tf.inside_function():
            ctx = tf.distribute.get_replica_context()
            if ctx is not None:  # the stock update ran: this replica's step has ended
                self._zero_mirrored_tick_op(replica_id())
        if self._zero is not None and self._zero.stage < 3 and tf.inside_function():
            ctx = tf.distribute.get_replica_context()
            if ctx is not None:  # commit this replica's step once iterations moved
                self._zero_commit_op(replica_id(), tf.constant(0))
        return result

    def _zero_mirrored_tick_op(self, replica: int) -> None:
        """Trace the host call that tells the runtime replica ``replica`` finished the
        stock update of step ``iterations - 1`` (read after Keras's increment)."""
        step = tf.identity(self._iterations) - 1
        host_function(
            functools.partial(self._zero_mirrored_tick, replica=replica),
            [step],
            tf.int64,
            stateful=True,
            name="zero_step_clock",
        )

    def _zero_mirrored_tick(self, step: np.ndarray, replica: int) -> np.int64:
        runtime = self._zero_mirrored.runtime if self._zero_mirrored is not None else None
        if runtime is not None:
            runtime.on_shard_updated(self, replica, int(step), 0.0)
        return np.int64(step)

    def _zero_step(self) -> tf.Tensor:
        """The optimizer step (0-based): ``iterations // N``, int64."""
        n = self._zero.accumulation_steps if self._zero is not None else 1
        return self._iterations // n if n > 1 else self._iterations

    def _zero_learning_rate(self):
        schedule = self._learning_rate
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            return schedule(self._zero_step())
        return self.learning_rate

    # Subclass hooks ---------------------------------------------------------------------
    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        raise NotImplementedError

    def _zero_host_step(self, slots, scratch, param, grad, scalars) -> None:
        raise NotImplementedError

    def _zero_device_delta(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        """TensorFlow ops of one step on a device shard: update the state ``slots`` and
        return ``u``, float32 of ``param``'s shape, with the new parameters ``param - u``
        (``u`` is 0 where ``mask``, a bool tensor or None for all, is False)."""
        raise NotImplementedError

    def _zero_device_step(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        """The new parameter shard, ``param - u`` (:meth:`_zero_device_delta`). Bitwise
        Keras's ``update_step``: each subclass's ``u`` is Keras's own expression, negated
        exactly where Keras adds (``p - (-x) == p + x`` in IEEE arithmetic), and
        ``p - 0 == p`` where ``mask`` is False. The split update (Twin-Flow,
        :mod:`.split_state`) takes ``u`` itself so that a CPU host call can write
        ``param - u`` straight into its output buffer (no copy of the device part).

        ``scalars`` are :meth:`~.ema.ShardEma._zero_step_scalars`'s: with ``use_ema`` the
        average of the whole shard follows (:meth:`~.ema.ShardEma._zero_ema_device`),
        and the shard returned is the average on an overwrite step."""
        own, ema = self._zero_split_scalars(scalars)
        new = param - self._zero_device_delta(slots, param, grad, own, mask)
        return new if ema is None else self._zero_ema_device(slots, new, ema)


def _workers(strategy) -> int:
    """Worker processes of ``strategy``'s job (1 without a cluster)."""
    cluster = getattr(strategy, "cluster", None)
    return cluster.num_workers if cluster is not None else 1


def _refuse_outside_scope(strategy, variables: list) -> None:
    """Raise when ``variables`` (Keras variables) were not created in ``strategy``'s
    scope (a model built before ``with strategy.scope():``, its optimizer inside).

    At stages 0-2 each replica updates the replicated (mirrored) variables the scope
    creates; a plain variable has one copy, which the replicas' updates cannot assign.
    MirroredStrategy refuses such a model too (``fit``: 'Need to be inside "with
    strategy.scope()"'; a loop: a ``colocate_vars_with`` error).

    Raises:
        ValueError: naming the first such variable and the fix.
    """
    outside = [
        v
        for v in variables
        if not strategy.extended.variable_created_in_scope(getattr(v, "value", v))
    ]
    if outside:
        first = getattr(outside[0], "path", outside[0].name)
        raise ValueError(
            f"{len(outside)} of the {len(variables)} variables the optimizer is built over "
            f"were created outside strategy.scope() (first: {first!r}): create the model "
            "inside `with strategy.scope():` (as MirroredStrategy requires), and build or "
            "compile its optimizer there"
        )


def _keras_accumulation_refusal(optimizer, stage: int) -> str:
    """The message refusing Keras's own ``gradient_accumulation_steps`` at ZeRO stage
    ``stage`` (1-3). Keras applies the accumulated update inside a ``tf.cond`` (its
    ``BaseOptimizer.apply``), where the partitioned update's collectives and merge_call
    cannot run (stock Keras under ``MirroredStrategy`` fails there too, Keras 3.15); at
    stage 3 Keras would also keep a whole-shape accumulator per sharded variable. The
    runtime accumulates itself (``ZeroConfig.gradient_accumulation_steps``)."""
    n = optimizer.gradient_accumulation_steps
    return (
        f"{type(optimizer).__name__}(gradient_accumulation_steps={n}): Keras's own "
        f"gradient accumulation cannot run at ZeRO stage {stage} (Keras applies the "
        "update inside a tf.cond, where the partitioned update's collectives cannot run; "
        "under MirroredStrategy it fails as well). Accumulate with the runtime instead: "
        f"ZeroConfig(gradient_accumulation_steps={n}) (the average of {n} micro-batches, "
        "reduced once and applied as one step; learning-rate schedules and bias "
        "corrections count those steps), and build the optimizer without "
        "gradient_accumulation_steps"
    )


def _plain_variable(initial: tf.Tensor) -> tf.Variable:
    """A resource variable on the current device, outside the strategy's creator."""
    return resource_variable_ops.ResourceVariable(initial, trainable=False)


def _masked(mask, new: tf.Tensor, old: tf.Tensor) -> tf.Tensor:
    return new if mask is None else tf.where(mask, new, old)


def _masked_delta(mask, delta: tf.Tensor) -> tf.Tensor:
    """``delta`` where ``mask`` (None: everywhere), 0 elsewhere."""
    return delta if mask is None else tf.where(mask, delta, tf.zeros_like(delta))


class _AdamHost(_PartitionedUpdate):
    _zero_slots = ("momentum", "velocity")

    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        # Exactly Keras's Adam.update_step: alpha = lr * sqrt(1 - b2^t) / (1 - b1^t).
        if self.amsgrad:
            raise NotImplementedError("amsgrad=True is not supported by the partitioned Adam")
        lr = tf.cast(learning_rate, tf.float32)
        local_step = tf.cast(self._zero_step() + 1, tf.float32)
        beta_1_power = tf.pow(tf.cast(self.beta_1, tf.float32), local_step)
        beta_2_power = tf.pow(tf.cast(self.beta_2, tf.float32), local_step)
        alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        return [alpha]

    def _zero_host_step(self, slots, scratch, param, grad, scalars) -> None:
        (alpha,) = scalars
        kernels.adam_update(
            param,
            grad,
            slots["momentum"],
            slots["velocity"],
            np.float32(alpha),
            np.float32(1 - self.beta_1),
            np.float32(1 - self.beta_2),
            np.float32(self.epsilon),
            scratch[0],
            scratch[1],
        )

    def _zero_device_delta(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        # Keras's Adam.update_step, operation for operation, on the shard.
        (alpha,) = scalars
        m_var, v_var = slots["momentum"], slots["velocity"]
        m_old, v_old = m_var.read_value(), v_var.read_value()
        m = _masked(mask, m_old + (grad - m_old) * (1 - self.beta_1), m_old)
        v = _masked(mask, v_old + (tf.square(grad) - v_old) * (1 - self.beta_2), v_old)
        m_var.assign(m)
        v_var.assign(v)
        return _masked_delta(mask, (m * alpha) / (tf.sqrt(v) + self.epsilon))


@keras.saving.register_keras_serializable(package="zero_runtime")
class Adam(_AdamHost, keras.optimizers.Adam):
    """Keras ``Adam`` with ZeRO-partitioned state (stage 1 or 2, any offload tier).

    Same constructor and behaviour as ``keras.optimizers.Adam`` (Kingma & Ba, ICLR 2015)
    except ``amsgrad=True`` (raises ``NotImplementedError`` at the first step). Each
    replica holds ``2 * 4 * shard_size`` bytes of state (about ``8 * P / N`` for P float32
    parameters over N replicas) on the ``offload_optimizer`` tier.
    """


@keras.saving.register_keras_serializable(package="zero_runtime")
class AdamW(_AdamHost, keras.optimizers.AdamW):
    """Keras ``AdamW`` (Loshchilov & Hutter, ICLR 2019) with partitioned state.

    Decoupled weight decay is applied by Keras to the variables before the update, as in
    the stock optimizer.
    """


@keras.saving.register_keras_serializable(package="zero_runtime")
class SGD(_PartitionedUpdate, keras.optimizers.SGD):
    """Keras ``SGD`` (optionally with momentum / Nesterov) with partitioned state.

    With ``momentum == 0`` no state is held; otherwise one float32 momentum buffer per
    shard (``4 * shard_size`` bytes per replica).
    """

    @property
    def _zero_slots(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum",) if self.momentum != 0 else ()

    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        return [tf.cast(learning_rate, tf.float32)]

    def _zero_host_step(self, slots, scratch, param, grad, scalars) -> None:
        (lr,) = scalars
        lr = np.float32(lr)
        if self.momentum != 0:
            kernels.sgd_momentum_update(
                param,
                grad,
                slots["momentum"],
                lr,
                np.float32(self.momentum),
                bool(self.nesterov),
                scratch[0],
                scratch[1],
            )
        else:
            kernels.sgd_update(param, grad, lr, scratch[0])

    def _zero_device_delta(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        # Keras's SGD.update_step on the shard (negated where Keras adds).
        (lr,) = scalars
        if self.momentum == 0:
            return _masked_delta(mask, grad * lr)
        momentum = tf.cast(self.momentum, tf.float32)
        m_var = slots["momentum"]
        m_old = m_var.read_value()
        m = _masked(mask, m_old * momentum - grad * lr, m_old)
        m_var.assign(m)
        if self.nesterov:
            return _masked_delta(mask, -(m * momentum - grad * lr))
        return _masked_delta(mask, -m)


register_partitioned(keras.optimizers.Adam, Adam, "adam", "Adam")
register_partitioned(keras.optimizers.AdamW, AdamW, "adamw", "AdamW")
register_partitioned(keras.optimizers.SGD, SGD, "sgd", "SGD")
