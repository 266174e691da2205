"""The block engine's step (ZeRO stage 3): forward and backward block by block.

:class:`BlockSteps` is the data path of :class:`~zero_runtime.stage3.engine.Stage3Engine`
(the engine mixes it in; the engine builds the pool, shards and plan it uses): in a
training step, on each replica, block i's shards are read from the pool, all-gathered
(one collective per block), the layer runs on the gathered values, and the buffers are
released unless the plan keeps them; in backward the block is gathered again, its
forward recomputed from its saved input, and its parameter gradients reduce-scattered at
once (ZeRO, Rajbhandari et al., SC20, section 5.3). The host calls that read, finish and
release gathers (:func:`_host_call`) are ordered by data dependencies only.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import tensorflow as tf

from zero_runtime import comm
from zero_runtime.lifecycle import host_function
from zero_runtime.memory import PoolOutOfMemoryError
from zero_runtime.sharded_variable import ShardState
from zero_runtime.stage3.block_plan import BWD, FWD, Block
from zero_runtime.stage3.gather import keras_logits_positions, with_keras_logits
from zero_runtime.stage3.unit_comm import reduce_scatter_variables


class BlockSteps:
    """The block engine's per-step methods, mixed into
    :class:`~zero_runtime.stage3.engine.Stage3Engine`.

    They use the engine's ``pool``, ``plan``, ``blocks``, ``group``, ``row_paged``,
    ``config``, ``tier``, ``num_shards``, ``local_replicas``, ``units``/``runner`` (a
    model run by units is dispatched to its :class:`~zero_runtime.stage3.units_path.UnitsPath`)
    and the per-step state the engine creates (``recorded_order``, ``peak_live``, the
    live-element counters and the lock). No state of their own.
    """

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

    def user_forward(self, x, training: bool = False):
        """The model's call under a user's own ``tf.GradientTape`` (a custom loop), on
        this replica: :meth:`~zero_runtime.stage3.units_path.UnitsPath.user_forward`.

        Raises:
            NotImplementedError: the model runs on the block engine (whose gathers are
                host calls without a backward a user's tape can run), naming why.
        """
        if self.runner is None:
            raise NotImplementedError(
                f"stage 3: model {self.model.name!r} runs on the block engine because of "
                f"{'; '.join(self.block_reasons)}, and a tf.GradientTape custom loop runs "
                "by units only. Change that setting (for device_budget_bytes: None or "
                "'auto'), or train it with model.fit"
            )
        return self.units.user_forward(x, training)

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
            # done == 0.0: a data dependency on the release, of a softmax/sigmoid output's
            # logits too (Keras's crossentropy reads them; gather.keras_logits_positions).
            h = _keeping_logits(
                [t + tf.cast(done, t.dtype) for t in with_keras_logits([h], _logits_of(h))]
            )
        return h

    def _block(self, block: Block, x, anchor, replica: int, training: bool, update=None):
        if block.index in self.row_paged:  # only the batch's rows move
            return self.row_paged[block.index].block(x, anchor, replica)
        if not block.variables:  # nothing to gather: an ordinary op under the outer tape
            return self._call(block, [], x, training)
        fwd_use = self.plan.uses.index((FWD, block.index))
        bwd_use = self.plan.uses.index((BWD, block.index))
        float_x = x.dtype.is_floating
        box = {}  # trace-time: the positions of the output's logits (0 or 1 of them)

        @tf.custom_gradient
        def run(x, anchor):
            values = self._materialize(block, replica, fwd_use, _dep(x))
            y = self._call(block, values, x, training)
            # A softmax/sigmoid output's logits are outputs of the use too (Keras's
            # crossentropy reads them; gather.keras_logits_positions).
            box["logits"] = _logits_of(y)
            ys = self._after_use(
                block, replica, fwd_use, with_keras_logits([y], box["logits"]), values
            )

            def grad(*dys):
                dys = [tf.zeros_like(t) if d is None else d for t, d in zip(ys, dys)]
                # After every output gradient: a loss may read the logits alone.
                dep = tf.concat([tf.cast(_dep(d), tf.float32) for d in dys], 0)
                values2 = self._materialize(block, replica, bwd_use, dep)
                with tf.GradientTape() as t:
                    t.watch(values2)
                    if float_x:
                        t.watch(x)
                    y2 = self._call(block, values2, x, training)
                sources = list(values2) + ([x] if float_x else [])
                gs = t.gradient(
                    with_keras_logits([y2], box["logits"]), sources, output_gradients=dys
                )
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

            return ys, grad

        return _keeping_logits(run(x, anchor))

    def _call(self, block: Block, values: list, x, training: bool):
        layer = block.layer
        non_trainable = [v.value for v in layer.non_trainable_variables]
        kwargs = {"training": training} if getattr(layer, "_call_has_training_arg", False) else {}
        y, _ = layer.stateless_call(list(values), non_trainable, x, **kwargs)
        return y

    def _after_use(self, block: Block, replica: int, use: int, ys: list, values: list) -> list:
        """``ys`` (the block's output, then its logits if any) plus the release's 0.0:
        orders the release before later uses; same shapes and dtypes."""
        done = self._release_after(block, replica, use, [*ys, *values])
        return [y + tf.cast(done, y.dtype) for y in ys]

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


def _logits_of(y: tf.Tensor) -> list[int]:
    """``[0]`` when the block output ``y`` carries its logits as ``_keras_logits`` (a
    softmax/sigmoid output, :func:`~zero_runtime.stage3.gather.keras_logits_positions`),
    else ``[]``."""
    return keras_logits_positions([y])


def _keeping_logits(ys: list) -> tf.Tensor:
    """``ys[0]``, a block's output, with ``ys[1]`` (its logits, same shape and dtype)
    set as its ``_keras_logits`` when given (Keras's own attribute)."""
    y, *logits = ys
    if logits:
        y._keras_logits = logits[0]  # noqa: SLF001
    return y


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
