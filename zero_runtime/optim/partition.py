"""Which canonical elements of which tensor a replica's flat shard holds (both directions).

A replica's *shard* (``zero_runtime.optim.layout``) is its pieces of every bucket of the
padded flat buffer; a *piece* of a shard is a run of elements of one tensor. The same
map serves the parameters and every optimizer slot (they share the layout), at stages 1-2
(:meth:`FlatLayout.from_variables`, tensors packed into buckets) and at stage 3
(:func:`~zero_runtime.optim.layout.layout_from_sharded`, one bucket per tensor whose
piece is the tensor's row shard, padded to ``N * R`` rows).

Canonical order is the C order of the moved value (``zero_runtime.checkpoint.index``);
for the stage-3 layout the padded bucket is the moved value followed by padding rows, so
clipping each tensor at its true element count drops exactly the padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from zero_runtime.optim.layout import FlatLayout


@dataclasses.dataclass(frozen=True)
class Piece:
    """``count`` elements of tensor ``var`` (layout index) from canonical element
    ``start``, at element ``shard_offset`` of the replica's shard."""

    var: int
    start: int
    shard_offset: int
    count: int


def replica_pieces(layout: FlatLayout, replica: int, sizes: Sequence[int]) -> list[Piece]:
    """The pieces of ``replica``'s shard, in shard order.

    Args:
        layout: the flat layout (``num_shards`` replicas).
        replica: a replica id in ``[0, layout.num_shards)``.
        sizes: each tensor's true element count (``prod(shape)``), layout order; padding
            beyond it is not part of any piece.

    Raises:
        ValueError: ``replica`` out of range or ``sizes`` of the wrong length.
    """
    if not 0 <= replica < layout.num_shards:
        raise ValueError(f"replica {replica} out of range [0, {layout.num_shards})")
    if len(sizes) != len(layout.sizes):
        raise ValueError(f"{len(sizes)} sizes for a layout of {len(layout.sizes)} tensors")
    pieces = []
    for b in layout.buckets:
        lo = b.flat_offset + replica * b.piece_size
        hi = lo + b.piece_size
        for i in range(b.var_start, b.var_end):
            s, e = max(layout.offsets[i], lo), min(layout.offsets[i] + sizes[i], hi)
            if s < e:
                pieces.append(Piece(i, s - layout.offsets[i], s - lo + b.shard_offset, e - s))
    return pieces


def build_shard(
    layout: FlatLayout, replica: int, flats: Mapping[int, np.ndarray], sizes: Sequence[int]
) -> np.ndarray:
    """``replica``'s shard assembled from whole tensors (padding zero).

    Args:
        layout: the flat layout.
        replica: the replica id.
        flats: tensor index -> its canonical flat values, ``[sizes[i]]``.
        sizes: true element counts, layout order.

    Returns:
        float32 ``[layout.shard_size]``.
    """
    shard = np.zeros(layout.shard_size, np.float32)
    for p in replica_pieces(layout, replica, sizes):
        shard[p.shard_offset : p.shard_offset + p.count] = flats[p.var][p.start : p.start + p.count]
    return shard


def logical_from_canonical(flat: np.ndarray, shape: tuple[int, ...], shard_dim: int) -> np.ndarray:
    """The logical value (``shape``) of elements in the canonical order of ``shard_dim``."""
    d = shard_dim
    moved = (shape[d], *shape[:d], *shape[d + 1 :])
    return np.moveaxis(flat.reshape(moved), 0, d)
