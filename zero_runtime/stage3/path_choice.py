"""Which stage-3 engine runs a chain: the block engine or the units path.

Stage 3 runs a model one of two ways (docs/zero_stages.md):

- the **units path** (:mod:`zero_runtime.stage3.units_path`): the model's own call, every
  layer that owns weights gathered per use by one all-gather into TF tensors,
  recomputed and reduce-scattered in backward (``tf.custom_gradient``); device-tier
  shards are TF variables, so a device-tier step has no host call. Every model can run
  this way, and it is the fast one (bench/results/stage3_units.json).
- the **block engine** (:class:`~zero_runtime.stage3.engine.Stage3Engine`'s blocks): a
  chain (``keras.Sequential`` or a functional chain) block by block, every gather and
  release a host callback into the paged pool.

A chain runs by units unless its config asks for something only the block engine does
(:func:`block_engine_reasons`); a model that is not a chain always runs by units.
"""

from __future__ import annotations

import math

import keras

from zero_runtime.config import ZeroConfig

#: Gathered units the units path holds at once, at most: the unit in use and the next
#: one (its gather may start while the previous unit's views are still read).
UNITS_LIVE = 2


def block_engine_reasons(layers: list, config: ZeroConfig) -> tuple[str, ...]:
    """Why the chain ``layers`` needs the block engine under ``config``; empty when the
    units path does everything the config asks.

    The block engine alone has:

    - gathered parameters in the pool's device tier, so that an int
      ``device_budget_bytes`` bounds them (the units path's gathered views are TF tensors
      outside the pool);
    - a plan within ``max_live_parameters`` below :data:`UNITS_LIVE` units' elements
      (the units path holds up to that many gathered units at once).

    ``persistence_threshold`` and ``max_reuse_distance`` are permissions (a parameter
    *may* stay gathered), not bounds: the units path, which gathers a unit's small
    parameters in the unit's one all-gather and gathers again for backward, honours them.

    NVMe parameters are no reason: the units path prefetches them along
    each traced pass's recorded reads (:mod:`zero_runtime.stage3.schedule`). Host or NVMe
    optimizer states are none either: the units path updates during backward
    too (:meth:`~zero_runtime.stage3.units_path.UnitsPath.forward_backward`, ``update``:
    an original read by one use as soon as that use's gradient shard is reduced, the
    others after the backward). A test about the block engine itself (its pool, plan or
    persistence) keeps a chain there with an int ``device_budget_bytes`` that never
    binds.

    Args:
        layers: the chain's layers (``engine._chain_or_none``), built.
        config: the stage-3 config.

    Returns:
        One sentence per reason (empty: run by units).
    """
    reasons = []
    if config.device_budget_bytes is not None:
        reasons.append(
            f"device_budget_bytes={config.device_budget_bytes!r} (gathered parameters "
            "counted in the pool's device tier)"
        )
    largest = max((_own_elements(sub) for layer in layers for sub in _units(layer)), default=0)
    if config.max_live_parameters < UNITS_LIVE * largest:
        reasons.append(
            f"max_live_parameters={config.max_live_parameters} < {UNITS_LIVE} x the largest "
            f"unit's {largest} elements"
        )
    return tuple(reasons)


def _units(layer: keras.layers.Layer) -> list:
    """The layers under ``layer`` (itself included) that own trainable weights directly:
    the units the units path would gather (:func:`zero_runtime.stage3.units.plan_units`)."""
    return [
        sub
        for sub in layer._flatten_layers(include_self=True)  # noqa: SLF001
        if any(v.trainable for v in sub._trainable_variables)  # noqa: SLF001
    ]


def _own_elements(layer: keras.layers.Layer) -> int:
    return sum(
        math.prod(v.shape)
        for v in layer._trainable_variables  # noqa: SLF001
        if v.trainable
    )
