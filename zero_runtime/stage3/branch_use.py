"""Unit uses inside ``tf.cond`` / ``tf.while_loop``: gathered once per step in the
step's own graph, before the control flow (:mod:`zero_runtime.stage3.gather`'s module
docstring), so no collective runs inside a branch or loop body and replicas whose
predicates differ still run the same collectives.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from zero_runtime.stage3.unit_comm import reduce_scatter_variables


def unit_name(unit) -> str:
    """A unit's name in messages: its layer's, or the variable read outside a layer."""
    if unit.layer is not None:
        return f"layer {unit.layer.name!r}"
    return f"a read of {unit.variables[0].path!r}"


def use_in_branch(runner, unit, structure, run, replica: int, state):
    """A use of ``unit`` inside a ``tf.cond`` / ``tf.while_loop`` branch, on ``replica``
    of ``runner`` (a :class:`~zero_runtime.stage3.gather.UnitRunner`; ``state`` its step
    state, ``structure`` the call's ``(args, kwargs)``, ``run`` the layer's call on them,
    or None for a read of the value itself).

    The unit is gathered in the step's own graph, outside the branch (once per step,
    whichever branches use it), so every replica runs the same collectives whatever
    its predicate; the branch captures the views and differentiates through them
    (no recompute: the views live until the backward), and the views' gradient, summed
    over the branches by TensorFlow, is reduce-scattered in the step's graph too.
    """
    if state.mode != "normal":
        raise NotImplementedError(
            f"stage 3: {unit_name(unit)} is used inside a tf.cond / tf.while_loop within an "
            "activation-checkpointed block: its gathered views would not reach the "
            "block's recompute. Set activation_checkpointing=False"
        )
    state.shared.update(id(v) for v in unit.variables)  # gathered once: not early
    views = state.branch_views.get(id(unit))
    if views is None:
        with state.graph.as_default():
            views = _gathered_views(runner, unit, replica, state)
        state.branch_views[id(unit)] = views
    if run is None:  # an outside read: the value itself
        return views[0]
    flat = tf.nest.flatten(structure)
    layer = unit.layer
    state_vars = list(layer.non_trainable_variables)
    state_vals = [tf.convert_to_tensor(v.value) for v in state_vars]
    mapping = list(zip(unit.variables, views)) + list(zip(state_vars, state_vals))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        out = run(tf.nest.pack_sequence_as(structure, flat))
    runner.assign_state(state_vars, state_vals, [scope.get_current_value(v) for v in state_vars])
    return out


def _gathered_views(runner, unit, replica: int, state) -> list[tf.Tensor]:
    """The unit's views, gathered in the current graph; with a backward, their
    gradients are reduce-scattered into the gradients of the unit's anchors."""
    if state.anchors is None:
        return runner.gather(unit, replica, state.token)
    anchors = [state.anchors[id(v)] for v in unit.variables]

    @tf.custom_gradient
    def gathered(*_anchors):
        views = runner.gather(unit, replica, state.token)

        def grad(*dviews):
            dviews = [
                tf.zeros_like(v) if d is None else tf.convert_to_tensor(d)
                for v, d in zip(views, dviews)
            ]
            shard = reduce_scatter_variables(unit.variables, dviews, runner.group, raw=True)
            return tf.split(shard, [v.shard_elements for v in unit.variables])

        return views, grad

    return list(gathered(*anchors))
