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
import threading
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from zero_runtime import comm, estimator
from zero_runtime.config import ZeroConfig
from zero_runtime.optim import kernels
from zero_runtime.optim.device_state import DeviceOptimizerState
from zero_runtime.optim.host_state import HostOptimizerState
from zero_runtime.optim.layout import FlatLayout, layout_from_sharded
from zero_runtime.optim.nvme_state import NvmeOptimizerState
from zero_runtime.optim.transaction import StepJournals
from zero_runtime.sharded_variable import ShardedVariable, ShardState


def _is_deferred(variable) -> bool:
    """True for a Keras variable created without a value (``strategy.zero_init``)."""
    from zero_runtime.stage3.construction import is_deferred  # lazy: stage3 imports optim

    return is_deferred(variable)


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
        group: the raw-collective group for stage 2's reduce-scatter (None at stage 1).
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


class _PartitionedUpdate:
    """Mixin holding the ZeRO update; combine with a Keras optimizer class.

    Subclasses define ``_zero_slots`` (names of state buffers), ``_zero_scalars(lr)``,
    ``_zero_host_step(slots, scratch, param, grad, scalars)`` (numpy, in place, one tile)
    and ``_zero_device_step(slots, param, grad, scalars, mask)`` (TensorFlow ops).
    """

    _zero_slots: tuple[str, ...] = ()
    _zero: ZeroOptimizerState | None = None
    _zero_fallback: bool = False

    # -- building ------------------------------------------------------------------------
    def build(self, variables: list) -> None:
        """Create Keras's counters and the ZeRO state (or, below the fallback size, the
        stock optimizer's slot variables).

        Raises:
            NotImplementedError: ``amsgrad=True`` (Adam), or EMA with accumulation.
            ValueError: a variable built inside ``strategy.zero_init()`` has no value yet
                (the model was not passed through ``strategy.shard_model``).
            zero_runtime.memory.NvmePathError: ``offload_optimizer='nvme'`` with an
                unusable ``nvme_path``.
        """
        if self.built:
            return
        deferred = [v for v in variables if _is_deferred(v)]
        if deferred:
            raise ValueError(
                f"{len(deferred)} variable(s) (first: {deferred[0].path!r}) were built inside "
                "strategy.zero_init() and have no value until sharded: train the model "
                "returned by strategy.shard_model(model), not the model itself"
            )
        strategy = self._distribution_strategy
        runtime = getattr(strategy, "runtime", None)
        config = runtime.config if runtime is not None else ZeroConfig()
        if variables and all(isinstance(v, ShardedVariable) for v in variables):
            self._zero3_build(variables, strategy, runtime, config)
            return
        num_params = sum(int(np.prod(v.shape)) for v in variables if v.trainable)
        kind = estimator.optimizer_kind(self)
        if model_state_bytes(num_params, kind) < config.mirrored_fallback_bytes:
            self._zero_fallback = True
            super().build(variables)
            if runtime is not None:
                runtime.set_fallback_mirrored(True)
            return
        _BaseOptimizer.build(self, variables)
        with tf.init_scope():
            devices = tuple(strategy.extended.worker_devices)
            n = strategy.num_replicas_in_sync
            stage = 2 if config.stage >= 2 else 1
            layout = FlatLayout.from_variables(
                self._trainable_variables, n, bucket_size=config.reduce_bucket_size
            )
            store = self._zero_make_store(config, layout, devices)
            group = None
            if stage >= 2 or config.gradient_accumulation_steps > 1:
                impl = getattr(strategy, "reduce_scatter_impl", None)
                group = comm.CollectiveGroup.create(
                    devices, impl, timeout_seconds=config.collective_timeout_seconds
                )
            accumulators = []
            if config.gradient_accumulation_steps > 1:
                if self.use_ema:
                    raise NotImplementedError(
                        "use_ema with gradient_accumulation_steps > 1 is not supported"
                    )
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

    def _zero3_build(self, variables: list, strategy, runtime, config: ZeroConfig) -> None:
        """Stage 3: the variables are ShardedVariables; the optimizer shard of a replica is
        its shards of every variable (:func:`~zero_runtime.optim.layout.layout_from_sharded`).

        Gradient accumulation and clipping at stage 3 are done by the train step
        (:mod:`zero_runtime.stage3.accumulation`, :mod:`zero_runtime.stage3.clipping`).

        Raises:
            NotImplementedError: EMA (not implemented at stage 3).
        """
        if self.use_ema:
            raise NotImplementedError("stage 3 does not implement use_ema yet")
        _BaseOptimizer.build(self, variables)
        with tf.init_scope():
            devices = tuple(strategy.extended.worker_devices)
            layout = layout_from_sharded(self._zero3_variables, strategy.num_replicas_in_sync)
            store = self._zero_make_store(config, layout, devices)
            self._zero = ZeroOptimizerState(config, 3, layout, store, None, devices, (), runtime)
            self._zero_attach_journals()
            if runtime is not None:
                runtime.register_optimizer(self)

    @property
    def _zero3_variables(self) -> list:
        """Stage 3: the ShardedVariables this optimizer updates densely (row-paged
        embedding tables, ``row_paged``, update their touched rows themselves:
        zero_runtime/stage3/embedding.py)."""
        return [v for v in self._trainable_variables if not getattr(v, "row_paged", False)]

    def _var_key(self, variable):
        if isinstance(variable, ShardedVariable):
            return id(variable)  # Keras's TF key reads .value, which would gather
        return super()._var_key(variable)

    def apply_shard_gradients(self, grads: dict[int, tf.Tensor], count: bool = True) -> tf.Tensor:
        """Stage 3: update this replica's parameter shards with its reduced gradient shards.

        Runs in replica context (inside the stage-3 train step). The parameters stay
        partitioned: each replica reads its shards from the pool, updates them with the
        optimizer state on the ``offload_optimizer`` tier, and writes them back; nothing
        is all-gathered (ZeRO, SC20, section 5.3). Learning-rate schedules and AdamW's
        decoupled weight decay behave as Keras's (same operation order); the iteration
        counter is Keras's.

        Clipping is not done here: the stage-3 train step clips the reduced shards
        first (:func:`zero_runtime.stage3.clipping.clip_shards`).

        Args:
            grads: ``{id(variable): float32 [shard_elements]}``, the replica's reduced
                (summed over replicas) gradient shard of every trainable variable.
            count: increment ``iterations`` here (default True). False inside
                ``tf.cond`` (gradient accumulation), where the caller increments it after
                the cond (a mirrored variable's update is a ``merge_call``).

        Returns:
            An int64 scalar, the optimizer step, that exists once the shards are written.
        """
        zs = self._zero
        replica = _replica_id()
        order = self._zero3_variables
        grad_shard = tf.concat([grads[id(v)] for v in order], axis=0)  # (shard_size,)
        lr = self._zero_learning_rate()
        scalars = self._zero_scalars(lr)
        step = self._zero_step()
        wd = tf.cast(self.weight_decay if self.weight_decay else 0.0, tf.float32)
        lr32 = tf.cast(lr, tf.float32)
        if isinstance(zs.store, DeviceOptimizerState):
            param = tf.numpy_function(
                functools.partial(self._zero3_read, replica=replica, decay=True),
                [wd, lr32],
                tf.float32,
                stateful=True,
                name="zero3_read_shards",
            )
            param.set_shape([zs.layout.shard_size])
            new = self._zero_device_step(zs.store.slots(replica), param, grad_shard, scalars, None)
            done = tf.numpy_function(
                functools.partial(self._zero3_write, replica=replica),
                [step, new],
                tf.int64,
                stateful=True,
                name="zero3_write_shards",
            )
        else:
            done = tf.numpy_function(
                functools.partial(self._zero3_host_update, replica=replica),
                [step, grad_shard, wd, lr32, *scalars],
                tf.int64,
                stateful=True,
                name="zero3_host_update",
            )
        if not count:
            return done
        with tf.control_dependencies([done]):
            self._iterations.assign_add(1)
        return self._zero_commit_op(replica, done)

    def _zero3_read_shards(self, variables, replica: int, wd=None, lr=None) -> np.ndarray:
        """``replica``'s shards of ``variables`` (ShardedVariables), concatenated: float32
        ``[sum(v.shard_elements)]``. With ``wd`` and ``lr`` given (and a weight decay set)
        Keras's decoupled weight decay ``v - v * wd * lr`` is applied first to the
        variables it applies to (``_use_weight_decay``). Used by the end-of-step update
        (every variable) and the update in backward (one block's, backward_update.py)."""
        param = np.concatenate([v.read_shard(replica) for v in variables])
        journals = self._zero.journals
        if journals is not None:  # the step writes these shards: keep their old values
            journals.record_params(replica, tuple(variables), param.copy())
        if wd is not None and self.weight_decay:
            wd, lr = np.float32(wd), np.float32(lr)
            off = 0
            for v in variables:
                end = off + v.shard_elements
                if self._use_weight_decay(v):  # Keras: v - v * wd * lr
                    param[off:end] = param[off:end] - param[off:end] * wd * lr
                off = end
        return param

    def _zero3_write_shards(self, variables, replica: int, param: np.ndarray) -> None:
        """Write ``param`` (as :meth:`_zero3_read_shards` returned it, updated) back to
        ``replica``'s shards of ``variables``; a persistent gathered copy, now stale, is
        released first."""
        off = 0
        for v in variables:
            if v.state(replica) is ShardState.GATHERED:  # persistent copies go stale
                v.release(replica)
            v.write_shard(replica, param[off : off + v.shard_elements])
            off += v.shard_elements

    def _zero3_read(self, wd, lr, replica: int, decay: bool) -> np.ndarray:
        if not decay:
            return self._zero3_read_shards(self._zero3_variables, replica)
        return self._zero3_read_shards(self._zero3_variables, replica, wd, lr)

    def _zero3_write(self, step, param: np.ndarray, replica: int) -> np.int64:
        self._zero3_write_shards(self._zero3_variables, replica, param)
        if self._zero.runtime is not None:
            self._zero.runtime.on_shard_updated(self, replica, int(step), 0.0)
        return np.int64(step)

    def _zero3_host_update(self, step, grad, wd, lr, *scalars, replica: int) -> np.int64:
        zs = self._zero
        self._zero_begin(replica, int(step))
        try:
            param = self._zero3_read(wd, lr, replica=replica, decay=True)
            step_fn = functools.partial(self._zero_host_step, scalars=scalars)
            zs.store.update(
                replica, ((0, zs.layout.shard_size),), param, grad, step_fn, step=int(step)
            )
            return self._zero3_write(step, param, replica)
        except BaseException:
            self._zero_rollback(replica)
            raise

    # -- step transactions (zero_runtime.optim.transaction) -----------------------------
    def _zero_attach_journals(self) -> None:
        """Give an NVMe store's steps their journals (parameters at stage 3) and let the
        store settle uncommitted steps before it is read or overwritten from outside."""
        zs = self._zero
        if isinstance(zs.store, NvmeOptimizerState):
            zs.journals = StepJournals(self)
            zs.store.before_access = self.zero_settle

    def _zero_committed_step(self) -> int:
        """The committed optimizer step count now: ``iterations // N`` (host int)."""
        n = self._zero.accumulation_steps if self._zero is not None else 1
        return int(self._iterations.numpy()) // n

    def _zero_begin(self, replica: int, step: int) -> None:
        if self._zero.journals is not None:
            self._zero.journals.begin(replica, step)

    def _zero_rollback(self, replica: int) -> None:
        if self._zero.journals is not None:
            self._zero.journals.rollback(replica)

    def zero_settle(self) -> dict[int, str]:
        """Commit or roll back every local replica's uncommitted step now, by the step
        counter: a finished step whose ``iterations`` advanced commits, any other is rolled
        back (states and stage-3 parameter shards bitwise as before it). Run by
        ``ShardedModel.recover``, checkpoints, and reads of the states; a no-op without
        step transactions (states not on NVMe).

        Returns:
            ``{replica: 'commit' | 'rollback'}`` for the replicas that had one.
        """
        zs = self._zero
        if zs is None or zs.journals is None:
            return {}
        step = self._zero_committed_step()
        out = {}
        for replica in range(zs.layout.num_shards):
            if zs.store.uncommitted(replica) is not None or zs.journals.pending(replica):
                outcome = zs.journals.resolve(replica, step)
                if outcome is not None:
                    out[replica] = outcome
        return out

    def _zero_commit_op(self, replica: int, after: tf.Tensor) -> tf.Tensor:
        """Graph: after ``iterations`` was incremented, commit ``replica``'s step (a host
        call reading the counter). Returns ``after`` (identity) once it ran."""
        if self._zero.journals is None:
            return tf.identity(after)
        counter = tf.convert_to_tensor(self._iterations)  # read after the increment
        done = tf.numpy_function(
            functools.partial(self._zero_commit, replica=replica),
            [counter],
            tf.int64,
            stateful=True,
            name="zero_step_commit",
        )
        with tf.control_dependencies([done]):
            return tf.identity(after)

    def _zero_commit(self, counter: np.ndarray, replica: int) -> np.int64:
        n = self._zero.accumulation_steps
        self._zero.journals.resolve(replica, int(counter) // n)
        return np.int64(counter)

    def _zero_make_store(self, config: ZeroConfig, layout: FlatLayout, devices: tuple[str, ...]):
        tier = config.offload_optimizer
        if tier == "none":
            return DeviceOptimizerState(layout, self._zero_slots, devices)
        if tier == "nvme":
            return NvmeOptimizerState(
                layout,
                self._zero_slots,
                nvme_path=str(config.nvme_path),
                sub_group_size=config.sub_group_size,
                page_size_bytes=config.page_size_bytes,
                nvme_budget_bytes=config.nvme_budget_bytes,
                prefix=f"{type(self).__name__}{next(_OPTIMIZER_IDS)}",
            )
        return HostOptimizerState(layout, self._zero_slots)

    @property
    def zero_state(self) -> ZeroOptimizerState:
        """The ZeRO state (raises AttributeError before ``build`` or in fallback mode)."""
        if self._zero is None:
            raise AttributeError("the optimizer is not built, or runs as stock (fallback)")
        return self._zero

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
        In fallback mode the gradients are passed through unchanged (stock Keras).
        """
        if not self.built and trainable_variables is not None:
            # Build before deciding (the fallback is decided in build): every replica must
            # trace the same collectives, so none may densify while another does not.
            trainable_variables = list(trainable_variables)
            self.build(trainable_variables)
        if not self._zero_fallback:
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        gates = _GATES.__dict__.setdefault("open", [])
        depth = len(gates)
        try:
            result = super().apply(grads, trainable_variables)
        finally:
            while len(gates) > depth:  # closed after Keras's iterations.assign_add(1)
                gates.pop().__exit__(None, None, None)
        if self._zero is not None and self._zero.stage < 3 and tf.inside_function():
            ctx = tf.distribute.get_replica_context()
            if ctx is not None:  # commit this replica's step once iterations moved
                self._zero_commit_op(_replica_id(), tf.constant(0))
        return result

    def _zero_gate_tokens(self) -> list:
        """Tensors that must exist before Keras increments ``iterations`` this step (the
        host updates' outputs): :meth:`_zero_open_gate` makes the increment wait for them."""
        return _GATES.__dict__.setdefault("tokens", [])

    def _zero_open_gate(self) -> None:
        """Enter a control-dependency scope on this step's gate tokens; :meth:`apply`
        leaves it after Keras's ``iterations.assign_add(1)``, so a step whose host update
        raised does not count (and its states roll back, nvme_state.StepTransaction)."""
        tokens = self._zero_gate_tokens()
        if not tokens or not tf.inside_function():
            tokens.clear()
            return
        gate = tf.control_dependencies(list(tokens))
        tokens.clear()
        gate.__enter__()
        _GATES.__dict__.setdefault("open", []).append(gate)

    def _zero_step(self) -> tf.Tensor:
        """The optimizer step (0-based): ``iterations // N``, int64."""
        n = self._zero.accumulation_steps if self._zero is not None else 1
        return self._iterations // n if n > 1 else self._iterations

    def _zero_learning_rate(self):
        schedule = self._learning_rate
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            return schedule(self._zero_step())
        return self.learning_rate

    def _backend_apply_gradients(self, grads: list, trainable_variables: list) -> None:
        zs = self._zero
        self._zero_gate_tokens().clear()
        if zs is None or zs.accumulation_steps == 1:
            super()._backend_apply_gradients(grads, trainable_variables)
            self._zero_open_gate()
            return
        n_acc = zs.accumulation_steps
        lr = self._zero_learning_rate()
        by_pos = self._zero_by_pos(grads, trainable_variables)
        active = tuple(g is not None for g in by_pos)
        replica = _replica_id()
        acc = zs.accumulators[replica % len(zs.accumulators)]  # global id -> local record
        is_update = tf.equal((self._iterations + 1) % n_acc, 0)
        if zs.stage >= 2:
            shard = self._zero_reduce(self._zero_bucket_flats(by_pos), by_pos)

            def update():
                total = (shard + acc) / n_acc  # as Keras: (g + acc_g) / steps
                total = self._zero_clip_shard(total)
                self._zero_weight_decay(trainable_variables, lr)
                self._zero_apply_shard(total, active, lr, in_cond=True)
                acc.assign(tf.zeros_like(acc))
                return tf.constant(1)

            def accumulate():
                acc.assign_add(shard)
                return tf.constant(0)

        else:
            flat = tf.concat(self._zero_bucket_flats(by_pos), axis=0)  # (padded_total,)

            def update():
                total = (flat + acc) / n_acc
                grads_now = self._zero_unflatten(total, active)
                clipped = self._clip_gradients([g for g in grads_now if g is not None])
                it = iter(clipped)
                grads_now = [next(it) if g is not None else None for g in grads_now]
                self._zero_weight_decay(trainable_variables, lr)
                flats = self._zero_bucket_flats(grads_now)
                shard = self._zero_reduce(flats, grads_now, raw=True)
                self._zero_apply_shard(shard, active, lr, in_cond=True)
                acc.assign(tf.zeros_like(acc))
                return tf.constant(1)

            def accumulate():
                acc.assign_add(flat)
                return tf.constant(0)

        stepped = tf.cond(is_update, update, accumulate)
        tokens = self._zero_gate_tokens()
        tokens.clear()  # made inside the cond: the cond's output stands for them
        tokens.append(stepped)
        self._zero_open_gate()

    def _backend_update_step(self, grads: list, trainable_variables: list, learning_rate) -> None:
        if self._zero is None:
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        by_pos = self._zero_by_pos(grads, trainable_variables)
        active = tuple(g is not None for g in by_pos)
        shard = self._zero_reduce(self._zero_bucket_flats(by_pos), by_pos)
        self._zero_apply_shard(shard, active, learning_rate)

    # -- pieces of the step --------------------------------------------------------------
    def _zero_by_pos(self, grads: list, trainable_variables: list) -> list:
        """Gradients in layout order (None for variables without one), densified."""
        index = {id(_unwrap(v)): i for i, v in enumerate(self._trainable_variables)}
        by_pos: list[Any] = [None] * len(self._zero.layout.sizes)
        for g, v in zip(grads, trainable_variables):
            if g is not None:
                # Sparse gradients (tf.IndexedSlices from embedding lookups) are densified
                # per replica: the dense update of the summed gradient (see docs/parity.md).
                by_pos[index[id(_unwrap(v))]] = (
                    tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                )
        return by_pos

    def _zero_bucket_flats(self, by_pos: list) -> list[tf.Tensor]:
        """One padded float32 ``[n * piece_size_b]`` buffer per bucket, in bucket order."""
        layout = self._zero.layout
        flats = []
        for b in layout.buckets:
            parts = [
                tf.reshape(tf.cast(by_pos[i], tf.float32), [-1])
                if by_pos[i] is not None
                else tf.zeros([layout.sizes[i]], tf.float32)
                for i in range(b.var_start, b.var_end)
            ]
            pad = b.padded_size(layout.num_shards) - b.size
            if pad:
                parts.append(tf.zeros([pad], tf.float32))
            flats.append(tf.concat(parts, axis=0) if len(parts) > 1 else parts[0])
        return flats

    def _zero_unflatten(self, flat: tf.Tensor, active: tuple[bool, ...]) -> list:
        """Per-variable tensors (None where inactive) from a padded flat buffer."""
        layout = self._zero.layout
        return [
            tf.reshape(flat[off : off + size], shape) if on else None
            for off, size, shape, on in zip(layout.offsets, layout.sizes, layout.shapes, active)
        ]

    def _zero_reduce(
        self, bucket_flats: list[tf.Tensor], by_pos: list, raw: bool = False
    ) -> tf.Tensor:
        """Reduce the buckets (backward order) and return this replica's gradient shard,
        float32 ``[shard_size]`` (``raw``: the runtime's own collectives, inside tf.cond)."""
        zs = self._zero
        pieces = comm.reduce_buckets(
            list(reversed(bucket_flats)),
            scatter=zs.stage >= 2,
            group=zs.group,
            overlap=zs.config.overlap_comm,
            wait_for=[g for g in by_pos if g is not None],
            raw=raw,
        )
        pieces.reverse()  # bucket order == shard order
        return tf.concat(pieces, axis=0) if len(pieces) > 1 else pieces[0]

    def _zero_clip_shard(self, shard: tf.Tensor) -> tf.Tensor:
        """Clip a reduced gradient shard as Keras clips a gradient list, norms across shards.

        Used at stage 2 with accumulation, where no replica holds a full gradient: the
        global norm is ``sqrt(all_reduce(sum(shard ** 2)))`` (of the summed gradient, not
        of each replica's gradient as stock Keras under MirroredStrategy).

        Raises:
            NotImplementedError: ``clipnorm`` (per-variable norms across shards).
        """
        if self.clipnorm and self.clipnorm > 0:
            raise NotImplementedError(
                "clipnorm with stage 2 and gradient accumulation is not supported; "
                "use global_clipnorm or clipvalue"
            )
        if self.global_clipnorm and self.global_clipnorm > 0:
            sq = comm.all_reduce_sum_flat(
                tf.reshape(tf.reduce_sum(tf.square(shard)), [1]), self._zero.group
            )
            use_norm = tf.sqrt(sq[0])
            clip = tf.cast(self.global_clipnorm, tf.float32)
            scale = clip * tf.minimum(1.0 / use_norm, 1.0 / clip) + (use_norm - use_norm)
            return shard * scale
        if self.clipvalue and self.clipvalue > 0:
            return tf.clip_by_value(shard, -self.clipvalue, self.clipvalue)
        return shard

    def _zero_decays_in_update(self) -> bool:
        """True when the host update applies the weight decay itself (states on the host
        or NVMe, stages 1-2): Keras's own decay of the variables is then skipped."""
        zs = self._zero
        return zs is not None and zs.stage < 3 and not isinstance(zs.store, DeviceOptimizerState)

    def _apply_weight_decay(self, variables):
        if self._zero_decays_in_update():
            return  # in the update (_zero_host_update)
        return super()._apply_weight_decay(variables)

    def _zero_weight_decay(self, variables: list, learning_rate) -> None:
        """Keras's decoupled weight decay (``TFOptimizer._apply_weight_decay``:
        ``v -= v * wd * lr``) with the learning rate of the optimizer step rather than of
        the micro-step. Runs inside ``tf.cond``, where ``merge_call`` is not allowed, so
        each replica updates its own copy of the (mirrored) variable. Skipped when the
        host update applies it (:meth:`_zero_decays_in_update`)."""
        if self.weight_decay is None or self._zero_decays_in_update():
            return
        for variable in variables:
            variable = _unwrap(variable)
            if self._use_weight_decay(variable):
                local = _local_copy(variable)
                lr = tf.cast(learning_rate, local.dtype)
                wd = tf.cast(self.weight_decay, local.dtype)
                local.assign_sub(local * wd * lr)

    def _zero_apply_shard(
        self, grad_shard: tf.Tensor, active: tuple[bool, ...], lr, in_cond: bool = False
    ) -> None:
        """Update this replica's parameter shard with ``grad_shard``, all-gather the shards
        and assign the active variables (each replica its own copy when ``in_cond``:
        ``merge_call`` is not allowed inside ``tf.cond``; the values are identical)."""
        zs = self._zero
        layout = zs.layout
        n = layout.num_shards
        all_vars = [_unwrap(v) for v in self._trainable_variables]
        param_flats = self._zero_bucket_flats([tf.cast(v, tf.float32) for v in all_vars])
        pieces = [comm.shard_of(f, b.piece_size) for f, b in zip(param_flats, layout.buckets)]
        param_shard = tf.concat(pieces, axis=0) if len(pieces) > 1 else pieces[0]
        replica = _replica_id()
        scalars = self._zero_scalars(lr)
        step = self._zero_step()
        if isinstance(zs.store, DeviceOptimizerState):
            mask = None
            if not all(active):
                m = np.zeros(layout.shard_size, bool)
                for s, e in layout.active_ranges(replica, active):
                    m[s:e] = True
                mask = tf.constant(m)
            new_shard = self._zero_device_step(
                zs.store.slots(replica), param_shard, grad_shard, scalars, mask
            )
            with tf.control_dependencies([new_shard]):
                tf.numpy_function(
                    functools.partial(self._zero_tick, replica=replica),
                    [step],
                    Tout=tf.int64,
                    stateful=True,
                    name="zero_step_clock",
                )
        else:
            # AdamW's decoupled weight decay is applied here, in the update (not by Keras
            # on the variables first), so a step that fails leaves the weights untouched.
            decayed = tuple(
                on and self.weight_decay is not None and self._use_weight_decay(v)
                for on, v in zip(active, self._trainable_variables)
            )
            host_fn = functools.partial(
                self._zero_host_update, replica=replica, active=active, decayed=decayed
            )
            wd = tf.cast(self.weight_decay if self.weight_decay else 0.0, tf.float32)
            new_shard = tf.numpy_function(
                host_fn,
                [step, grad_shard, param_shard, wd, tf.cast(lr, tf.float32), *scalars],
                Tout=tf.float32,
                stateful=True,
                name="zero_host_update",
            )
            self._zero_gate_tokens().append(new_shard)
        new_shard.set_shape([layout.shard_size])
        gathered = comm.all_gather_flat(new_shard, zs.group if in_cond else None)
        rows = tf.reshape(gathered, [n, layout.shard_size])
        chosen = []
        for b in layout.buckets:
            bucket = tf.reshape(rows[:, b.shard_offset : b.shard_offset + b.piece_size], [-1])
            for i in range(b.var_start, b.var_end):
                if active[i]:
                    off = layout.offsets[i] - b.flat_offset
                    value = tf.reshape(bucket[off : off + layout.sizes[i]], layout.shapes[i])
                    chosen.append((value, all_vars[i]))
        if not chosen:
            return
        if in_cond:
            for value, var in chosen:
                local = _local_copy(var)
                local.assign(tf.cast(value, local.dtype))
            return

        def _assign(distribution, values_and_vars):
            for value, var in values_and_vars:
                distribution.extended.update(
                    var, lambda a, b: a.assign(tf.cast(b, a.dtype)), args=(value,), group=False
                )

        tf.__internal__.distribute.interim.maybe_merge_call(
            _assign, self._distribution_strategy, chosen
        )

    def _zero_tick(self, step: np.ndarray, replica: int) -> np.int64:
        if self._zero.runtime is not None:
            self._zero.runtime.on_shard_updated(self, replica, int(step), 0.0)
        return np.int64(step)

    def _zero_host_update(
        self,
        step: np.ndarray,
        grad: np.ndarray,
        param: np.ndarray,
        wd: np.ndarray,
        lr: np.ndarray,
        *scalars: np.ndarray,
        replica: int,
        active: tuple[bool, ...],
        decayed: tuple[bool, ...],
    ) -> np.ndarray:
        start = time.perf_counter()
        zs = self._zero
        param = np.array(param, dtype=np.float32, copy=True)
        if any(decayed):  # Keras: v - v * wd * lr, before the update
            wd, lr = np.float32(wd), np.float32(lr)
            for s, e in zs.layout.active_ranges(replica, decayed):
                param[s:e] = param[s:e] - param[s:e] * wd * lr
        ranges = zs.layout.active_ranges(replica, active)
        step_fn = functools.partial(self._zero_host_step, scalars=scalars)
        self._zero_begin(replica, int(step))
        zs.store.update(replica, ranges, param, grad, step_fn, step=int(step))
        if zs.runtime is not None:
            zs.runtime.on_shard_updated(self, replica, int(step), time.perf_counter() - start)
        return param

    # Subclass hooks ---------------------------------------------------------------------
    def _zero_scalars(self, learning_rate) -> list[tf.Tensor]:
        raise NotImplementedError

    def _zero_host_step(self, slots, scratch, param, grad, scalars) -> None:
        raise NotImplementedError

    def _zero_device_step(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        raise NotImplementedError


#: Per thread (each replica's function is traced on its own thread): the gate tokens of
#: the step being traced and the control-dependency scopes opened on them.
_GATES = threading.local()


def _unwrap(v):
    return v.value if isinstance(v, keras.Variable) else v


def _local_copy(variable):
    """This replica's component of a mirrored variable (the variable itself otherwise)."""
    get = getattr(variable, "_get_on_device_or_primary", None)
    return get() if get is not None else variable


def _replica_id() -> int:
    ctx = tf.distribute.get_replica_context()
    rid = tf.get_static_value(ctx.replica_id_in_sync_group)
    if rid is None:
        raise RuntimeError("the partitioned optimizer needs a static replica id")
    return int(rid)


def _plain_variable(initial: tf.Tensor) -> tf.Variable:
    """A resource variable on the current device, outside the strategy's creator."""
    return resource_variable_ops.ResourceVariable(initial, trainable=False)


def _masked(mask, new: tf.Tensor, old: tf.Tensor) -> tf.Tensor:
    return new if mask is None else tf.where(mask, new, old)


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

    def _zero_device_step(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        # Keras's Adam.update_step, operation for operation, on the shard.
        (alpha,) = scalars
        m_var, v_var = slots["momentum"], slots["velocity"]
        m_old, v_old = m_var.read_value(), v_var.read_value()
        m = _masked(mask, m_old + (grad - m_old) * (1 - self.beta_1), m_old)
        v = _masked(mask, v_old + (tf.square(grad) - v_old) * (1 - self.beta_2), v_old)
        m_var.assign(m)
        v_var.assign(v)
        return _masked(mask, param - (m * alpha) / (tf.sqrt(v) + self.epsilon), param)


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

    def _zero_device_step(self, slots, param, grad, scalars, mask) -> tf.Tensor:
        # Keras's SGD.update_step on the shard.
        (lr,) = scalars
        if self.momentum == 0:
            return _masked(mask, param - grad * lr, param)
        momentum = tf.cast(self.momentum, tf.float32)
        m_var = slots["momentum"]
        m_old = m_var.read_value()
        m = _masked(mask, m_old * momentum - grad * lr, m_old)
        m_var.assign(m)
        if self.nesterov:
            return _masked(mask, param + (m * momentum - grad * lr), param)
        return _masked(mask, param + m, param)


#: Keras optimizer identifiers that the strategy maps to partitioned optimizers.
PARTITIONED_BY_NAME: dict[str, type] = {
    "adam": Adam,
    "Adam": Adam,
    "adamw": AdamW,
    "AdamW": AdamW,
    "sgd": SGD,
    "SGD": SGD,
}
