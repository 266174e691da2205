"""A unit's use in a stage-3 step: gather -> views -> the layer's own call -> release.

Every unit (:mod:`zero_runtime.stage3.units`) runs its ``call`` through
:meth:`UnitRunner.hooked_call`, installed as an instance attribute of the layer (no Keras
class is patched; :meth:`UnitRunner.remove` takes it away). Per use, on each replica:

- forward: the unit's shards are read (one host call: their pages, any tier), one
  all-gather of the concatenated shards (:func:`zero_runtime.comm.all_gather_flat`),
  and the gathered flat buffer is cut into per-original **views** (TF tensors, never
  back through Python). The layer's own ``call`` runs under
  ``keras.StatelessScope(state_mapping=...)`` with the views in place of its weights and
  the current values of its non-trainable state; the state updates the call makes
  (BatchNormalization's moving statistics) are assigned once, after the use, as Keras
  would have. The views are dropped after the use (only the unit's inputs are kept).
- backward (``tf.custom_gradient``): gather again, recompute the call under a tape (its
  state updates discarded), and reduce-scatter the concatenated view gradients in one
  collective; the replica keeps the reduced gradient of its own shard of each original.
  A unit used several times (a layer called twice, a weight tied into two layers)
  reduce-scatters each use's contribution; they are summed per original (ZeRO, SC20,
  section 5.3; reduce-scatter is linear) as the gradients of its anchor (below).

A use inside a ``tf.cond`` / ``tf.while_loop`` branch or loop body gathers in the step's
own graph instead, before the control flow, once per step
(:func:`~zero_runtime.stage3.branch_use.use_in_branch`), and reduce-scatters the views'
gradient there after it: no collective runs inside control flow, so replicas whose
predicates differ still run the same collectives. The collectives themselves (read,
all-gather, views; reduce-scatter) are :mod:`zero_runtime.stage3.unit_comm`'s.

A sharded variable read outside its units' calls (a head that reads an embedding layer's
table) is gathered on that read as a one-variable use with the same backward
(:meth:`UnitRunner.read_outside`).

Every original has an *anchor* in the step: a float32 scalar zero that each use takes
as an input and whose gradient the use's backward returns as the reduced shard of its
gradient (float32 ``[shard_elements]``: graph mode does not check a custom gradient's
shape against its input's, and a scalar costs no device memory where zeros of every
shard's shape, all ready at the step's start, were live at once). ``tape.gradient(loss, anchors)``
then runs every use's backward and TensorFlow's own gradient aggregation sums the uses of
a tied weight (TF_NOTES section 5, the custom_gradient path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import keras
import tensorflow as tf

# Keras 3 exports no getter of the active autocast scope (the compute dtype a layer's
# ``__call__`` casts its float variables to under a mixed policy); these are Keras's own.
from keras.src.backend.common.variables import AutocastScope, get_autocast_scope
from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

from zero_runtime.lifecycle import host_function
from zero_runtime.sharded_variable import ShardedVariable
from zero_runtime.stage3.branch_use import use_in_branch
from zero_runtime.stage3.shard_norm import recorded_anchor
from zero_runtime.stage3.unit_comm import gather_views, reduce_scatter_variables


@dataclasses.dataclass(frozen=True)
class Unit:
    """A unit after sharding.

    Attributes:
        index: the unit's position in the plan.
        layer: the Keras layer whose ``call`` is hooked.
        variables: its sharded originals (one flat parameter: their shards concatenated).
        call: the layer's own ``call`` (bound), what the hook runs.
        tiles: a :class:`~zero_runtime.stage3.tiling.TiledCall` when the unit runs as
            column tiles (memory-centric tiling), else None (default).
        hooked: True (default) when the layer's ``call`` is hooked. False for a layer
            that also holds other units (``TokenAndPositionEmbedding`` owning a position
            table and an ``Embedding``): a use of it would nest their uses inside its
            ``tf.custom_gradient``, whose backward drops the nested units' gradients, so
            its call runs as is and each read of its own weights is a one-variable use
            (:meth:`UnitRunner.read_outside`).
        rows: a :class:`~zero_runtime.stage3.embedding.RowPagedEmbedding` when the unit
            is an ``Embedding`` whose table is row-paged (``variables`` is then empty:
            its table is never gathered whole, only the rows a step looks up move), else
            None (default).
    """

    index: int
    layer: keras.layers.Layer
    variables: tuple[ShardedVariable, ...]
    call: object
    tiles: object = None
    hooked: bool = True
    rows: object = None

    @property
    def shard_elements(self) -> int:
        """Elements of one replica's shard of the unit's flat parameter (float32)."""
        return sum(v.shard_elements for v in self.variables)


@dataclasses.dataclass
class _StepState:
    """One replica's trace-time state during one traced forward (with or without tape).

    ``anchors`` (``{id(v): float32 scalar zero}``) is None in a forward-only
    pass (evaluate, predict): no backward.
    """

    token: tf.Tensor
    anchors: dict[int, tf.Tensor] | None
    graph: object = None  # the graph the step's forward is traced in
    branch_views: dict = dataclasses.field(default_factory=dict)  # id(unit) -> views
    running: Unit | None = None  # the unit whose call runs in a use's custom_gradient
    # The update during backward (zero_runtime/optim/backward_update.py), None without:
    update: object = None  # the replica's BackwardShardUpdate
    done: tf.Tensor | None = None  # float32 scalar anchor: its gradient = the updates' token
    uses: dict = dataclasses.field(default_factory=dict)  # id(v) -> its custom_gradient uses
    use_vars: list = dataclasses.field(default_factory=list)  # each such use's originals
    shared: set = dataclasses.field(default_factory=set)  # id(v) used in a branch or as tiles
    updated: set = dataclasses.field(default_factory=set)  # id(v) queued during backward
    # The reduced shard of the use whose backward was traced last (UnitRunner._backward_dep).
    last_reduced: tf.Tensor | None = None
    # Row-paged tables looked up in this step (id(table)): one use per step each.
    row_uses: set = dataclasses.field(default_factory=set)
    # Inside an activation-checkpointed block (zero_runtime/stage3/checkpointing.py):
    # "normal" (default); "no_grad" (the block's forward: uses gather, call and drop, and
    # are counted); "recompute" (the block's call again in its backward: uses with
    # backward, not counted again, their state updates discarded).
    mode: str = "normal"
    # A user's own tf.GradientTape (a custom loop): the step began at the model's first
    # call and ends when the optimizer applies its gradients (UnitsPath.user_forward).
    user: bool = False
    # A user step's gathered views, one per gather: the update waits for them (a host
    # read is ordered by its input only, and a later backward's read, such as a
    # persistent tape's second gradient, must not see the updated shards).
    reads: list = dataclasses.field(default_factory=list)
    # A user step's anchors the tapes watch ({id(v): float32 scalar}; None before the
    # first model call): ``anchors`` then holds the recorded anchors the uses read
    # (UnitRunner.record_user_anchors).
    watched: dict | None = None
    # A user step whose gradients were applied (UnitRunner.end(applied=True)): kept
    # until the next step begins, so that a later backward through its uses is refused.
    applied: bool = False


class UnitRunner:
    """The hooks of every unit of one model and their per-replica step state.

    Args:
        units: the :class:`Unit` list.
        group: the engine's :class:`~zero_runtime.comm.CollectiveGroup`.
        num_shards: N, the replicas.
        replica_id: ``() -> int``, the static replica id of the current replica context.
    """

    def __init__(self, units: tuple[Unit, ...], group, num_shards: int, replica_id) -> None:
        self.units = units
        self.group = group
        self.num_shards = num_shards
        self._replica_id = replica_id
        self._steps: dict[int, _StepState] = {}
        self._outside: dict[int, Unit] = {}  # id(variable) -> its one-variable unit
        # The read schedule (stage3/schedule.py; UnitsPath sets it): NVMe prefetch.
        self.schedule = None
        self.regions: list = []  # checkpointed blocks' layers (their call hooked too)
        for unit in units:
            if unit.hooked:
                hook = functools.partial(self.hooked_call, unit)
                object.__setattr__(unit.layer, "call", hook)  # an instance attribute
        for v in self.variables:
            object.__setattr__(v, "_zero_outside_read", self.read_outside)
            object.__setattr__(v, "_zero_anchor", self.anchor)
        for t in self.tables:
            object.__setattr__(t, "_zero_outside_read", self._refuse_table_read)
            object.__setattr__(t, "_zero_anchor", self.anchor)

    @property
    def variables(self) -> list[ShardedVariable]:
        """Every sharded original once, in unit order."""
        seen, out = set(), []
        for unit in self.units:
            for v in unit.variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        return out

    @property
    def tables(self) -> list:
        """The row-paged tables (:class:`~zero_runtime.stage3.embedding.RowPagedTable`)
        of the row-paged units, in unit order; not in :attr:`variables`."""
        return [u.rows.table for u in self.units if u.rows is not None]

    def remove(self) -> None:
        """Take the hooks away (the layers run their own ``call`` again)."""
        for layer in [u.layer for u in self.units if u.hooked] + self.regions:
            layer.__dict__.pop("call", None)
        for v in self.variables + self.tables:
            v.__dict__.pop("_zero_outside_read", None)
            v.__dict__.pop("_zero_anchor", None)

    # -- step state --------------------------------------------------------------------
    def begin(
        self, token: tf.Tensor, backward: bool, update=None, user: bool = False
    ) -> tuple[int, list[tf.Tensor]]:
        """Start a traced forward on this replica.

        Args:
            token: any tensor of the step's input (a data dependency for the first reads).
            backward: True in a training step: every original gets its anchor.
            update: with ``backward``, a
                :class:`~zero_runtime.optim.backward_update.BackwardShardUpdate` of this
                replica, or None (default). Given, a use whose originals no other use
                reads (:meth:`backward_split`) hands its reduced gradient shard to it as
                soon as it is reduced, and its anchors get no gradient.
            user: True for a user's step (a custom loop's own tape; :attr:`_StepState.user`).

        Returns:
            The replica id and the anchors, in :attr:`variables` order (empty without
            ``backward``): the tape watches them, and their gradients are the replica's
            reduced gradient shards (float32 ``[shard_elements]`` each). The row-paged
            tables' anchors are :meth:`table_anchors`.
        """
        replica = self._replica_id()
        anchors = None
        if backward:
            # Scalars (the module docstring: no [shard_elements] zeros live at once).
            anchors = {id(v): tf.zeros([], tf.float32) for v in self.variables + self.tables}
        for unit in self.units:
            if unit.rows is not None:
                unit.rows.discard(replica)  # rows kept by an earlier trace
        update = update if backward else None
        self._steps[replica] = _StepState(
            tf.reshape(token, [-1])[:1],
            anchors,
            tf.compat.v1.get_default_graph(),
            update=update,
            done=None if update is None else tf.zeros([], tf.float32),
            user=user,
        )
        return replica, [anchors[id(v)] for v in self.variables] if anchors else []

    def table_anchors(self, replica: int) -> list[tf.Tensor]:
        """The replica's anchors of the row-paged tables, in :attr:`tables` order (empty
        in a forward-only pass): float32 scalars whose gradients are the touched rows'
        gradients, float32 ``(K, C)`` (:meth:`RowPagedEmbedding.use`)."""
        anchors = self._steps[replica].anchors
        return [anchors[id(t)] for t in self.tables] if anchors else []

    def step_state(self) -> _StepState:
        """The current replica's step state (inside a step only)."""
        return self._steps[self._replica_id()]

    @contextlib.contextmanager
    def mode(self, state: _StepState, mode: str):
        """Run the block inside in ``mode`` (``"no_grad"`` or ``"recompute"``, see
        :class:`_StepState`), then restore the previous mode."""
        before, state.mode = state.mode, mode
        try:
            yield
        finally:
            state.mode = before

    def done_anchor(self, replica: int) -> tf.Tensor | None:
        """The replica's float32 scalar whose gradient is the token of every update
        queued during backward (None without an update); the caller's tape watches it."""
        return self._steps[replica].done

    def backward_split(self, replica: int) -> tuple[list, list]:
        """After the replica's traced forward: ``(early, late)``, the originals whose
        shards are updated during backward (a use whose originals are each read by it
        alone, outside control flow and tiles: its backward is their last read of the
        step) and the rest
        (tied, used in a branch, a tiled unit's bias, or unused: their anchors'
        gradients, summed over their uses, are updated after the whole backward). A tiled
        kernel read by its tiled use alone is early: its first tile's backward, the last
        to run, completes its gradient shard (:mod:`zero_runtime.stage3.tiling`)."""
        state = self._steps[replica]
        ids = {id(v) for vs in state.use_vars if self._early(state, vs) for v in vs}
        early = [v for v in self.variables if id(v) in ids]
        return early, [v for v in self.variables if id(v) not in ids]

    def updated_in_backward(self, replica: int) -> set:
        """The ids of the originals whose update a traced backward queued."""
        return self._steps[replica].updated

    def update_now(self, replica: int, variables: tuple, shard: tf.Tensor) -> tf.Tensor | None:
        """In a use's backward: hand ``variables``' reduced gradient ``shard`` (float32
        ``[sum(shard_elements)]``) to the update during backward when this use is their
        only read of the step (:meth:`backward_split`), and return the update's token
        (float32 scalar, the gradient of the step's done anchor); None otherwise (the
        caller returns the shard as its anchors' gradient)."""
        state = self._steps[replica]
        if not self._early(state, variables):
            return None
        done = state.update.update(variables, shard, tf.zeros([]))
        state.updated.update(id(v) for v in variables)
        return done

    @staticmethod
    def _count_use(state: _StepState, variables: tuple) -> None:
        """Count one use of ``variables`` in a training step's forward (not again in a
        checkpointed block's recompute); :meth:`backward_split` reads the counts."""
        if state.anchors is not None and state.mode != "recompute":
            for v in variables:
                state.uses[id(v)] = state.uses.get(id(v), 0) + 1
            state.use_vars.append(variables)

    @staticmethod
    def _early(state: _StepState, variables) -> bool:
        return state.update is not None and all(
            state.uses.get(id(v)) == 1 and id(v) not in state.shared for v in variables
        )

    def end(self, replica: int, applied: bool = False) -> None:
        """End the replica's traced forward; ``applied``: a user step whose update is
        traced (its state stays until the next step begins: :meth:`gather` refuses a
        later backward through its uses)."""
        state = self._steps.pop(replica, None)
        if applied and state is not None:
            state.applied = True
            self._steps[replica] = state

    def in_step(self) -> bool:
        """True inside a traced forward of this runner on the current replica.

        A user's step (:attr:`_StepState.user`) left open by a trace that ended without
        applying gradients (a function that only computes them, or one that raised) is
        dropped here once the current graph is not the one it began in."""
        ctx = tf.distribute.get_replica_context()
        if ctx is None or not tf.inside_function():
            return False
        rid = tf.get_static_value(ctx.replica_id_in_sync_group)
        if rid is None or int(rid) not in self._steps:
            return False
        state = self._steps[int(rid)]
        if state.user and not _within(state.graph):
            del self._steps[int(rid)]
            return False
        return not state.applied

    def user_step(self) -> bool:
        """True inside a user's step (a custom loop's tape) on the current replica."""
        return self.in_step() and self.step_state().user

    def anchor(self, variable: ShardedVariable) -> tf.Tensor | None:
        """The current replica's gradient anchor of ``variable`` inside a user's step
        (``ShardedVariable.handle``: a tape's ``gradient`` over the variable is the
        gradient of this float32 scalar, the replica's reduced gradient shard, float32
        ``[shard_elements]``), else None."""
        if not self.user_step():
            return None
        state = self.step_state()
        anchors = state.watched if state.watched is not None else state.anchors or {}
        return anchors.get(id(variable))

    def record_user_anchors(self) -> None:
        """In a user step, after the tapes watched the anchors (each model call): the
        uses of this call read a recorded anchor of each sharded variable
        (:func:`~zero_runtime.stage3.shard_norm.recorded_anchor`), so the gradient shards
        the tape returns are known to ``tf.clip_by_global_norm``. A new one per call: a
        tape begun after an earlier call still sees its anchor read."""
        state = self.step_state()
        if state.watched is None:
            state.watched = dict(state.anchors)
        for v in self.variables:
            state.anchors[id(v)] = recorded_anchor(state.watched[id(v)], self.group)

    # -- the hooks -----------------------------------------------------------------------
    def hooked_call(self, unit: Unit, *args, **kwargs):
        """The unit layer's ``call``: a gathered use inside a step, else its own call."""
        if not self.in_step():
            return unit.call(*args, **kwargs)
        self._refuse_nested(unit.layer.name)
        if unit.rows is not None:
            return self._row_use(unit, args, kwargs)
        if unit.tiles is not None and unit.tiles.applies(args, kwargs):
            # Inside tf.cond / tf.while_loop the unit is gathered whole before the control
            # flow (branch_use.use_in_branch): tiles run outside control flow only.
            state = self._steps[self._replica_id()]
            if not _inside_control_flow(state.graph):
                # The kernel is one use (updated during backward once its last tile's
                # gradient is reduced, when no other use reads it); the other variables
                # (the bias) get a gradient from every tile, summed after the backward.
                kernel = unit.tiles.plan.kernel
                state.shared.update(id(v) for v, _ in unit.tiles.plan.others)
                self._count_use(state, (kernel,))
                return unit.tiles(self, unit, args[0], kwargs)  # zero_runtime/stage3/tiling.py
        return self._use(unit, (args, kwargs), lambda a: unit.call(*a[0], **a[1]))

    def step_anchors(self) -> tuple[int, dict[int, tf.Tensor] | None]:
        """The current replica and its step's anchors (``{id(variable): float32
        scalar}``, whose gradients are ``[shard_elements]``; None in a forward-only
        pass); inside a step only."""
        replica = self._replica_id()
        state = self._steps[replica]
        return replica, None if state.mode == "no_grad" else state.anchors

    def gather_variables(self, variables: tuple, replica: int, dep: tf.Tensor) -> list:
        """The views of ``variables`` on ``replica`` (one read, one all-gather), read
        after ``dep``; no backward (the caller reduce-scatters their gradients)."""
        return self.gather(Unit(-1, None, tuple(variables), None), replica, dep)

    def read_outside(self, variable: ShardedVariable):
        """The value of ``variable`` read outside its units' calls, inside a step: a
        one-variable gathered use (with backward). None outside a step."""
        if not self.in_step():
            return None
        self._refuse_nested(f"a read of {variable.path!r}")
        unit = self._outside.get(id(variable))
        if unit is None:
            unit = Unit(-1, None, (variable,), None)
            self._outside[id(variable)] = unit
        return self._use(unit, ((), {}), None)

    def _row_use(self, unit: Unit, args: tuple, kwargs: dict):
        """A row-paged ``Embedding``'s call inside a step: only the rows its ids look up
        move (:mod:`zero_runtime.stage3.embedding`); float32 ``S + (C,)`` cast to the
        layer's compute dtype, as ``Embedding.call``.

        Raises:
            NotImplementedError: a lookup inside ``tf.cond`` / ``tf.while_loop`` (its
                collectives cannot run inside control flow), or a second lookup of the
                table in one training step (its anchor carries one lookup's rows),
                naming the table and the fix.
        """
        replica = self._replica_id()
        state = self._steps[replica]
        rows = unit.rows
        fix = (
            f"raise embedding_row_paging_threshold above the table's "
            f"{math.prod(rows.table.shape)} elements (it is then gathered whole like "
            "other weights), or train at stage 1 or 2"
        )
        if _inside_control_flow(state.graph):
            raise NotImplementedError(
                f"stage 3: the row-paged embedding {unit.layer.name!r} is called inside "
                f"tf.cond / tf.while_loop, where its collectives cannot run; {fix}"
            )
        ids = args[0] if args else kwargs["inputs"]
        if state.anchors is None or state.mode == "no_grad":
            if state.anchors is not None:
                self._count_table_use(state, unit, fix)
            out = rows.forward(ids, replica)
        else:
            if state.mode != "recompute":
                self._count_table_use(state, unit, fix)
            out = rows.use(ids, state.anchors[id(rows.table)], replica)
        return tf.cast(out, unit.layer.compute_dtype)

    @staticmethod
    def _count_table_use(state: _StepState, unit: Unit, fix: str) -> None:
        """Record a training step's lookup of ``unit``'s table; refuse a second one."""
        key = id(unit.rows.table)
        if key in state.row_uses:
            raise NotImplementedError(
                f"stage 3: the row-paged embedding {unit.layer.name!r} is looked up twice "
                f"in one training step; a row-paged table takes one lookup per step: {fix}"
            )
        state.row_uses.add(key)

    def _refuse_table_read(self, table):
        """A row-paged table's value read outside its ``Embedding``'s call (a tied head,
        a regularizer): refused inside a step (it would gather the whole table); None
        outside one (the value gathers on demand)."""
        if not self.in_step():
            return None
        raise NotImplementedError(
            f"stage 3: the row-paged embedding table {table.path!r} is read whole inside "
            "the step (outside its Embedding's lookup: a tied output head, a weight "
            "regularizer), which would gather the table that row paging keeps in pages. "
            f"Raise embedding_row_paging_threshold above its {math.prod(table.shape)} "
            "elements (it is then gathered whole like other weights), or untie it"
        )

    def _refuse_nested(self, what: str) -> None:
        """Raise when a use would start inside another unit's call (its
        ``tf.custom_gradient`` would drop the nested use's gradient).

        Raises:
            NotImplementedError: naming both.
        """
        state = self._steps[self._replica_id()]
        if state.running is not None and not _inside_control_flow(state.graph):
            raise NotImplementedError(
                f"stage 3: {what} runs inside the call of {state.running.layer.name!r}, a "
                "layer that owns weights: its use's backward would drop the gradient of the "
                "inner use. Move the weight or the inner layer out of that layer's call "
                "(a layer that *holds* the inner layer as a sublayer is supported), or "
                "train at stage 1 or 2"
            )

    def _use(self, unit: Unit, structure, run):
        replica = self._replica_id()
        state = self._steps[replica]
        if _inside_control_flow(state.graph):
            return use_in_branch(self, unit, structure, run, replica, state)
        flat = tf.nest.flatten(structure)
        pos = [i for i, a in enumerate(flat) if tf.is_tensor(a)]
        inputs = [flat[i] for i in pos]
        layer = unit.layer
        state_vars = [] if layer is None else list(layer.non_trainable_variables)
        state_vals = [tf.convert_to_tensor(v.value) for v in state_vars]
        dep = tf.reshape(inputs[0], [-1])[:1] if inputs else state.token
        # Mixed precision: the compute dtype the layer's __call__ casts its weights to
        # (None: no cast). The backward's recompute runs outside __call__, so it enters
        # the same scope itself; the all-gather moves that dtype (half the bytes under
        # mixed_bfloat16 / mixed_float16) when every weight of the unit is cast anyway.
        autocast = compute_dtype()
        gather_dtype = autocast if autocast and all(v._autocast for v in unit.variables) else None  # noqa: SLF001

        def call(tensors, views, state_values):
            if run is None:  # an outside read: the value itself
                return views[0], []
            args = list(flat)
            for i, t in zip(pos, tensors):
                args[i] = t
            mapping = list(zip(unit.variables, views)) + list(zip(state_vars, state_values))
            state.running = unit
            try:
                with AutocastScope(autocast), keras.StatelessScope(state_mapping=mapping) as scope:
                    out = run(tf.nest.pack_sequence_as(structure, args))
            finally:
                state.running = None
            new_state = [scope.get_current_value(v) for v in state_vars]
            return out, new_state

        self._count_use(state, unit.variables)
        if state.anchors is None or state.mode == "no_grad":
            # Forward only (evaluate, predict, a checkpointed block's forward): gather,
            # call, assign state, drop.
            views = self.gather(unit, replica, dep, gather_dtype)
            out, new_state = call(inputs, views, state_vals)
            self.assign_state(state_vars, state_vals, new_state)
            return out

        anchors = [state.anchors[id(v)] for v in unit.variables]
        done_in = [] if state.done is None else [state.done]
        n_in, n_anchor, n_state = len(inputs), len(anchors), len(state_vals)
        box = {}  # trace-time: the output structure and which state changed

        @tf.custom_gradient
        def use(*xs):
            tensors = list(xs[:n_in])
            given = list(xs[n_in + n_anchor : n_in + n_anchor + n_state])
            views = self.gather(unit, replica, dep, gather_dtype)
            out, new_state = call(tensors, views, given)
            changed = [k for k, (a, b) in enumerate(zip(given, new_state)) if a is not b]
            box["structure"], box["changed"] = out, changed
            box["n_out"] = len(tf.nest.flatten(out))
            # A softmax/sigmoid output's logits are outputs of the use too (keras_logits).
            box["logits"] = keras_logits_positions(tf.nest.flatten(out))
            outs = with_keras_logits(tf.nest.flatten(out), box["logits"])

            def grad(*dys):
                dys = [tf.zeros_like(o) if d is None else d for o, d in zip(outs, dys[: len(outs)])]
                if state.applied:  # a tape.gradient taken after this step's update
                    return _after_apply(unit, tensors, dys, n_anchor, n_state)
                views2 = self.gather(unit, replica, self._backward_dep(state, dys), gather_dtype)
                float_in = [k for k, t in enumerate(tensors) if t.dtype.is_floating]
                with tf.GradientTape() as tape:
                    tape.watch(views2)
                    tape.watch([tensors[k] for k in float_in])
                    out2, _ = call(tensors, views2, given)  # state updates discarded
                sources = list(views2) + [tensors[k] for k in float_in]
                gs = tape.gradient(
                    with_keras_logits(tf.nest.flatten(out2), box["logits"]),
                    sources,
                    output_gradients=dys,
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )
                gs = [tf.convert_to_tensor(g) for g in gs]  # IndexedSlices -> dense
                dxs = [None] * n_in
                for k, g in zip(float_in, gs[len(views2) :]):
                    dxs[k] = g
                # The input gradients first: they are the last readers of the views, so
                # the views are freed before the flat gradient is laid out.
                with tf.control_dependencies([d for d in dxs if d is not None]):
                    shard = reduce_scatter_variables(
                        unit.variables, gs[: len(views2)], self.group, raw=True
                    )
                state.last_reduced = shard
                done = self.update_now(replica, unit.variables, shard)
                if done is not None:  # its last read: updated now
                    return (*dxs, *([None] * n_anchor), *([None] * n_state), done)
                pieces = tf.split(shard, [v.shard_elements for v in unit.variables])
                return (*dxs, *pieces, *([None] * n_state), *([None] * len(done_in)))

            extra = [new_state[k] for k in changed]
            return [*outs, *extra], grad

        result = use(*inputs, *anchors, *state_vals, *done_in)
        n_out, n_logits = box["n_out"], len(box["logits"])
        flat_out = list(result[:n_out])
        for k, logits in zip(box["logits"], result[n_out : n_out + n_logits]):
            flat_out[k]._keras_logits = logits  # noqa: SLF001  (Keras's own attribute)
        out = tf.nest.pack_sequence_as(box["structure"], flat_out)
        changed = box["changed"]
        updates = dict(zip(changed, result[n_out + n_logits :]))
        if state.mode != "recompute":  # a recomputed block's state updates: discarded
            self.assign_state(state_vars, state_vals, [updates.get(k) for k in range(n_state)])
        return out

    def gather(
        self, unit: Unit, replica: int, dep: tf.Tensor, dtype: str | None = None
    ) -> list[tf.Tensor]:
        """The unit's views on this replica, read after ``dep``: one read of its shards,
        one all-gather (:func:`~zero_runtime.stage3.unit_comm.gather_views`; ``dtype``
        None gathers float32, a 16-bit dtype name half the bytes). One float32 tensor
        per original, of its logical shape.

        Raises:
            ValueError: a backward's gather after the user step's gradients were applied
                (:func:`_refuse_after_apply`).
        """
        applied = self._steps.get(replica)
        if applied is not None and applied.applied:
            _refuse_after_apply(unit)
        views = gather_views(
            unit.variables, replica, dep, self.group, self.num_shards, self.schedule, dtype
        )
        state = self._steps.get(replica)
        if state is not None and state.user and views:
            state.reads.append(views[0])
        return views

    @staticmethod
    def _backward_dep(state: _StepState, dys: list) -> tf.Tensor:
        """What a use's backward gather waits for: every output gradient in ``dys`` (a
        loss may read only a softmax output's logits, whose gradient is then the only
        non-zero one) and the reduce-scatter of the use whose backward was traced before
        it (in the same graph), so a replica holds one unit's gathered parameters or one
        unit's gradient and its flat copy at a time, not the next unit's gather beside
        the last one's reduction (the backward's working set: two units)."""
        dep = tf.concat([tf.cast(tf.reshape(d, [-1])[:1], tf.float32) for d in dys], 0)
        prev = state.last_reduced
        if prev is None or prev.graph is not dep.graph:
            return dep
        with tf.control_dependencies([prev]):
            return tf.identity(dep)

    @staticmethod
    def assign_state(state_vars: list, old: list, new: list) -> None:
        """Assign the state updates the use made (once per forward use, as Keras)."""
        for v, a, b in zip(state_vars, old, new):
            if b is not None and b is not a:
                v.assign(b)


def _after_apply(unit: Unit, tensors: list, dys: list, n_anchor: int, n_state: int) -> tuple:
    """A use's backward traced after its model's gradients were applied in the step.

    A tape.gradient over other sources may run through the use without needing its
    gradients (a persistent tape's second model: TensorFlow's tape calls the backward
    of every recorded op on the way to the loss); they are then pruned, never run. A
    gradient that is used raises :func:`_refuse_after_apply`'s error when it runs.

    Returns:
        The use's input gradients (float inputs: their shapes; others None), its
        anchors' (float32 ``[shard_elements]``) and None for its state inputs.
    """
    dep = tf.concat([tf.cast(tf.reshape(d, [-1])[:1], tf.float32) for d in dys], 0)
    # Stateless: pruned with its consumers when nothing needs them.
    fail = host_function(
        functools.partial(_raise_after_apply, unit), [dep], tf.float32, stateful=False
    )
    fail.set_shape([])
    dxs = [tf.zeros_like(t) + fail if t.dtype.is_floating else None for t in tensors]
    pieces = [tf.fill([v.shard_elements], fail) for v in unit.variables]
    return (*dxs, *pieces, *([None] * n_state))


def _raise_after_apply(unit: Unit, _dep) -> None:
    _refuse_after_apply(unit)


def _refuse_after_apply(unit: Unit) -> None:
    """Raise for a backward through a use whose model's gradients were applied earlier
    in the step (a persistent tape: one optimizer applied before another's gradients
    were taken through this model).

    The use's backward gathers the weights again (ZeRO-3 keeps no gathered copy), and
    the update already traced would have changed them, whereas TensorFlow's tape under
    MirroredStrategy differentiates the values the forward read.

    Raises:
        ValueError: naming the layer and the fix (every tape.gradient before the first
            apply_gradients).
    """
    what = unit.layer.name if unit.layer is not None else unit.variables[0].path
    raise ValueError(
        f"stage 3: a tape.gradient goes back through {what!r} after apply_gradients "
        "updated its model's shards in this step (a persistent tape, or two tapes, with "
        "one optimizer applied before another's gradients were taken). Its backward "
        "gathers the weights again, which would read the updated values instead of the "
        "forward's. Take every gradient first, then apply: grads_a = "
        "tape.gradient(loss_a, ...); grads_b = tape.gradient(loss_b, ...); then "
        "opt_a.apply_gradients(...); opt_b.apply_gradients(...)"
    )


def compute_dtype() -> str | None:
    """The dtype Keras casts float variables to in the layer call being traced: a
    16-bit float dtype name under a mixed-precision policy, None otherwise (no autocast
    scope, or one that does not cast)."""
    scope = get_autocast_scope()
    dtype = None if scope is None else scope.dtype
    return None if dtype in (None, "float32") else dtype


def keras_logits_positions(outs: list) -> list[int]:
    """The positions in ``outs`` (a use's flat outputs) of the tensors that carry their
    logits as ``_keras_logits``.

    Keras's softmax and sigmoid (``keras/src/activations/activations.py``,
    ``keras/src/backend/tensorflow/nn.py``) set it on their output, and its crossentropy
    losses and metrics (``_get_logits`` there) compute from those logits, else from the
    output's op when it is the ``Softmax``/``Sigmoid`` itself, else from the clipped
    probabilities: other values and gradients. A use's ``tf.custom_gradient`` returns
    ``IdentityN`` outputs without the attribute, so :meth:`UnitRunner._use` returns the
    logits as outputs of the use too and sets the attribute on its outputs again.
    """
    return [k for k, o in enumerate(outs) if tf.is_tensor(getattr(o, "_keras_logits", None))]


def with_keras_logits(outs: list, positions: list[int]) -> list:
    """``outs`` followed by the ``_keras_logits`` of ``outs[k]`` for each ``k`` in
    ``positions`` (:func:`keras_logits_positions`; same shapes and dtypes as those
    outputs).

    Raises:
        AttributeError: an output at one of ``positions`` has no ``_keras_logits`` (the
            backward's recompute returned other outputs than the forward).
    """
    return [*outs, *(outs[k]._keras_logits for k in positions)]  # noqa: SLF001


def _within(step_graph) -> bool:
    """True when the current default graph is ``step_graph`` or nested in it (a branch
    or loop body of it)."""
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if graph is step_graph:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _inside_control_flow(step_graph) -> bool:
    """True when the current graph is a ``tf.cond`` / ``tf.while_loop`` branch traced
    inside ``step_graph`` (the graph the step's forward began in)."""
    graph = tf.compat.v1.get_default_graph()
    while graph is not None and graph is not step_graph:
        if isinstance(graph, ControlFlowFuncGraph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False
