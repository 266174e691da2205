"""Tests of zero_runtime.memory.flat_store: small shards packed into page-sized chunks.

A real pool with 64 KiB pages (16,384 float32 per chunk), two replicas, real NVMe slab
files in tmp_path.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import test_memory_pool
from zero_runtime.memory import PagedBufferPool, PoolOutOfMemoryError
from zero_runtime.memory.flat_store import ChunkState, FlatRange, FlatShardSpace, copy_columns

PS = 64 << 10  # bytes per page
C = PS // 4  # float32 elements per chunk
REPLICAS = (0, 1)


def make_pool(tmp_path, host_pages: int = 16, nvme_pages: int | None = None) -> PagedBufferPool:
    """A pool of ``host_pages`` host pages and ``nvme_pages`` NVMe pages (None: no NVMe)."""
    return test_memory_pool.make_pool(tmp_path, host=host_pages, nvme=nvme_pages)


def values(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_small_ranges_share_pages_at_most_one_partial_page_per_replica(tmp_path):
    # The sizes of a tied GPT's 19 shards, and a few larger ones.
    sizes = [104, 8, 8, 128, 8, 128, 8, 128, 8, 128, 8, 8, 8, 256, 16, 256, 8, 8, 8]
    sizes += [C - 5, 3 * C + 7, 11]
    with make_pool(tmp_path) as pool:
        space = FlatShardSpace(pool, "host", REPLICAS)
        ranges = [space.reserve(n) for n in sizes]
        total = sum(sizes)
        assert [r.offset for r in ranges] == list(np.cumsum([0, *sizes[:-1]]))
        assert space.reserved_elements == total
        chunks = -(-total // C)
        assert space.allocated_chunks == chunks
        host = pool.usage()["host"]
        assert host.used_bytes == host.bytes_by_kind["param"] == chunks * PS * len(REPLICAS)
        assert host.used_bytes <= 4 * total * len(REPLICAS) + PS * len(REPLICAS)
        assert len(pool.tensor_ids()) == chunks * len(REPLICAS)


def test_write_and_read_round_trip_per_replica_across_chunk_boundaries(tmp_path):
    with make_pool(tmp_path) as pool:
        space = FlatShardSpace(pool, "host", REPLICAS)
        sizes = [10, C - 3, 2 * C + 1, 0, 5]  # the second and third straddle chunks
        ranges = [space.reserve(n) for n in sizes]
        for r in REPLICAS:
            for i, rng in enumerate(ranges):
                space.write(r, rng, values(rng.length, 10 * r + i))
        for r in REPLICAS:
            for i, rng in enumerate(ranges):
                np.testing.assert_array_equal(space.read(r, rng), values(rng.length, 10 * r + i))
        out = np.full(ranges[2].length, -1.0, np.float32)
        space.read_into(1, ranges[2], out)
        np.testing.assert_array_equal(out, values(ranges[2].length, 12))
        assert space.page_ids(0, ranges[2]) == tuple(space.chunk_id(k, 0) for k in (1, 2, 3))
        assert space.page_ids(1, ranges[0]) == (space.chunk_id(0, 1),)
        assert space.page_ids(0, ranges[3]) == ()
        assert space.read(0, ranges[3]).shape == (0,)


def test_update_in_place_in_one_chunk_is_the_page_itself(tmp_path):
    with make_pool(tmp_path) as pool:
        space = FlatShardSpace(pool, "host", REPLICAS)
        a, b = space.reserve(7), space.reserve(2 * C)  # b straddles: a copy written back
        space.write(0, a, np.arange(7, dtype=np.float32))
        space.write(0, b, np.ones(2 * C, np.float32))
        seen = []

        def double(x: np.ndarray) -> None:
            seen.append(x)
            x *= 2

        space.update_in_place(0, a, double)
        space.update_in_place(0, b, double)
        np.testing.assert_array_equal(space.read(0, a), 2 * np.arange(7, dtype=np.float32))
        np.testing.assert_array_equal(space.read(0, b), np.full(2 * C, 2, np.float32))
        assert seen[0].base is not None and not seen[0].flags.owndata  # a view of the page
        assert seen[1].flags.owndata  # the straddling range: a copy
        np.testing.assert_array_equal(space.read(1, a), np.zeros(7, np.float32))  # untouched


def test_nvme_chunks_page_in_for_partial_writes_and_reads(tmp_path):
    with make_pool(tmp_path, host_pages=2, nvme_pages=16) as pool:
        space = FlatShardSpace(pool, "nvme", REPLICAS)
        a, b, c = space.reserve(100), space.reserve(C - 100), space.reserve(C + 50)
        assert pool.usage()["nvme"].used_bytes == 3 * PS * len(REPLICAS)
        for r in REPLICAS:
            for i, rng in enumerate((a, b, c)):
                space.write(r, rng, values(rng.length, 7 * r + i))
        pool.evict(pool.tensor_ids(), "nvme")
        assert pool.usage()["host"].used_bytes == 0
        for r in REPLICAS:
            for i, rng in enumerate((a, b, c)):
                np.testing.assert_array_equal(space.read(r, rng), values(rng.length, 7 * r + i))
        assert pool.usage()["host"].used_bytes <= 2 * PS  # the host budget: a window


def test_release_frees_a_chunk_once_no_range_uses_it(tmp_path):
    with make_pool(tmp_path) as pool:
        space = FlatShardSpace(pool, "host", REPLICAS)
        a, b = space.reserve(10), space.reserve(C)  # b: chunks 0 and 1
        assert space.allocated_chunks == 2
        space.release(a)
        assert space.allocated_chunks == 2  # b still uses chunk 0
        space.release(b)
        assert space.allocated_chunks == 0 and pool.tensor_ids() == []
        assert [ch.state for ch in space._chunks] == [ChunkState.FREED] * 2
        c = space.reserve(4)  # the freed chunk 1 is skipped, never reused
        assert c.offset == 2 * C and space.allocated_chunks == 1
        space.write(1, c, [1, 2, 3, 4])
        np.testing.assert_array_equal(space.read(1, c), [1, 2, 3, 4])


def test_close_frees_every_chunk_and_refuses_later_use(tmp_path):
    with make_pool(tmp_path) as pool:
        space = FlatShardSpace(pool, "host", REPLICAS)
        rng = space.reserve(3 * C)
        space.close()
        space.close()  # idempotent
        assert pool.tensor_ids() == [] and pool.usage()["host"].used_bytes == 0
        with pytest.raises(ValueError, match="closed"):
            space.read(0, rng)
        with pytest.raises(ValueError, match="closed"):
            space.reserve(1)
    FlatShardSpace(make_pool(tmp_path), "host", REPLICAS).close()  # nothing allocated


def test_a_reserve_that_does_not_fit_reserves_nothing(tmp_path):
    with make_pool(tmp_path, host_pages=3) as pool:
        space = FlatShardSpace(pool, "host", REPLICAS)
        space.reserve(5)  # chunk 0 on both replicas: 2 of 3 pages
        with pytest.raises(PoolOutOfMemoryError):
            space.reserve(C)  # needs chunk 1 on both replicas: 2 more pages
        assert space.reserved_elements == 5 and space.allocated_chunks == 1
        assert pool.usage()["host"].used_bytes == 2 * PS
        assert space.reserve(C - 5) == FlatRange(5, C - 5)  # still fits chunk 0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s, r: s.reserve(-1), "length must be an integer >= 0"),
        (lambda s, r: s.reserve(2.0), "length must be an integer >= 0"),
        (lambda s, r: s.write(0, r, np.zeros(3)), "3 elements given for a range of 4"),
        (lambda s, r: s.read_into(0, r, np.zeros(5, np.float32)), "5 elements given"),
        (lambda s, r: s.read(2, r), "replica 2 is not one of"),
        (lambda s, r: s.read(0, FlatRange(2, 9)), "never reserved"),
    ],
)
def test_bad_arguments_name_the_value(tmp_path, call, match):
    with make_pool(tmp_path) as pool:
        space = FlatShardSpace(pool, "host", REPLICAS)
        rng = space.reserve(4)
        with pytest.raises(ValueError, match=match):
            call(space, rng)


def test_bad_tier_and_replicas_are_refused(tmp_path):
    with make_pool(tmp_path) as pool:
        with pytest.raises(ValueError, match="tier must be one of"):
            FlatShardSpace(pool, "device", REPLICAS)
        with pytest.raises(ValueError, match="replicas must be distinct"):
            FlatShardSpace(pool, "host", (0, 0))
        with pytest.raises(ValueError, match="replicas must be distinct"):
            FlatShardSpace(pool, "host", ())


@pytest.mark.parametrize("width, lo, hi", [(7, 2, 5), (C // 4 + 3, 0, 100), (3 * C, C - 2, C + 9)])
def test_copy_columns_from_pieces_cut_anywhere_equals_numpy_slicing(width, lo, hi):
    # A row-major matrix cut into pieces at arbitrary points (pages of a shard): the
    # band copied piece by piece is the matrix's [:, lo:hi], every element once.
    rows = 11
    matrix = values(rows * width, 5).reshape(rows, width)
    flat = matrix.reshape(-1)
    rng = np.random.default_rng(width)
    cuts = np.sort(rng.choice(np.arange(1, flat.size), size=9, replace=False))
    out = np.full((rows, hi - lo), np.nan, np.float32)
    first = 0
    for piece in np.split(flat, cuts):
        copy_columns(piece, first, width, lo, hi, out)
        first += piece.size
    np.testing.assert_array_equal(out, matrix[:, lo:hi])


def test_read_columns_into_pages_in_the_band_of_a_range_across_chunks(tmp_path):
    with make_pool(tmp_path, host_pages=8, nvme_pages=32) as pool:
        space = FlatShardSpace(pool, "nvme", REPLICAS)
        space.reserve(123)  # the range starts inside a chunk
        width = 1000
        rng = space.reserve(40 * width)  # 40,000 elements: 3 chunks of 16,384
        data = {r: values(rng.length, 20 + r) for r in REPLICAS}
        for r in REPLICAS:
            space.write(r, rng, data[r])
        pool.evict(pool.tensor_ids(), "nvme")
        for r in REPLICAS:
            out = np.empty((40, 250), np.float32)
            space.read_columns_into(r, rng, width, 600, 850, out)
            np.testing.assert_array_equal(out, data[r].reshape(40, width)[:, 600:850])
        with pytest.raises(ValueError, match="width 999 must be >= 1 and divide"):
            space.read_columns_into(0, rng, 999, 0, 1, np.empty(40, np.float32))
        with pytest.raises(ValueError, match=r"columns \[900, 1001\) must lie within"):
            space.read_columns_into(0, rng, width, 900, 1001, np.empty(4040, np.float32))
