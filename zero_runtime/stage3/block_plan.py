"""The block engine's static schedule and its per-step pool record (ZeRO stage 3).

:class:`BlockPlan` orders a step's uses of the blocks (F0..F(L-1), B(L-1)..B0) and says
which use gathers and which keeps its block gathered (``max_reuse_distance``,
``max_live_parameters``); :class:`Block` is one block of a chain; :class:`PoolStep` is the
pool's usage and page counters at the end of a step
(:meth:`~zero_runtime.stage3.engine.Stage3Engine.close_step`); :func:`shard_blocks`
turns a chain's layers into blocks of sharded variables.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras

from zero_runtime.memory import PageCounters, TierUsage
from zero_runtime.sharded_variable import ShardedVariable
from zero_runtime.stage3.chain import _replace_variable
from zero_runtime.stage3.embedding import RowPagedEmbedding, row_paging_applies

FWD, BWD = "fwd", "bwd"


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


def shard_blocks(
    engine: Any, layers: list, remote: bool
) -> tuple[tuple[Block, ...], dict[int, RowPagedEmbedding]]:
    """Replace the chain ``layers``' trainable weights by sharded variables, one
    :class:`Block` per layer, in place.

    A variable of fewer than ``persistence_threshold`` elements is persistent (gathered
    once per step). An ``Embedding`` at or above ``embedding_row_paging_threshold``
    elements becomes a row-paged table (:class:`RowPagedEmbedding`: only the batch's rows
    move) and a block without gathers.

    Args:
        engine: the stage-3 engine (its config, pool, replicas, ``shard_variable``).
        layers: the chain's built layers, in call order (empty by units).
        remote: True when other workers hold some replicas' shards.

    Returns:
        ``(blocks, row_paged)``: the blocks in layer order, and ``{block index:
        RowPagedEmbedding}``.
    """
    config = engine.config
    blocks: list[Block] = []
    row_paged: dict[int, RowPagedEmbedding] = {}
    for i, layer in enumerate(layers):
        if row_paging_applies(layer, config):
            old = layer.embeddings
            row_paged[i] = RowPagedEmbedding(
                layer,
                engine.pool,
                engine.num_shards,
                config,
                local_replicas=engine.local_replicas,
                gather_remote=engine._gather_remote if remote else None,  # noqa: SLF001
            )
            _replace_variable(layer, old, row_paged[i].table)
            blocks.append(Block(i, layer, (), 0, 0))
            continue
        new_vars = []
        for v in list(layer.trainable_variables):
            size = math.prod(v.shape)
            sv = engine.shard_variable(v, remote, persistent=size < config.persistence_threshold)
            _replace_variable(layer, v, sv)
            new_vars.append(sv)
        elements = sum(math.prod(v.shape) for v in new_vars if not v.persistent)
        persistent = sum(math.prod(v.shape) for v in new_vars if v.persistent)
        blocks.append(Block(i, layer, tuple(new_vars), elements, persistent))
    return tuple(blocks), row_paged


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
