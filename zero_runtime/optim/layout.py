"""Flat layout of a variable group: buckets, padding, and equal per-replica shards.

Vocabulary (used across ``zero_runtime.optim``):

- *flat buffer*: the group's tensors reshaped to 1-D and concatenated in variable order,
  bucket by bucket, each bucket zero-padded to a multiple of ``num_shards`` elements.
- *bucket*: a run of consecutive variables reduced by one collective (at most
  ``bucket_size`` elements unless one variable alone is larger). Buckets are formed in
  backward order: the last variables (whose gradients the backward pass produces first)
  fill the first bucket to be reduced (ZeRO, Rajbhandari et al., SC20, section 5.2,
  bucketized reduce-scatter; DeepSpeed's ``reduce_bucket_size``).
- *piece*: replica ``r``'s slice ``[r * s_b, (r + 1) * s_b)`` of bucket ``b``, where
  ``s_b = ceil(size_b / num_shards)``; a reduce-scatter of the bucket leaves replica ``r``
  exactly its piece.
- *shard*: replica ``r``'s pieces of all buckets, concatenated in bucket order;
  ``shard_size = sum_b s_b`` elements. With one bucket this is the contiguous slice
  ``[r * shard_size, (r + 1) * shard_size)`` of the flat buffer (section 5.1).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One bucket of the flat buffer.

    Attributes:
        index: position in variable (flat) order; reduction order is the reverse.
        var_start: first variable index (inclusive), in variable order.
        var_end: last variable index (exclusive).
        flat_offset: first element of the bucket in the padded flat buffer.
        size: unpadded elements.
        piece_size: elements of each replica's piece, ``ceil(size / num_shards)``.
        shard_offset: where the pieces of this bucket start inside every shard.
    """

    index: int
    var_start: int
    var_end: int
    flat_offset: int
    size: int
    piece_size: int
    shard_offset: int

    def padded_size(self, num_shards: int) -> int:
        """Elements of the padded bucket, ``num_shards * piece_size``."""
        return num_shards * self.piece_size


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each variable lives in the padded flat buffer and in the shards.

    Attributes:
        names: variable paths, in flat order.
        shapes: each variable's full shape.
        sizes: each variable's element count.
        offsets: each variable's first element in the padded flat buffer.
        total: unpadded element count (sum of ``sizes``).
        num_shards: number of shards (the data-parallel degree N_d).
        shard_size: elements per shard, ``sum_b ceil(size_b / num_shards)`` (at least 1);
            ``ceil(total / num_shards)`` with one bucket.
        buckets: the buckets, in variable order.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    num_shards: int
    shard_size: int
    buckets: tuple[Bucket, ...] = ()

    @classmethod
    def from_variables(
        cls, variables: Sequence, num_shards: int, bucket_size: int | None = None
    ) -> FlatLayout:
        """Lay out ``variables`` (objects with ``.shape`` and ``.path`` or ``.name``).

        Args:
            variables: the group's variables, in the order gradients will arrive.
            num_shards: the data-parallel degree (int >= 1).
            bucket_size: elements per bucket (int >= 1), or None (default) for one bucket.
                A variable is never split; one larger than ``bucket_size`` is a bucket.

        Raises:
            ValueError: ``num_shards`` < 1, ``bucket_size`` < 1, or a variable has an
                unknown dimension.
        """
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
        names, shapes, sizes = [], [], []
        for v in variables:
            shape = tuple(v.shape)
            if any(d is None for d in shape):
                raise ValueError(f"variable {_name(v)!r} has an unknown dimension: {shape}")
            names.append(_name(v))
            shapes.append(tuple(int(d) for d in shape))
            sizes.append(int(math.prod(shape)))
        # Buckets in backward order (from the last variable), then put in variable order.
        ranges: list[list[int]] = []  # [var_start, var_end, elements]
        limit = bucket_size if bucket_size is not None else math.inf
        for i in reversed(range(len(sizes))):
            if ranges and ranges[-1][2] + sizes[i] <= limit:
                ranges[-1][0] = i
                ranges[-1][2] += sizes[i]
            else:
                ranges.append([i, i + 1, sizes[i]])
        ranges.reverse()
        if not ranges:
            ranges = [[0, 0, 0]]
        buckets, offsets = [], []
        flat_offset = shard_offset = 0
        for index, (start, end, size) in enumerate(ranges):
            piece = max(1, -(-size // num_shards))
            buckets.append(Bucket(index, start, end, flat_offset, size, piece, shard_offset))
            inner = flat_offset
            for i in range(start, end):
                offsets.append(inner)
                inner += sizes[i]
            flat_offset += num_shards * piece
            shard_offset += piece
        return cls(
            tuple(names),
            tuple(shapes),
            tuple(sizes),
            tuple(offsets),
            sum(sizes),
            num_shards,
            shard_offset,
            tuple(buckets),
        )

    @property
    def padded_total(self) -> int:
        """Elements in the padded flat buffer, ``num_shards * shard_size``."""
        return self.num_shards * self.shard_size

    @property
    def reduction_order(self) -> tuple[Bucket, ...]:
        """The buckets in the order their gradients become ready (backward order)."""
        return tuple(reversed(self.buckets))

    @functools.lru_cache(maxsize=64)  # noqa: B019 - frozen, hashable, few distinct keys
    def active_ranges(self, shard: int, active: tuple[bool, ...]) -> tuple[tuple[int, int], ...]:
        """The ranges of shard ``shard`` (shard-local [start, end)) that belong to active variables.

        Args:
            shard: replica index in ``[0, num_shards)``.
            active: one flag per variable; False for variables without a gradient this step.

        Returns:
            Sorted, merged, non-overlapping ranges in shard-local element indices.
        """
        ranges: list[list[int]] = []
        for b in self.buckets:
            lo = b.flat_offset + shard * b.piece_size
            hi = lo + b.piece_size
            for i in range(b.var_start, b.var_end):
                if not active[i]:
                    continue
                s, e = max(self.offsets[i], lo), min(self.offsets[i] + self.sizes[i], hi)
                if s >= e:
                    continue
                s, e = s - lo + b.shard_offset, e - lo + b.shard_offset
                if ranges and ranges[-1][1] == s:
                    ranges[-1][1] = e
                else:
                    ranges.append([s, e])
        return tuple((s, e) for s, e in ranges)

    def unshard(self, shards: Sequence[np.ndarray]) -> np.ndarray:
        """Reassemble per-replica shards into the unpadded flat buffer, in variable order.

        Args:
            shards: ``num_shards`` arrays ``[shard_size]``, index = replica.

        Returns:
            Array ``[total]`` (dtype of the shards).

        Raises:
            ValueError: wrong number or length of shards.
        """
        if len(shards) != self.num_shards or any(len(s) != self.shard_size for s in shards):
            raise ValueError(f"expected {self.num_shards} shards of {self.shard_size} elements")
        parts = []
        for b in self.buckets:
            pieces = [s[b.shard_offset : b.shard_offset + b.piece_size] for s in shards]
            parts.append(np.concatenate(pieces)[: b.size])
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def shard_bytes(self, itemsize: int = 4) -> int:
        """Bytes of one shard of one float buffer (``shard_size * itemsize``)."""
        return self.shard_size * itemsize


def _name(v) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", "?"))


def layout_from_sharded(variables: Sequence, num_shards: int) -> FlatLayout:
    """The flat layout of stage-3 variables (``ShardedVariable``, see sharded_variable.py).

    One bucket per variable, whose piece is the variable's shard (``shard_elements``:
    ``ceil(D / N)`` rows of its moved value); a replica's optimizer shard is its shards of
    all variables, in order. ``size`` of a bucket is its padded element count
    (``N * shard_elements``), so :meth:`FlatLayout.unshard` returns padded rows.

    Args:
        variables: objects with ``shape``, ``path`` and ``shard_elements``.
        num_shards: N (must equal each variable's ``num_shards``).

    Raises:
        ValueError: a variable sharded over a different number of replicas.
    """
    names, shapes, sizes, offsets, buckets = [], [], [], [], []
    flat_offset = shard_offset = 0
    for i, v in enumerate(variables):
        if getattr(v, "num_shards", num_shards) != num_shards:
            raise ValueError(f"{_name(v)!r} is sharded {v.num_shards} ways, not {num_shards}")
        piece = int(v.shard_elements)
        names.append(_name(v))
        shapes.append(tuple(int(d) for d in v.shape))
        sizes.append(num_shards * piece)
        offsets.append(flat_offset)
        buckets.append(Bucket(i, i, i + 1, flat_offset, num_shards * piece, piece, shard_offset))
        flat_offset += num_shards * piece
        shard_offset += piece
    return FlatLayout(
        tuple(names),
        tuple(shapes),
        tuple(sizes),
        tuple(offsets),
        sum(sizes),
        num_shards,
        max(1, shard_offset),
        tuple(buckets),
    )
