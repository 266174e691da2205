"""Dynamic loss scaling at ZeRO stage 3 (Keras ``mixed_float16``), on gradient shards.

Under a ``mixed_float16`` policy Keras's ``compile`` wraps the optimizer in a
``keras.optimizers.LossScaleOptimizer`` (LSO). Keras's train step differentiates
``lso.scale_loss(loss)`` = ``loss * dynamic_scale`` (the loss tracker keeps the unscaled
loss) and the LSO's ``apply`` then does, per step (Keras 3,
``keras/src/optimizers/loss_scale_optimizer.py``, Micikevicius et al., ICLR 2018,
section 3.2):

- if every gradient element is finite: the inner optimizer applies ``g / dynamic_scale``
  (clipping, if set on the inner optimizer, after the unscaling); then ``step_counter``
  becomes 0 and ``dynamic_scale`` doubles when ``step_counter`` was
  ``dynamic_growth_steps - 1``, else ``step_counter`` += 1;
- otherwise the step is skipped (no parameter or optimizer-state change, the inner
  optimizer's ``iterations`` does not advance), ``step_counter`` becomes 0 and
  ``dynamic_scale`` halves.

At stage 3 no replica holds a full gradient: each holds its shard of the reduced
(summed over replicas) gradient, and an element that overflowed on any replica makes the
reduced element non-finite in whichever shard holds it. :func:`all_finite` therefore
all-reduces one flag per replica over the engine's collective group (as
:func:`~zero_runtime.stage3.clipping.clip_shards` does its squared norms), so every
replica takes the same branch. The reduced shard is divided by the scale
(``sum_r(g_r) / s``; Keras under MirroredStrategy divides each replica's gradient before
its all-reduce, ``sum_r(g_r / s)``, the same value for a power-of-two scale), clipped,
and handed to the inner (partitioned) optimizer's ``apply_shard_gradients`` inside a
``tf.cond``. The LSO's ``step_counter`` and ``dynamic_scale`` have aggregation "none"
(every replica computes the same values); a MirroredVariable with that aggregation
cannot be assigned in replica context, so :func:`update_scale` assigns both in one
``merge_call`` with replica 0's values, outside the ``tf.cond`` (a ``merge_call`` is not
allowed in a ``tf.cond`` branch), as the accumulation path increments ``iterations``.

Not with the update during backward (:mod:`zero_runtime.optim.backward_update`: a block
is updated before the step's other gradients exist, so before finiteness is known), nor
with gradient accumulation (a skipped micro-step would have to leave the accumulator
untouched while the scale changes under the micro-steps already summed) or row-paged
embedding tables (their touched rows are updated before the dense update, unscaled):
:func:`check_supported` refuses the last two.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import tensorflow as tf

from zero_runtime import comm
from zero_runtime.stage3.clipping import clip_shards


def split(optimizer):
    """``(lso, inner)``: the LossScaleOptimizer and the optimizer it wraps, or
    ``(None, optimizer)`` when ``optimizer`` is not a LossScaleOptimizer."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer, optimizer.inner_optimizer
    return None, optimizer


def check_supported(lso, engine) -> None:
    """Refuse loss scaling where stage 3 does not implement it.

    Args:
        lso: a ``keras.optimizers.LossScaleOptimizer`` or None (nothing to check).
        engine: the :class:`~zero_runtime.stage3.engine.Stage3Engine`.

    Raises:
        NotImplementedError: ``gradient_accumulation_steps`` > 1, or row-paged embedding
            tables (``embedding_row_paging_threshold``); the message names what is
            accepted (``mixed_bfloat16``, which needs no loss scaling, or
            ``gradient_accumulation_steps=1`` / a higher threshold).
    """
    if lso is None:
        return
    if engine.config.gradient_accumulation_steps > 1:
        raise NotImplementedError(
            "stage 3 does not implement loss scaling (a 'mixed_float16' policy: Keras "
            "wrapped the optimizer in a LossScaleOptimizer) with gradient accumulation: "
            "use gradient_accumulation_steps=1, or 'mixed_bfloat16' (no loss scaling)"
        )
    if engine.row_paged:
        raise NotImplementedError(
            "stage 3 does not implement loss scaling (a 'mixed_float16' policy) with "
            "row-paged embedding tables: raise embedding_row_paging_threshold, or use "
            "'mixed_bfloat16' (no loss scaling)"
        )


def all_finite(shards: list[tf.Tensor], group) -> tf.Tensor:
    """True on every replica when every element of every replica's shards is finite.

    Args:
        shards: this replica's reduced gradient shards (float tensors, any shapes).
        group: the engine's :class:`~zero_runtime.comm.CollectiveGroup` (one all-reduce of
            a float32 ``[1]``: the count of replicas with a non-finite element).

    Returns:
        A bool scalar, the same on every replica.

    Raises:
        RuntimeError: called outside replica context (from the all-reduce).
    """
    local = tf.reduce_all([tf.reduce_all(tf.math.is_finite(s)) for s in shards])
    bad = tf.reshape(1.0 - tf.cast(local, tf.float32), [1])
    return tf.equal(comm.all_reduce_sum_flat(bad, group)[0], 0.0)


def update_scale(lso, finite: tf.Tensor) -> tf.Tensor:
    """Advance the LSO's ``step_counter`` and ``dynamic_scale`` after a step (replica
    context), as Keras's LossScaleOptimizer does.

    Finite step: ``step_counter`` 0 and ``dynamic_scale * 2`` when ``step_counter`` was
    ``dynamic_growth_steps - 1``, else ``step_counter + 1``. Skipped step: 0 and
    ``dynamic_scale * 0.5``. Both variables are assigned in one ``merge_call`` with
    replica 0's values (all replicas compute the same ones, ``finite`` being reduced).

    Args:
        lso: a built ``keras.optimizers.LossScaleOptimizer``.
        finite: bool scalar, the same on every replica (:func:`all_finite`).

    Returns:
        The new ``dynamic_scale`` (float32 scalar), once both variables are assigned.
    """
    counter = tf.convert_to_tensor(lso.step_counter)
    scale = tf.convert_to_tensor(lso.dynamic_scale)
    grow = tf.equal(counter, lso.dynamic_growth_steps - 1)
    new_counter = tf.where(finite & ~grow, counter + 1, tf.zeros_like(counter))
    factor = tf.where(finite, tf.where(grow, 2.0, 1.0), 0.5)
    new_scale = scale * tf.cast(factor, scale.dtype)

    def merge(strategy, counter_value, scale_value):
        first = strategy.experimental_local_results
        lso.step_counter.assign(first(counter_value)[0])
        lso.dynamic_scale.assign(first(scale_value)[0])
        return tf.convert_to_tensor(lso.dynamic_scale)

    return tf.distribute.get_replica_context().merge_call(merge, args=(new_counter, new_scale))


def apply_scaled(
    lso,
    variables: list,
    shards: list[tf.Tensor],
    group,
    clock: bool,
    on_skip: Callable[[], tf.Tensor] | None = None,
) -> tf.Tensor:
    """One optimizer step under a LossScaleOptimizer, on a replica's reduced gradient
    shards of the (scaled) loss.

    Checks finiteness across replicas (:func:`all_finite`), divides the shards by
    ``dynamic_scale`` (read before it changes), clips them as the inner optimizer says
    (:func:`~zero_runtime.stage3.clipping.clip_shards`), applies them with the inner
    optimizer's ``apply_shard_gradients`` when finite, then increments the inner
    optimizer's ``iterations`` by 1 (finite) or 0 (skipped), commits the step (NVMe
    states) and updates the scale (:func:`update_scale`).

    Args:
        lso: the built ``keras.optimizers.LossScaleOptimizer``; its ``inner_optimizer``
            is the stage-3 partitioned optimizer.
        variables: the ShardedVariables the inner optimizer updates densely, in its order.
        shards: float32 ``[shard_elements_v]`` per variable, same order: this replica's
            reduced gradient shards.
        group: the engine's collective group.
        clock: passed to ``apply_shard_gradients`` (the in-graph step clock).
        on_skip: builds the skipped branch's int64 scalar -1 (the stage-3 train step ends
            the replica's micro-step there, as accumulation does); default a constant.

    Returns:
        int64 scalar: the optimizer step applied, or -1 for a skipped step (the pool's
        step boundary and the runtime's step clock then wait for the next finite step),
        once the parameters, ``iterations`` and the scale are written.
    """
    inner = lso.inner_optimizer
    finite = all_finite(shards, group)
    scale = tf.convert_to_tensor(lso.dynamic_scale)
    unscaled = clip_shards([s / scale for s in shards], inner, group)
    grads = {id(v): g for v, g in zip(variables, unscaled)}

    def skip():
        if on_skip is not None:
            return on_skip()
        with tf.control_dependencies(shards):
            return tf.constant(-1, tf.int64)

    done = tf.cond(
        finite, lambda: inner.apply_shard_gradients(grads, count=False, clock=clock), skip
    )
    with tf.control_dependencies([done]):
        inner.iterations.assign_add(tf.cast(finite, inner.iterations.dtype))
        new_scale = update_scale(lso, finite)
    replica = int(tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group))
    with tf.control_dependencies([new_scale]):
        return inner._zero_commit_op(replica, done)  # noqa: SLF001
