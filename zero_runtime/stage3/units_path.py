"""The units path of the stage-3 engine: shard a model's units and run its steps.

Every model runs by units (:mod:`zero_runtime.stage3.units` plans them,
:mod:`zero_runtime.stage3.gather` hooks their calls). :class:`UnitsPath` is the part of
:class:`~zero_runtime.stage3.engine.Stage3Engine` that does it: it replaces the units'
originals by ShardedVariables, hooks the units, and runs the traced forward/backward
and forward-only passes through the model's own call. An ``Embedding`` whose table is
row-paged (:mod:`zero_runtime.stage3.embedding`) is a unit of its own kind: its lookups
move only the rows they read, and its table's anchor gradient is the touched rows'.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf
from tensorflow.python.eager import tape as tape_lib  # no public "a variable was read"

from zero_runtime.comm.buckets import replica_barrier
from zero_runtime.sharded_variable import ShardedVariable, redirect
from zero_runtime.stage3 import checkpointing, device_plan, tiling
from zero_runtime.stage3.embedding import RowPagedEmbedding, row_paging_applies
from zero_runtime.stage3.gather import Unit, UnitRunner
from zero_runtime.stage3.schedule import ReadSchedule


class UnitsPath:
    """Shards ``model``'s units and runs its stage-3 passes.

    Args:
        engine: the :class:`~zero_runtime.stage3.engine.Stage3Engine` (its
            ``shard_variable``, devices, replicas, collective group).
        model: the built Keras model (its units' trainable weights are replaced in place).
        specs: the :class:`~zero_runtime.stage3.units.UnitSpec` plan of ``model``.
        remote: True when other workers hold some replicas' shards.

    Attributes:
        runner: the :class:`~zero_runtime.stage3.gather.UnitRunner` (the hooks).
        tile_plans: ``{id(kernel): TilePlan}`` of the units that run as tiles
            (:mod:`zero_runtime.stage3.tiling`).
        blocks: the :class:`~zero_runtime.stage3.checkpointing.CheckpointedBlock` hooks
            (empty unless ``activation_checkpointing``).
        row_paged: ``{unit index: RowPagedEmbedding}``: each ``Embedding`` whose table
            has at least ``embedding_row_paging_threshold`` elements
            (:func:`~zero_runtime.stage3.embedding.row_paging_applies`) is a row-paged
            unit: only the rows a step looks up move, and its touched rows are updated
            by :meth:`RowPagedEmbedding.apply_update` (lazily).

    Raises:
        NotImplementedError: a row-paged table owned by another layer too (tied weights),
            naming it and the fix.
    """

    def __init__(self, engine, model: keras.Model, specs, remote: bool):
        self.model = model
        # Memory-centric tiling (zero_runtime/stage3/tiling.py): a Dense/EinsumDense whose
        # kernel exceeds the tile budget runs as column tiles, which read its shards'
        # rows: such a kernel is split along axis 0 (others along their least padded).
        config = engine.config
        tile_size = device_plan.tile_budget(config)
        paged = _row_paged_specs(specs, config)
        self.row_paged: dict[int, RowPagedEmbedding] = {}
        for spec in paged:  # only the rows a step looks up move (stage3/embedding.py)
            old = spec.layer.embeddings
            self.row_paged[spec.index] = RowPagedEmbedding(
                spec.layer,
                engine.pool,
                engine.num_shards,
                config,
                local_replicas=engine.local_replicas,
                gather_remote=engine._gather_remote if remote else None,  # noqa: SLF001
            )
            replace_variable(model, old, self.row_paged[spec.index].table)
        sharded: dict[int, ShardedVariable] = {}
        for spec in specs:
            if spec.index in self.row_paged:
                continue
            for v in spec.originals:
                if id(v) in sharded:  # owned by two units: sharded once
                    continue
                kwargs = {}
                if tile_size is not None and math.prod(v.shape) > tile_size:
                    kwargs["shard_dim"] = 0
                # Device tier: each shard a variable on its replica's device, read and
                # updated in the step's graph (no host call; the pool reserves its pages).
                sharded[id(v)] = engine.shard_variable(v, remote, devices=engine.devices, **kwargs)
                replace_variable(model, v, sharded[id(v)])
        units = []
        for s in specs:
            if s.index in self.row_paged:
                call = s.layer.__dict__.get("call") or type(s.layer).call.__get__(s.layer)
                units.append(Unit(s.index, s.layer, (), call, rows=self.row_paged[s.index]))
                continue
            variables = tuple(sharded[id(v)] for v in s.originals)
            if _holds_other_units(s, specs):  # its own weights: read per use (Unit.hooked)
                units.append(Unit(s.index, s.layer, variables, None, None, hooked=False))
                continue
            plan = tiling.plan_tiles(s.layer, variables, tile_size)
            call = s.layer.__dict__.get("call") or type(s.layer).call.__get__(s.layer)
            tiles = None if plan is None else tiling.TiledCall(plan)
            units.append(Unit(s.index, s.layer, variables, call, tiles))
        self.tile_plans = {id(u.tiles.plan.kernel): u.tiles.plan for u in units if u.tiles}
        self.runner = UnitRunner(tuple(units), engine.group, engine.num_shards, replica_id)
        # NVMe shards: each traced pass's reads recorded, each read prefetching the next.
        self.schedule = ReadSchedule(
            engine.pool, engine.tier, lambda: engine.config, engine.local_replicas
        )
        self.runner.schedule = self.schedule
        # Activation checkpointing (zero_runtime/stage3/checkpointing.py): each block keeps
        # only its inputs and is recomputed in backward.
        self.blocks: list = []
        if config.activation_checkpointing:
            layers = checkpointing.plan_blocks(model, [u.layer for u in units])
            self.blocks = [checkpointing.CheckpointedBlock(b, self.runner) for b in layers]
        # The model's own call, taken after the hooks (a model owning weights is a unit).
        self._own_call = model.__dict__.get("call") or type(model).call.__get__(model)

    def forward_backward(self, x, loss_fn, training: bool, update=None):
        """The traced forward and backward on this replica: the model's own call, every
        unit use gathered and reduce-scattered by the runner.

        Args:
            x: the replica's input batch.
            loss_fn: ``y_pred -> scalar loss`` (runs under the tape).
            training: passed to the model's call.
            update: a :class:`~zero_runtime.optim.backward_update.BackwardShardUpdate` of
                this replica, or None (default): the update after the whole backward.
                Given, an original read by one use only is updated as soon as that use's
                gradient shard is reduced (its backward is the step's last read of it);
                the others (tied, in control flow, tiled, unused) after the backward
                (:meth:`~zero_runtime.stage3.gather.UnitRunner.backward_split`).

        Returns:
            ``(y_pred, loss, grads)``: without ``update``, ``grads`` ``{id(variable):
            float32 [shard_elements]}``, the replica's reduced gradient shard of every
            original; with it, a float32 scalar 0.0 that exists once every update is
            queued.
        """
        replica, anchors = self.runner.begin(tf.nest.flatten(x)[0], backward=True, update=update)
        tables = self.runner.table_anchors(replica)
        self.schedule.begin(replica)
        try:
            done = self.runner.done_anchor(replica)
            with tf.GradientTape() as tape:
                tape.watch(anchors + tables)
                if done is not None:
                    tape.watch(done)
                y_pred = self.model(x, training=training)
                loss = loss_fn(y_pred)
            if update is not None:
                token = self._backward_with_updates(tape, loss, replica, anchors, update)
                replica_barrier()  # as below
                return y_pred, loss, token
            shards = tape.gradient(
                loss, anchors + tables, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
            self._keep_row_gradients(replica, shards[len(anchors) :])
            shards = [_shard_shaped(g, v) for g, v in zip(shards, self.runner.variables)]
            # Every replica's forward and backward traced before any replica's update:
            # the units' collectives are raw (no merge_call), and without this barrier
            # replica 0's update host calls were traced before replica 1's loss, whose
            # Assert (an unknown batch dimension) automatic control dependencies then
            # chained after them: a deadlock (docs/stages/index.md, "Dimensions unknown").
            replica_barrier()
        finally:
            self.runner.end(replica)
            self.schedule.end(replica)
        return y_pred, loss, {id(v): g for v, g in zip(self.runner.variables, shards)}

    def _backward_with_updates(self, tape, loss, replica: int, anchors: list, update):
        """The backward of a step that updates during backward; returns the token of
        every update (float32 scalar 0.0)."""
        runner = self.runner
        by_id = {id(v): a for v, a in zip(runner.variables, anchors)}
        early, late = runner.backward_split(replica)
        tables = runner.table_anchors(replica)
        gs = tape.gradient(
            loss,
            [runner.done_anchor(replica), *(by_id[id(v)] for v in late), *tables],
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        self._keep_row_gradients(replica, gs[len(gs) - len(tables) :])
        gs = gs[: len(gs) - len(tables)]
        token, grads = gs[0], [_shard_shaped(g, v) for g, v in zip(gs[1:], late)]
        # An early original whose use's backward was never traced (its output does not
        # reach the loss) gets a zero gradient, as Mirrored's optimizer would.
        done = runner.updated_in_backward(replica)
        missed = [v for v in early if id(v) not in done]
        grads += [tf.zeros([v.shard_elements], tf.float32) for v in missed]
        rest = late + missed
        if rest:
            token = token + update.update(rest, tf.concat(grads, axis=0), token)
        return token

    def _keep_row_gradients(self, replica: int, grads: list) -> None:
        """Hand each row-paged table its anchor's gradient of the step (the touched
        rows', float32 ``(K, C)``), which :meth:`RowPagedEmbedding.apply_update` takes."""
        for emb, g in zip(self.row_paged.values(), grads):
            emb.keep_gradient(replica, g)

    def user_forward(self, x, training: bool):
        """The model's call under a user's own ``tf.GradientTape`` (a custom loop's
        ``train_step`` in ``strategy.run``), on this replica.

        The replica's first call of the step begins a training step of the runner (every
        original gets its gradient anchor) and tells the recording tapes that each
        sharded variable was read (``tape.variable_accessed``): the tape watches its
        anchor, which is what ``ShardedVariable.handle`` returns inside the step, so
        ``tape.gradient(loss, model.trainable_variables)`` runs every use's backward and
        returns each variable's reduced gradient shard (float32 ``[shard_elements]``,
        summed over replicas and uses; ZeRO, SC20, section 5.3). Later calls in the same
        step (a GAN's discriminator on real and generated data, micro-batches) add uses.
        The step ends when the optimizer applies the gradients (:meth:`user_end`).

        Returns:
            The model's outputs.
        """
        runner = self.runner
        if not runner.user_step():
            replica, _ = runner.begin(tf.nest.flatten(x)[0], backward=True, user=True)
            self.schedule.begin(replica)
        for v in runner.variables + runner.tables:
            tape_lib.variable_accessed(v)
        runner.record_user_anchors()  # tf.clip_by_global_norm tells its shards (shard_norm.py)
        return self._model_call(x, training)

    def user_end(self, replica: int) -> None:
        """End the replica's user step (after its update is traced)."""
        self.runner.end(replica, applied=True)
        self.schedule.end(replica)

    def forward(self, x, training: bool):
        """Forward only on this replica (evaluate, predict; or the model's call inside
        :meth:`forward_backward`): the model's own call, its units gathered per use."""
        if self.runner.in_step():  # inside forward_backward
            return self._model_call(x, training)
        replica, _ = self.runner.begin(tf.nest.flatten(x)[0], backward=False)
        self.schedule.begin(replica)
        try:
            return self._model_call(x, training)
        finally:
            self.runner.end(replica)
            self.schedule.end(replica)

    def _model_call(self, x, training: bool):
        """The model's own call (its units hooked), with ``training`` if it takes it."""
        kwargs = {"training": training} if self.model._call_has_training_arg else {}  # noqa: SLF001
        return self._own_call(x, **kwargs)


def replica_id() -> int:
    """The static replica id of the current replica context.

    Raises:
        RuntimeError: outside replica context (stage-3 steps run in ``strategy.run`` or
            ``fit``), or with a replica id that is not static.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError("stage-3 steps run in replica context (strategy.run / fit)")
    rid = tf.get_static_value(ctx.replica_id_in_sync_group)
    if rid is None:
        raise RuntimeError("stage 3 needs a static replica id")
    return int(rid)


def replace_variable(layer: keras.layers.Layer, old, new) -> None:
    """Point every reference to ``old`` in ``layer`` and its sublayers at ``new``.

    Keras layers hold their weights as attributes (``Dense._kernel``), in their trackers'
    lists (``_trainable_variables``) and, under TensorFlow, in TensorFlow's checkpoint
    dependency records (a ``TrackedDict`` of names and a list of ``TrackableReference``
    pairs). All are rewritten in place, by identity, so that nothing keeps the replicated
    original alive once the sharded variable replaces it; a reference held elsewhere (a
    loop's ``train_vars`` read before sharding) becomes an alias of ``new``
    (:func:`~zero_runtime.sharded_variable.redirect`).
    """
    redirect(old, new)
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


def _row_paged_specs(specs, config) -> list:
    """The units of ``specs`` whose ``Embedding`` is row-paged under ``config``
    (:func:`~zero_runtime.stage3.embedding.row_paging_applies`).

    Raises:
        NotImplementedError: such a table owned by another unit's layer too (a tied
            weight: that layer would read it whole), naming both and the fix.
    """
    paged = [s for s in specs if row_paging_applies(s.layer, config)]
    for spec in paged:
        table = spec.layer.embeddings
        for other in specs:
            if other is not spec and any(v is table for v in other.originals):
                raise NotImplementedError(
                    f"stage 3: the embedding table {table.path!r} of {spec.layer.name!r} "
                    f"is row-paged ({math.prod(table.shape)} elements >= "
                    f"embedding_row_paging_threshold={config.embedding_row_paging_threshold})"
                    f" and owned by {other.layer.name!r} too (tied weights), which would "
                    "read it whole. Raise embedding_row_paging_threshold above the table's "
                    "elements, or untie it"
                )
    return paged


def _holds_other_units(spec, specs) -> bool:
    """True when ``spec``'s layer holds another unit's layer among its sublayers."""
    inner = {id(sub) for sub in spec.layer._flatten_layers(include_self=False)}  # noqa: SLF001
    return any(id(o.layer) in inner for o in specs if o is not spec)


def _shard_shaped(grad: tf.Tensor, variable) -> tf.Tensor:
    """An anchor's gradient as float32 ``[shard_elements]``: the reduced shard a use's
    backward returned, or zeros where no use reached the loss (the anchor is a scalar, so
    ``UnconnectedGradients.ZERO`` gives a scalar 0.0)."""
    if grad.shape.rank == 1:
        return grad
    return tf.zeros([variable.shard_elements], tf.float32)
