"""The stage-3 engine's placement table: where each parameter, gradient and optimizer
state of a stage-3 model lives (the Memory Hierarchy view's placement rows).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def placement_rows(engine: Any, optimizer_tier: str) -> list[dict]:
    """One placement row per sharded variable of ``engine`` (``memory_hierarchy/
    placement``), one per row-paged table (:meth:`RowPagedEmbedding.placement_row`) and
    one per frozen weight.

    Args:
        engine: the stage-3 engine (its variables, pool, tile plans, row-paged tables).
        optimizer_tier: where the optimizer states are ('device', 'host' or 'nvme'),
            written into every sharded variable's row.

    Returns:
        Rows of ``name``, ``shape``, ``dtype``, ``bytes`` (the whole variable's),
        ``partitioning`` (text), ``shard_bytes_per_replica``, ``param_tier``,
        ``grad_tier``, ``optimizer_tier``.

    ``param_tier`` is where replica 0's shard pages are now, by the pool's page table
    (tiers joined with '+' when its pages are split); gradients are reduced to a shard
    on the device, held to the step's end ('device') or, when blocks are updated
    during backward, handed to the host optimizer at once ('device -> host').
    """
    grad_tier = "device -> host (in backward)" if engine.update_in_backward else "device"
    rows = []
    for v in engine.variables:
        tiers = sorted(
            {
                p.tier
                for pid in v.page_ids(engine.local_replicas[0])
                for p in engine.pool.describe(pid).pages
                if p.tier
            },
            key=("device", "host", "nvme").index,
        )
        text = f"sharded 1/{engine.num_shards} along dim {v.shard_dim} (ZeRO-3)"
        if v.persistent:
            text += "; persistent: gathered once per step"
        if id(v) in engine.tile_plans:
            text += "; " + engine.tile_plans[id(v)].describe()
        rows.append(
            {
                "name": v.path,
                "shape": list(v.shape),
                "dtype": "float32",
                "bytes": 4 * math.prod(v.shape),
                "partitioning": text,
                "shard_bytes_per_replica": 4 * v.shard_elements,
                "param_tier": "+".join(tiers) or v.tier,
                "grad_tier": grad_tier,
                "optimizer_tier": optimizer_tier,
            }
        )
    # One row per row-paged table: its row pages' bytes per tier, rows/pages touched.
    rows.extend(e.placement_row() for e in engine.row_paged.values())
    for v in engine.frozen:  # replicated on the device, no gradient, no optimizer state
        nbytes = variable_nbytes(v)
        rows.append(
            {
                "name": v.path,
                "shape": list(v.shape),
                "dtype": str(np.dtype(v.dtype)),
                "bytes": nbytes,
                "partitioning": "frozen, replicated (not trainable: not sharded)",
                "shard_bytes_per_replica": nbytes,
                "param_tier": "device",
                "grad_tier": "none",
                "optimizer_tier": "none",
            }
        )
    return rows


def variable_nbytes(v) -> int:
    """Bytes of Keras variable ``v``: ``prod(shape) * itemsize`` of its dtype."""
    return math.prod(v.shape) * np.dtype(v.dtype).itemsize
