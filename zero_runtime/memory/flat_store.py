"""FlatShardSpace: many small float32 shards packed into page-sized chunks of a pool.

Without packing, every stage-3 parameter shard is its own pool tensor of at least one
whole page, so a model of many small variables (biases, norms) takes a page per variable
per replica: a 2,464-parameter GPT with 19 variables and 2 replicas held 38 pages
(159 MB with 4 MiB pages) for 9,856 bytes of parameters. Packing them one after the
other into a flat per-replica space costs at most one partly filled page per replica
(DeepSpeed's flat partitions, Colossal-AI's chunks).

Vocabulary:

- *space*: one flat float32 address space per local replica, in elements; every
  replica's space has the same layout.
- *range*: ``(offset, length)`` in elements, handed out by a bump allocator
  (:meth:`FlatShardSpace.reserve`); the same range holds a variable's shard on every
  replica.
- *chunk*: ``CHUNK = page_size_bytes // 4`` consecutive elements of one replica's space,
  stored as one pool tensor of one page (float32 ``[CHUNK]``, kind 'param') on the
  space's tier. One page, so that ``PagedBufferPool.acquire`` on the host returns a view
  of the page itself (a multi-page acquire returns a copy). A range may straddle chunks.

Chunk lifecycle (:class:`ChunkState`): a chunk is allocated for every local replica when
the bump pointer first enters it (ALLOCATED), and freed when the last range overlapping
it is released (FREED; the bump pointer then skips the rest of it, so a freed chunk is
never reused). The space is OPEN until :meth:`FlatShardSpace.close` (CLOSED), which frees
every chunk.

Reads and writes bring the chunks a range overlaps to the host (``acquire``: an NVMe
chunk is paged in and stays on the host until the pool evicts it), one chunk at a time,
so the pool's access order and prefetch work on chunk ids (:meth:`page_ids`).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from zero_runtime.memory.pool import PagedBufferPool

#: Tiers a space may live on: host-addressable pages (the device tier's pages are
#: TensorFlow tensors, not writable views).
SPACE_TIERS = ("host", "nvme")


class SpaceState(enum.Enum):
    """Lifecycle of a :class:`FlatShardSpace`: OPEN (ranges reserved, read, written),
    CLOSED (every chunk freed; every method but ``close`` raises)."""

    OPEN = "open"
    CLOSED = "closed"


class ChunkState(enum.Enum):
    """Lifecycle of one chunk (all local replicas' pool tensors at once). ALLOCATED:
    counts one page per local replica on the space's tier. FREED: counts nothing."""

    ALLOCATED = "allocated"
    FREED = "freed"


@dataclasses.dataclass(frozen=True)
class FlatRange:
    """A range of a flat space, in float32 elements: ``[offset, offset + length)``."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        """One past the last element."""
        return self.offset + self.length


@dataclasses.dataclass
class _Chunk:
    """One chunk's record: its state and the ranges overlapping it that are not released."""

    state: ChunkState
    live: int = 0


@dataclasses.dataclass(frozen=True)
class _Piece:
    """The part of a range inside one chunk: chunk ``index``, elements ``[lo, hi)`` of the
    chunk, elements ``[start, start + hi - lo)`` of the range."""

    index: int
    lo: int
    hi: int
    start: int

    @property
    def stop(self) -> int:
        return self.start + self.hi - self.lo


class FlatShardSpace:
    """Per-replica flat float32 spaces over page-sized chunks of a paged pool.

    Args:
        pool: the :class:`~zero_runtime.memory.PagedBufferPool` that holds the chunks.
        tier: 'host' or 'nvme', where new chunks are allocated (:data:`SPACE_TIERS`).
        replicas: the local replica ids whose spaces this process holds (non-empty,
            distinct, >= 0).
        name: a label in the chunks' pool ids (``p/<name>#<id>/c<k>/r<replica>``).

    Attributes:
        chunk_elements: float32 elements per chunk, ``pool.page_size // 4``.

    Raises:
        ValueError: a tier outside :data:`SPACE_TIERS`, or a bad replica list.
    """

    def __init__(
        self, pool: PagedBufferPool, tier: str, replicas: Sequence[int], *, name: str = "flat"
    ) -> None:
        if tier not in SPACE_TIERS:
            raise ValueError(f"FlatShardSpace tier must be one of {SPACE_TIERS}, got {tier!r}")
        reps = tuple(int(r) for r in replicas)
        if not reps or len(set(reps)) != len(reps) or min(reps) < 0:
            raise ValueError(f"replicas must be distinct ids >= 0, got {tuple(replicas)!r}")
        self.pool = pool
        self.tier = tier
        self.replicas = reps
        self.chunk_elements = pool.page_size // 4
        self._prefix = f"p/{name.replace('/', '.')}#{id(self):x}"
        self._chunks: list[_Chunk] = []  # index k: elements [k * C, (k + 1) * C)
        self._bump = 0  # the next free element (elements before it are handed out)
        self._lock = threading.Lock()
        self.state = SpaceState.OPEN

    # -- geometry ----------------------------------------------------------------------
    @property
    def reserved_elements(self) -> int:
        """Elements handed out so far (the bump pointer), per replica."""
        return self._bump

    @property
    def allocated_chunks(self) -> int:
        """Chunks ALLOCATED now (each one page per local replica)."""
        return sum(c.state is ChunkState.ALLOCATED for c in self._chunks)

    def chunk_id(self, index: int, replica: int) -> str:
        """The pool tensor id of chunk ``index`` of ``replica``'s space."""
        return f"{self._prefix}/c{index}/r{replica}"

    def page_ids(self, replica: int, rng: FlatRange) -> tuple[str, ...]:
        """The pool tensor ids of the chunks ``rng`` overlaps on ``replica``, in order
        (empty for an empty range)."""
        return tuple(self.chunk_id(p.index, replica) for p in self._pieces(rng))

    # -- allocation --------------------------------------------------------------------
    def reserve(self, length: int) -> FlatRange:
        """Hand out the next ``length`` elements of every replica's space; allocate (on
        the space's tier, zero-filled) the chunks the range enters that are not yet
        allocated.

        Raises:
            ValueError: a negative or non-integer ``length``; a closed space.
            PoolOutOfMemoryError: a chunk does not fit its tier (nothing is reserved).
        """
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise ValueError(f"length must be an integer >= 0 (elements), got {length!r}")
        with self._lock:
            self._check_open("reserve")
            rng = FlatRange(self._bump, int(length))
            pieces = list(self._pieces(rng))
            new = [p.index for p in pieces if p.index >= len(self._chunks)]
            for done, k in enumerate(new):
                try:
                    self._allocate(k)
                except BaseException:
                    for j in new[:done]:
                        self._free(j)
                    del self._chunks[new[0] :]
                    raise
                self._chunks.append(_Chunk(ChunkState.ALLOCATED))
            for p in pieces:
                self._chunks[p.index].live += 1
            self._bump = rng.end
            return rng

    def release(self, rng: FlatRange) -> None:
        """Give ``rng`` back: chunks no other live range overlaps are freed on every
        replica. Releasing a range twice or a range not reserved corrupts the counts:
        the owner (a ShardedVariable's ShardStorage) releases its range once.

        Raises:
            ValueError: a closed space, or a range beyond the bump pointer.
        """
        with self._lock:
            self._check_open("release")
            if rng.end > self._bump:
                raise ValueError(f"range {rng} was never reserved (bump at {self._bump})")
            for p in self._pieces(rng):
                chunk = self._chunks[p.index]
                chunk.live -= 1
                if chunk.live == 0 and chunk.state is ChunkState.ALLOCATED:
                    self._free(p.index)
                    chunk.state = ChunkState.FREED
                    if self._bump // self.chunk_elements == p.index:
                        self._bump = (p.index + 1) * self.chunk_elements  # never reuse it

    def close(self) -> None:
        """OPEN -> CLOSED: free every allocated chunk (a closed pool has freed them
        already). Idempotent."""
        with self._lock:
            if self.state is SpaceState.CLOSED:
                return
            self.state = SpaceState.CLOSED
            if self.pool.closed:
                return
            for k, chunk in enumerate(self._chunks):
                if chunk.state is ChunkState.ALLOCATED:
                    self._free(k)
                    chunk.state = ChunkState.FREED

    # -- data --------------------------------------------------------------------------
    def read_into(self, replica: int, rng: FlatRange, out: np.ndarray) -> None:
        """Copy ``replica``'s elements of ``rng`` into ``out`` (float32 ``[rng.length]``,
        writable), chunk by chunk through the host.

        Raises:
            ValueError: ``out`` of another size; an unknown replica; a closed space.
        """
        self._check_access(replica, rng, out.size)
        out = out.reshape(-1)
        for p in self._pieces(rng):
            cid = self.chunk_id(p.index, replica)
            view = self.pool.acquire(cid, "host")
            try:
                out[p.start : p.stop] = view[p.lo : p.hi]
            finally:
                self.pool.release(cid)

    def read_columns_into(
        self, replica: int, rng: FlatRange, width: int, lo: int, hi: int, out: np.ndarray
    ) -> None:
        """Copy columns ``[lo, hi)`` of ``replica``'s elements of ``rng``, seen as a
        row-major float32 ``[rng.length // width, width]`` matrix, into ``out`` (float32
        ``[rows, hi - lo]``, writable): from each chunk's page, the band only
        (:func:`copy_columns`; a column tile of a kernel shard without a copy of the rest).

        Raises:
            ValueError: ``width`` does not divide ``rng.length``, ``[lo, hi)`` not within
                ``[0, width]``, ``out`` of another shape; an unknown replica; a closed space.
        """
        rows = column_band_rows(rng.length, width, lo, hi, out)
        self._check_access(replica, rng, rng.length)
        for p in self._pieces(rng):
            cid = self.chunk_id(p.index, replica)
            view = self.pool.acquire(cid, "host")
            try:
                copy_columns(view[p.lo : p.hi], p.start, width, lo, hi, out.reshape(rows, -1))
            finally:
                self.pool.release(cid)

    def read(self, replica: int, rng: FlatRange) -> np.ndarray:
        """A copy of ``replica``'s elements of ``rng``, float32 ``[rng.length]``."""
        out = np.empty(rng.length, np.float32)
        self.read_into(replica, rng, out)
        return out

    def write(self, replica: int, rng: FlatRange, values: np.ndarray) -> None:
        """Store ``values`` (``rng.length`` elements, cast to float32) as ``replica``'s
        elements of ``rng``. A chunk covered whole is written where its page is (no page
        move); a partly covered one is brought to the host and updated there.

        Raises:
            ValueError: ``values`` of another size; an unknown replica; a closed space.
        """
        flat = np.asarray(values, np.float32).reshape(-1)
        self._check_access(replica, rng, flat.size)
        for p in self._pieces(rng):
            cid = self.chunk_id(p.index, replica)
            if p.lo == 0 and p.hi == self.chunk_elements:
                self.pool.write(cid, flat[p.start : p.stop])
                continue
            view = self.pool.acquire(cid, "host", writable=True)
            try:
                view[p.lo : p.hi] = flat[p.start : p.stop]
            finally:
                self.pool.release(cid)

    def update_in_place(
        self, replica: int, rng: FlatRange, fn: Callable[[np.ndarray], None]
    ) -> None:
        """Run ``fn`` on a writable float32 ``[rng.length]`` array of ``replica``'s
        elements of ``rng``, which it updates in place: a view of the page itself when
        the range lies in one chunk, else a copy written back after ``fn`` returns (not
        written back when ``fn`` raises).

        Raises:
            ValueError: an unknown replica; a closed space.
        """
        self._check_access(replica, rng, rng.length)
        pieces = list(self._pieces(rng))
        if len(pieces) != 1:
            values = self.read(replica, rng)
            fn(values)
            self.write(replica, rng, values)
            return
        p = pieces[0]
        cid = self.chunk_id(p.index, replica)
        view = self.pool.acquire(cid, "host", writable=True)
        try:
            fn(view[p.lo : p.hi])
        finally:
            self.pool.release(cid)

    # -- helpers -----------------------------------------------------------------------
    def _pieces(self, rng: FlatRange) -> Iterator[_Piece]:
        c = self.chunk_elements
        pos = rng.offset
        while pos < rng.end:
            k = pos // c
            hi = min(rng.end, (k + 1) * c)
            yield _Piece(k, pos - k * c, hi - k * c, pos - rng.offset)
            pos = hi

    def _allocate(self, index: int) -> None:
        done = []
        try:
            for r in self.replicas:
                cid = self.chunk_id(index, r)
                self.pool.allocate(cid, (self.chunk_elements,), np.float32, "param", self.tier)
                done.append(cid)
        except BaseException:
            for cid in done:
                self.pool.free(cid)
            raise

    def _free(self, index: int) -> None:
        for r in self.replicas:
            self.pool.free(self.chunk_id(index, r))

    def _check_open(self, what: str) -> None:
        if self.state is not SpaceState.OPEN:
            raise ValueError(f"FlatShardSpace.{what}: the space is closed")

    def _check_access(self, replica: int, rng: FlatRange, size: int) -> None:
        self._check_open("access")
        if replica not in self.replicas:
            raise ValueError(f"replica {replica!r} is not one of this space's {self.replicas}")
        if size != rng.length:
            raise ValueError(f"{size} elements given for a range of {rng.length} ({rng})")
        if rng.end > self._bump:
            raise ValueError(f"range {rng} was never reserved (bump at {self._bump})")

    def __repr__(self) -> str:
        return (
            f"<FlatShardSpace tier={self.tier} replicas={self.replicas} "
            f"reserved={self._bump} chunks={self.allocated_chunks}x{self.chunk_elements}>"
        )


def column_band_rows(length: int, width: int, lo: int, hi: int, out: np.ndarray) -> int:
    """Rows of a ``[length // width, width]`` matrix whose columns ``[lo, hi)`` go to
    ``out``; raises ValueError naming the bad argument."""
    if width < 1 or length % width:
        raise ValueError(f"width {width} must be >= 1 and divide the {length} elements")
    if not 0 <= lo <= hi <= width:
        raise ValueError(f"columns [{lo}, {hi}) must lie within [0, {width}]")
    rows = length // width
    if out.size != rows * (hi - lo):
        raise ValueError(
            f"out has {out.size} elements; columns [{lo}, {hi}) of {rows} rows "
            f"need {rows * (hi - lo)}"
        )
    return rows


def copy_columns(
    values: np.ndarray, first: int, width: int, lo: int, hi: int, out: np.ndarray
) -> None:
    """Copy the part of a column band held by one piece of a row-major matrix.

    The matrix has ``width`` columns; ``values`` (1-D) holds its flat elements
    ``[first, first + values.size)`` (e.g. one page of a shard). Each of those elements
    whose column ``index % width`` lies in ``[lo, hi)`` is written to
    ``out[index // width, column - lo]``; ``out`` is ``[rows, hi - lo]``. Rows the piece
    holds whole are copied as one strided block, the (at most two) rows it cuts one
    segment each.
    """
    end = first + values.size
    if end <= first or hi <= lo:
        return
    full_lo, full_hi = -(-first // width), end // width  # rows held whole: [full_lo, full_hi)
    if full_lo < full_hi:
        block = values[full_lo * width - first : full_hi * width - first]
        out[full_lo:full_hi] = block.reshape(full_hi - full_lo, width)[:, lo:hi]
    for r in sorted({first // width, (end - 1) // width} - set(range(full_lo, full_hi))):
        a, b = max(first, r * width + lo), min(end, r * width + hi)
        if a < b:
            out[r, a - r * width - lo : b - r * width - lo] = values[a - first : b - first]
