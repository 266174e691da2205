"""zero_runtime.optim.layout: buckets in backward order, pieces, shards, unshard."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from zero_runtime.optim.layout import FlatLayout


def _vars(*shapes):
    return [SimpleNamespace(shape=s, path=f"v{i}") for i, s in enumerate(shapes)]


def test_one_bucket_is_the_contiguous_layout():
    layout = FlatLayout.from_variables(_vars((3, 2), (5,)), 2)
    assert layout.total == 11 and layout.shard_size == 6 and layout.padded_total == 12
    assert layout.offsets == (0, 6) and len(layout.buckets) == 1


def test_buckets_fill_from_the_last_variable():
    # sizes 4, 3, 5, 2 with buckets of <= 7 elements, formed backward: [5, 2] then [4, 3]
    layout = FlatLayout.from_variables(_vars((4,), (3,), (5,), (2,)), 2, bucket_size=7)
    assert [(b.var_start, b.var_end, b.size) for b in layout.buckets] == [(0, 2, 7), (2, 4, 7)]
    assert [b.piece_size for b in layout.buckets] == [4, 4]
    assert layout.shard_size == 8 and layout.padded_total == 16
    assert layout.offsets == (0, 4, 8, 13)  # bucket 1 starts after bucket 0's 8 padded
    assert [b.index for b in layout.reduction_order] == [1, 0]
    # a variable larger than the bucket size is a bucket of its own
    big = FlatLayout.from_variables(_vars((2,), (10,)), 2, bucket_size=3)
    assert [(b.var_start, b.var_end) for b in big.buckets] == [(0, 1), (1, 2)]


def test_unshard_inverts_the_sharding():
    layout = FlatLayout.from_variables(_vars((4,), (3,), (5,), (2,)), 2, bucket_size=7)
    flat = np.arange(layout.total, dtype=np.float32)
    padded = np.zeros(layout.padded_total, np.float32)
    for i, (off, size) in enumerate(zip(layout.offsets, layout.sizes)):
        start = sum(layout.sizes[:i])
        padded[off : off + size] = flat[start : start + size]
    shards = []
    for r in range(2):
        parts = [
            padded[b.flat_offset + r * b.piece_size : b.flat_offset + (r + 1) * b.piece_size]
            for b in layout.buckets
        ]
        shards.append(np.concatenate(parts))
    np.testing.assert_array_equal(layout.unshard(shards), flat)
    with pytest.raises(ValueError):
        layout.unshard(shards[:1])


def test_active_ranges_skip_inactive_variables():
    layout = FlatLayout.from_variables(_vars((4,), (3,), (5,), (2,)), 2, bucket_size=7)
    # Shard 0: bucket 0 piece = flat [0, 4) (v0), bucket 1 piece = flat [8, 12) (v2 head).
    assert layout.active_ranges(0, (True, True, True, True)) == ((0, 8),)
    assert layout.active_ranges(0, (False, True, True, True)) == ((4, 8),)
    # Shard 1: bucket 0 piece = flat [4, 8) = v1 (3) + padding; bucket 1 = v2 tail + v3.
    assert layout.active_ranges(1, (True, True, False, True)) == ((0, 3), (5, 7))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_shards"):
        FlatLayout.from_variables(_vars((2,)), 0)
    with pytest.raises(ValueError, match="bucket_size"):
        FlatLayout.from_variables(_vars((2,)), 1, bucket_size=0)
    with pytest.raises(ValueError, match="unknown dimension"):
        FlatLayout.from_variables(_vars((None, 2)), 1)
