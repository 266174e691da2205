"""Flat layout of a variable group, padded and split into equal shards.

Vocabulary (used across ``zero_runtime.optim``):

- *flat buffer*: the group's tensors reshaped to 1-D and concatenated in variable order,
  zero-padded to ``num_shards * shard_size`` elements.
- *shard*: the slice ``[r * shard_size, (r + 1) * shard_size)`` owned by replica ``r``
  (ZeRO, Rajbhandari et al., SC20, section 5.1).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each variable lives in the padded flat buffer.

    Attributes:
        names: variable paths, in flat order.
        shapes: each variable's full shape.
        sizes: each variable's element count.
        offsets: each variable's first element in the flat buffer.
        total: unpadded element count (sum of ``sizes``).
        num_shards: number of shards (the data-parallel degree N_d).
        shard_size: elements per shard, ``ceil(total / num_shards)`` (at least 1).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    num_shards: int
    shard_size: int

    @classmethod
    def from_variables(cls, variables: Sequence, num_shards: int) -> FlatLayout:
        """Lay out ``variables`` (objects with ``.shape`` and ``.path`` or ``.name``).

        Args:
            variables: the group's variables, in the order gradients will arrive.
            num_shards: the data-parallel degree (int >= 1).

        Raises:
            ValueError: ``num_shards`` < 1, or a variable has an unknown dimension.
        """
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        names, shapes, sizes, offsets = [], [], [], []
        offset = 0
        for v in variables:
            shape = tuple(v.shape)
            if any(d is None for d in shape):
                raise ValueError(f"variable {_name(v)!r} has an unknown dimension: {shape}")
            size = math.prod(shape)
            names.append(_name(v))
            shapes.append(tuple(int(d) for d in shape))
            sizes.append(int(size))
            offsets.append(offset)
            offset += int(size)
        shard = max(1, -(-offset // num_shards))
        return cls(
            tuple(names), tuple(shapes), tuple(sizes), tuple(offsets), offset, num_shards, shard
        )

    @property
    def padded_total(self) -> int:
        """Elements in the padded flat buffer, ``num_shards * shard_size``."""
        return self.num_shards * self.shard_size

    @functools.lru_cache(maxsize=64)  # noqa: B019 - frozen, hashable, few distinct keys
    def active_ranges(self, shard: int, active: tuple[bool, ...]) -> tuple[tuple[int, int], ...]:
        """The ranges of shard ``shard`` (shard-local [start, end)) that belong to active variables.

        Args:
            shard: replica index in ``[0, num_shards)``.
            active: one flag per variable; False for variables without a gradient this step.

        Returns:
            Sorted, merged, non-overlapping ranges in shard-local element indices.
        """
        lo, hi = shard * self.shard_size, (shard + 1) * self.shard_size
        ranges: list[list[int]] = []
        for off, size, on in zip(self.offsets, self.sizes, active):
            if not on:
                continue
            s, e = max(off, lo), min(off + size, hi)
            if s >= e:
                continue
            if ranges and ranges[-1][1] == s - lo:
                ranges[-1][1] = e - lo
            else:
                ranges.append([s - lo, e - lo])
        return tuple((s, e) for s, e in ranges)

    def shard_bytes(self, itemsize: int = 4) -> int:
        """Bytes of one shard of one float buffer (``shard_size * itemsize``)."""
        return self.shard_size * itemsize


def _name(v) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", "?"))
