"""ShardedModel: a Keras model that trains a user's model under ZeRO stage 3 with ``fit``.

The user's model code is unchanged: it is built as usual inside ``strategy.scope()`` and
wrapped once, ``sharded = strategy.shard_model(model)`` (or ``ShardedModel(model)``).
The wrapper is an ordinary ``keras.Model`` subclass whose ``train_step`` is the stage-3
step of :class:`~zero_runtime.stage3.engine.Stage3Engine`; nothing in Keras is patched.
The wrapped model's trainable weights become ShardedVariables in place, so
``model.get_weights()`` / ``sharded.get_weights()`` and saving gather on demand.

Custom loops call ``strategy.run(sharded.train_step, args=(batch,))`` inside a
``tf.function`` after ``sharded.compile(optimizer=..., loss=...)`` and
``sharded.optimizer.build(sharded.trainable_variables)``.
"""

from __future__ import annotations

import functools
import logging

import keras
import numpy as np
import tensorflow as tf
from keras.src import tree
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils

from zero_runtime.comm.buckets import replica_barrier
from zero_runtime.lifecycle import host_function
from zero_runtime.optim import backward_update
from zero_runtime.optim.backward_update import BackwardShardUpdate
from zero_runtime.stage3 import autoshard, loss_scaling, shard_norm
from zero_runtime.stage3.accumulation import ShardAccumulator
from zero_runtime.stage3.clipping import clip_shards, clipping_active
from zero_runtime.stage3.engine import Stage3Engine
from zero_runtime.stage3.units_path import replica_id

log = logging.getLogger(__name__)


class ShardedModel(keras.Model):
    """Trains ``model`` with sharded parameters, unit by unit (ZeRO stage 3).

    Args:
        model: a built Keras model (Sequential, functional or subclassed), created
            inside the strategy's scope.
        strategy: the stage-3 :class:`~zero_runtime.strategy.ZeroInfinityStrategy`;
            default: the current strategy (``tf.distribute.get_strategy()``).

    Attributes:
        inner: the wrapped model (its weights are now ShardedVariables).
        engine: the :class:`Stage3Engine`.

    Raises:
        ValueError: not a stage-3 ZeroInfinityStrategy, or a model already sharded
            (passed to shard_model before); see also :class:`Stage3Engine`.

    Compile with a partitioned optimizer (``"adam"``, ``"adamw"``, ``"sgd"`` inside the
    scope) and any Keras loss; metrics work as in Keras. With optimizer states on the host
    or NVMe and neither accumulation nor clipping, each unit's parameter shards are
    updated during backward as soon as its gradient shard is reduced
    (:mod:`zero_runtime.optim.backward_update`; ``update_in_backward`` says which path
    the traced step took); otherwise after the whole backward. Gradient accumulation
    (``gradient_accumulation_steps``, :mod:`zero_runtime.stage3.accumulation`) and
    clipping (``clipnorm`` / ``global_clipnorm`` / ``clipvalue`` of the reduced gradient,
    :mod:`zero_runtime.stage3.clipping`) are done on gradient shards, and so is the
    loss scaling of a ``mixed_float16`` policy (Keras's ``LossScaleOptimizer`` around the
    partitioned optimizer: :mod:`zero_runtime.stage3.loss_scaling`; the update then runs
    after the backward, without accumulation). Every model runs by units (a Sequential,
    a DAG, nested or subclassed, tied weights, BatchNormalization;
    :mod:`zero_runtime.stage3.gather`); with the update in backward, an original read by
    one use is updated when that use's gradient shard is reduced, the others (tied, in
    control flow, tiled) after the whole backward. Not
    implemented at stage 3: EMA, accumulation or clipping with row-paged embedding
    tables, loss scaling with accumulation or row-paged embedding tables, a layer that
    owns weights and draws random numbers in its own ``call``.
    """

    def __init__(self, model: keras.Model, strategy=None, **kwargs) -> None:
        strategy = strategy or tf.distribute.get_strategy()
        config = getattr(strategy, "config", None)
        if config is None or config.stage != 3:
            raise ValueError("ShardedModel needs a ZeroInfinityStrategy with stage=3")
        if isinstance(model, ShardedModel) or getattr(model, "_zero_stage3_sharded", False):
            raise ValueError(
                f"model {model.name!r} is already sharded (by shard_model, or by its first "
                "fit/evaluate at stage 3): train the model itself, or the ShardedModel "
                "shard_model returned (its .inner is this model), instead of sharding twice"
            )
        super().__init__(name=kwargs.pop("name", f"{model.name}_zero3"), **kwargs)
        self.engine = Stage3Engine(model, strategy)
        self.inner = model
        for m in (model, self):  # not tracked attributes; read by strategy.run at stage 3
            object.__setattr__(m, "_zero_stage3_sharded", True)
        self.accumulator: ShardAccumulator | None = None  # built at the first step (N > 1)

        def inner_train_step(data):  # the stage-3 step with the user's model's compile state
            return self.train_step_for(model, data)

        # The user's own object trains at stage 3 too (model.fit, strategy.run(model.train_step)).
        autoshard.bind(
            model,
            inner_train_step,
            self.engine.forward,
            self.engine.in_step,
            wrap_train_function=self.engine.clock.wrap,
            user_forward=self.engine.user_forward,
        )
        tables = [e.table for e in self.engine.row_paged.values()]
        for v in self.engine.variables + tables:  # the optimizer's apply finds its step here
            object.__setattr__(v, "_zero_sharded_model", self)
        for name in ("fit", "train_on_batch", "evaluate", "predict"):  # recover on errors
            own = getattr(type(model), name).__get__(model)
            object.__setattr__(model, name, functools.partial(self._recovering, own))

    @property
    def update_in_backward(self) -> bool | None:
        """True when the traced train step updates each unit's shards during backward
        (zero_runtime/optim/backward_update.py), False when at the step's end, None
        before the first step is traced."""
        return self.engine.update_in_backward

    def make_train_function(self, force: bool = False):
        """Keras's, its ``train_function`` run under the engine's step clock
        (:meth:`~zero_runtime.stage3.step_clock.OutsideStepClock.wrap`)."""
        super().make_train_function(force)
        self.train_function = self.engine.clock.wrap(self.train_function, self)
        return self.train_function

    def call(self, inputs, training: bool | None = None):
        """Forward pass. In replica context with several replicas, unit by unit with
        gathers; otherwise the wrapped model (its weights gather on demand)."""
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1 and tf.inside_function():
            return self.engine.forward(inputs, training=bool(training))
        return self.inner(inputs, training=training)

    def train_step(self, data):
        """One stage-3 step on this replica's batch: forward/backward per unit use, the
        gradient shards' update, Keras's loss tracker and metrics (as Keras's train_step)."""
        return self.train_step_for(self, data)

    def train_step_for(self, trainer: keras.Model, data):
        """:meth:`train_step` with ``trainer``'s optimizer, loss, loss tracker and metrics:
        this wrapper's (``sharded.fit``) or the wrapped model's (``model.fit`` on the
        user's own object, which :func:`zero_runtime.stage3.autoshard.bind` points here)."""
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        opt = trainer.optimizer
        if not opt.built:
            with tf.init_scope():
                opt.build(self.trainable_variables)
        # mixed_float16: Keras's LossScaleOptimizer around the partitioned optimizer; the
        # tape differentiates the scaled loss, the update unscales and may skip the step
        # (zero_runtime/stage3/loss_scaling.py).
        lso, inner = loss_scaling.split(opt)
        loss_scaling.check_supported(lso, self.engine)

        def loss_fn(y_pred):
            loss = trainer._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            trainer._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss),
                sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0],
            )
            return loss if lso is None else lso.scale_loss(loss)

        replica = replica_id()
        # With host/NVMe optimizer states (and no accumulation, clipping or loss scaling)
        # each unit's shards are updated during backward (optim/backward_update.py).
        in_backward = backward_update.supported(opt)
        update = BackwardShardUpdate(opt, replica) if in_backward else None
        # Device tier under fit: no host call in the step; its boundary is reported from
        # Python after the call (zero_runtime/stage3/step_clock.py).
        outside = self.engine.clock.applies(inner)
        y_pred, _, grads = self.engine.forward_backward(x, loss_fn, training=True, update=update)
        # Row-paged embeddings update their touched rows first (their scalars read the
        # iteration before the dense update increments it); the dense update follows.
        sparse = [e.apply_update(opt, replica) for e in self.engine.row_paged.values()]
        sparse = [t for t in sparse if t is not None]
        if update is not None:
            done = update.finish([grads, *sparse])
        else:
            if sparse:
                with tf.control_dependencies(sparse):
                    grads = {k: tf.identity(g) for k, g in grads.items()}
            done = self._apply_gradients(opt, grads, replica, clock=not outside)
        end = done
        if not outside:
            with tf.control_dependencies([done]):
                end = host_function(
                    functools.partial(_end_step, self.engine, replica),
                    [done],
                    tf.int64,
                    stateful=True,
                )
        with tf.control_dependencies([end]):
            # Any output structure; a softmax/sigmoid output keeps its logits, which
            # Keras's crossentropy metrics compute from (stage3/gather.py, keras_logits).
            y_pred = tf.nest.map_structure(_identity_keeping_logits, y_pred)
        return trainer.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def apply_user_gradients(self, opt, grads: list, variables: list) -> tf.Tensor:
        """A custom loop's ``optimizer.apply_gradients`` at stage 3, on this replica.

        ``grads`` are what the user's tape returned for ``variables`` (each sharded
        variable's reduced gradient shard, float32 ``[shard_elements]``; a row-paged
        table's touched rows' gradient, float32 ``(K, C)``; or None: no gradient, taken
        as zeros), possibly changed by the user's code. The row-paged tables' touched
        rows are updated first (:meth:`RowPagedEmbedding.apply_update`). Every replica's
        forward and backward are traced before any update (a trace-time barrier), then
        accumulation, clipping and the update run as in :meth:`train_step`
        (:meth:`_apply_gradients`), the step's end is reported to the engine and the
        runtime (a host call: the step clock, telemetry, live tuning), and the replica's
        user step ends.

        Returns:
            The int64 optimizer step once the shards are written (-1 on a micro-step
            that only accumulated).

        Raises:
            ValueError: a gradient whose shape is not its variable's shard (a gradient
                computed outside the step's tape), naming the variable; gradients scaled
                by TensorFlow's own norm of shards
                (:func:`~zero_runtime.stage3.shard_norm.refuse_local_norm`).
            NotImplementedError: loss scaling with accumulation or a row-paged table
                (:func:`~zero_runtime.stage3.loss_scaling.check_supported`).
        """
        replica = replica_id()
        replica_barrier()  # as in UnitsPath.forward_backward
        given, rows = {}, {}
        for g, v in zip(grads, variables):
            if g is None:
                continue
            if getattr(v, "row_paged", False):  # the touched rows' (K, C): apply_update
                rows[id(v)] = g
                continue
            if isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            if g.shape.rank != 1 or g.shape[0] not in (None, v.shard_elements):
                raise ValueError(
                    f"stage 3: the gradient of {v.path!r} has shape {g.shape}, not the "
                    f"variable's shard ({v.shard_elements},): pass the gradients "
                    "tape.gradient returned inside the same step"
                )
            given[id(v)] = tf.cast(g, tf.float32)
        shard_norm.refuse_local_norm(list(given.values()))
        full = {
            id(v): given.get(id(v), tf.zeros([v.shard_elements], tf.float32))
            for v in self.engine.variables
        }
        # Every gather of the step (a persistent tape's later backward too) reads the
        # shards before they are updated.
        reads = [tf.reshape(r, [-1])[:1] for r in self.engine.runner.step_state().reads]
        # Row-paged tables first: their scalars read the iteration before the dense update
        # increments it (as in train_step).
        loss_scaling.check_supported(loss_scaling.split(opt)[0], self.engine)
        sparse = [
            e.apply_update(opt, replica, rows.get(id(e.table), tf.zeros([])))
            for e in self.engine.row_paged.values()
        ]
        with tf.control_dependencies(reads + [t for t in sparse if t is not None]):
            full = {k: tf.identity(g) for k, g in full.items()}
        done = self._apply_gradients(opt, full, replica, clock=True)
        with tf.control_dependencies([done]):
            end = host_function(
                functools.partial(_end_step, self.engine, replica), [done], tf.int64, stateful=True
            )
        self.engine.units.user_end(replica)
        return end

    def _apply_gradients(self, opt, grads: dict, replica: int, clock: bool = True) -> tf.Tensor:
        """Accumulate (N > 1), clip and apply the replica's reduced gradient shards
        (``clock``: see ``apply_shard_gradients``; without accumulation only); under a
        LossScaleOptimizer, unscale, clip and apply or skip (:mod:`.loss_scaling`).

        Returns the int64 optimizer step once the shards are written, or -1 on a
        micro-step that only accumulated (``iterations`` counts micro-steps, the optimizer
        ``iterations // N``) or a step skipped by loss scaling.

        Raises:
            NotImplementedError: accumulation or clipping with a row-paged embedding
                table (its touched rows are updated every micro-step, unclipped).
        """
        engine = self.engine
        n = engine.config.gradient_accumulation_steps
        lso, opt = loss_scaling.split(opt)
        # The variables the optimizer updates (a layer frozen after sharding is left out:
        # its gradient shard neither counts in a clipping norm nor is applied, as in Keras).
        variables = opt._zero3_variables  # noqa: SLF001
        if lso is not None:  # mixed_float16 (check_supported: n == 1, no row-paged tables)
            shards = [grads[id(v)] for v in variables]
            return loss_scaling.apply_scaled(
                lso, variables, shards, engine.group, clock, lambda: self._end_micro_step_op([])
            )
        clip = clipping_active(opt)
        if n == 1 and not clip:
            return opt.apply_shard_gradients(grads, clock=clock)
        if engine.row_paged:
            raise NotImplementedError(
                "stage 3: gradient accumulation and clipping are not implemented with "
                "row-paged embedding tables; raise embedding_row_paging_threshold"
            )
        sizes = [v.shard_elements for v in variables]
        flat = tf.concat([grads[id(v)] for v in variables], axis=0)  # (shard_size,)
        is_update = tf.equal((opt.iterations + 1) % n, 0)
        if n > 1:
            if self.accumulator is None or self.accumulator.shard_size != sum(sizes):
                self.accumulator = ShardAccumulator(
                    sum(sizes), n, engine.devices, engine.config.offload_optimizer
                )
            flat = self.accumulator.step(replica, flat, is_update)  # (acc + g) / N or 0
        pieces = clip_shards(tf.split(flat, sizes) if sizes else [], opt, engine.group)
        shards = {id(v): p for v, p in zip(variables, pieces)}
        if n == 1:
            return opt.apply_shard_gradients(shards, clock=clock)

        done = tf.cond(
            is_update,
            lambda: opt.apply_shard_gradients(shards, count=False),
            lambda: self._end_micro_step_op([flat]),
        )
        with tf.control_dependencies([done]):
            opt.iterations.assign_add(1)  # outside the cond: a mirrored update (merge_call)
            return tf.identity(done)

    @staticmethod
    def _end_micro_step_op(after: list[tf.Tensor]) -> tf.Tensor:
        """Graph, in a ``tf.cond`` branch without an update (a micro-step that only
        accumulated, or a step skipped by loss scaling): int64 -1 once ``after`` (the
        step's gradient tensors; none inside a branch taken on a predicate that reads
        them) exist. The pool's step closes at the next update."""
        with tf.control_dependencies(after):
            return tf.constant(-1, tf.int64)

    def get_config(self) -> dict:
        """Not serialisable as a wrapper: save ``sharded.inner`` (its weights gather)."""
        raise NotImplementedError("save the wrapped model (ShardedModel.inner) instead")

    def recover(self) -> dict[str, int]:
        """Make the model usable again after a step that raised part-way.

        Waits for unit updates the failed step had queued (they may still be writing
        parameter shards: :func:`zero_runtime.optim.backward_update.settle`), then
        returns every variable to SHARDED/RELEASED (:meth:`Stage3Engine.recover`), so
        the weights can be read, saved, restored or trained again. ``fit``,
        ``train_on_batch``, ``evaluate`` and ``predict`` call it when they raise; call it
        yourself after an error in a custom loop (``strategy.run(sharded.train_step)``).
        The parameters are then a mix: the units whose update ran are updated, the
        others not; restore a checkpoint to continue from a consistent state.

        Returns:
            ``{"updates_waited": n, "gathering": g, "gathered": m}``: queued updates
            waited for and (variable, replica) pairs reset from each state.
        """
        _, opt = loss_scaling.split(getattr(self, "optimizer", None))
        waited = backward_update.settle(opt) if opt is not None else 0
        counts = self.engine.recover()
        if waited or any(counts.values()):
            log.warning(
                "stage 3: recovered after a failed step: %d queued updates waited for, "
                "%d gathering and %d gathered variable shards reset",
                waited,
                counts["gathering"],
                counts["gathered"],
            )
        return {"updates_waited": waited, **counts}

    def fit(self, *args, **kwargs):
        """Keras's ``fit``; on an error, :meth:`recover` runs before it propagates."""
        return self._recovering(super().fit, *args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        """Keras's ``train_on_batch``; on an error, :meth:`recover` runs first."""
        return self._recovering(super().train_on_batch, *args, **kwargs)

    def evaluate(self, *args, **kwargs):
        """Keras's ``evaluate``; on an error, :meth:`recover` runs first."""
        return self._recovering(super().evaluate, *args, **kwargs)

    def predict(self, *args, **kwargs):
        """Keras's ``predict``; on an error, :meth:`recover` runs first."""
        return self._recovering(super().predict, *args, **kwargs)

    def _recovering(self, fn, *args, **kwargs):
        self.engine.check_open(f"{fn.__name__} {self.name!r}")
        try:
            return fn(*args, **kwargs)
        except BaseException:
            self.recover()
            raise

    def close(self) -> None:
        """Release what this model holds before its strategy closes; idempotent.

        Stops its optimizer's update threads (after their queued unit updates:
        :func:`zero_runtime.optim.backward_update.close`), then closes the engine's pool
        (prefetch and I/O threads, pages, NVMe slab file). The weights are lost (save a
        checkpoint first); ``fit``/``evaluate``/``predict`` then raise
        :class:`~zero_runtime.lifecycle.StrategyClosedError`. ``strategy.close()`` does
        this for every model of the strategy; the optimizer's state store is the
        strategy's too (closed by ``strategy.close()``).
        """
        _, opt = loss_scaling.split(getattr(self, "optimizer", None))
        if opt is not None:
            backward_update.close(opt)
        self.engine.close()


def _identity_keeping_logits(t: tf.Tensor) -> tf.Tensor:
    """``tf.identity(t)`` that keeps ``t._keras_logits`` (Keras's own attribute)."""
    out = tf.identity(t)
    logits = getattr(t, "_keras_logits", None)
    if logits is not None:
        out._keras_logits = logits  # noqa: SLF001
    return out


def _end_step(engine: Stage3Engine, replica: int, step: np.ndarray) -> np.int64:
    if int(step) < 0:  # a micro-step that only accumulated (_micro_step_end ran)
        return np.int64(step)
    engine.end_step(replica, int(step))
    return np.int64(step)
