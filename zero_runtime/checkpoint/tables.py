"""Row-paged embedding tables in a checkpoint: their rows and their lazy optimizer states.

A stage-3 row-paged table (:class:`~zero_runtime.stage3.embedding.RowPagedTable`, float32
``(V, C)``) is a parameter outside the optimizer's flat layout: replica ``r`` owns rows
``[r * R, (r + 1) * R)`` (``R = ceil(V / N)``), stored as *row pages* of ``P`` rows, and
its optimizer states exist only for the row pages some step touched (lazy Adam/SGD,
:class:`~zero_runtime.stage3.embedding.RowPagedEmbedding`). In a replica's shard file,
after the flat groups, each table (in parameter order) adds:

- its rows: the replica's valid rows (padding rows beyond ``V`` are not saved),
  ``[valid * C]`` float32;
- then, per optimizer slot, the rows of every row page that has states, page by page
  (ascending), each clipped to ``V``.

The index lists, per table, the row pages with states of every saving replica
(``partition.row_paged[].state_pages``) and the global row ranges they cover
(``state_rows``); the slot tensors (``slot/<s>/<i>``) are *sparse*: their segments cover
those rows only and every other element is zero. Restoring onto another replica count
re-pages the rows: a current row page gets states when any of its rows has saved states
(the rest of the page zero, as a page touched for the first time), and no others.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from zero_runtime.checkpoint import index as ix


@dataclasses.dataclass(frozen=True)
class TableGeometry:
    """The partition of one row-paged table at save time.

    Attributes:
        vocab: V, rows of the table.
        width: C, elements per row.
        rows: R, rows per replica shard (``ceil(V / N)``).
        rows_per_page: P, rows per row page.
        pages_per_shard: row pages per shard, ``ceil(R / P)``.
    """

    vocab: int
    width: int
    rows: int
    rows_per_page: int
    pages_per_shard: int

    @classmethod
    def of(cls, table: Any) -> TableGeometry:
        """The geometry of a :class:`RowPagedTable`."""
        vocab, width = (int(d) for d in table.shape)
        return cls(vocab, width, table.rows, table.rows_per_page, table.pages_per_shard)

    def replica_rows(self, replica: int) -> tuple[int, int]:
        """Global rows ``[lo, hi)`` replica ``replica`` owns, clipped to V (may be empty)."""
        lo = min(self.vocab, replica * self.rows)
        return lo, min(self.vocab, lo + self.rows)

    def page_rows(self, replica: int, page: int) -> tuple[int, int]:
        """Global rows ``[lo, hi)`` of row page ``page`` of ``replica``, clipped to V."""
        start = replica * self.rows + page * self.rows_per_page
        end = min(start + self.rows_per_page, (replica + 1) * self.rows)
        return min(start, self.vocab), min(end, self.vocab)


def replica_arrays(
    embedding: Any, replica: int, slots: tuple[str, ...]
) -> tuple[list[np.ndarray], list[int]]:
    """What ``replica`` saves for one table: ``(arrays in file order, pages with states)``.

    Args:
        embedding: the :class:`RowPagedEmbedding` (``replica`` must be local).
        replica: the global replica id.
        slots: the optimizer's slot names.

    Returns:
        The arrays (float32, 1-D: the valid rows, then per slot each state page's valid
        rows) and the row pages with states, ascending.
    """
    table = embedding.table
    geo = TableGeometry.of(table)
    lo, hi = geo.replica_rows(replica)
    arrays = [table.read_shard(replica)[: (hi - lo) * geo.width]]
    pages = embedding.state_pages(replica) if slots else []
    for slot in slots:
        for k in pages:
            a, b = geo.page_rows(replica, k)
            arrays.append(embedding.read_state_page(replica, k, slot)[: b - a].reshape(-1))
    return arrays, pages


def replica_segments(
    geo: TableGeometry,
    replica: int,
    pages: list[int],
    slots: tuple[str, ...],
    file: str,
    offset: int,
) -> tuple[ix.Segment, dict[str, list[ix.Segment]], int]:
    """Where :func:`replica_arrays`' arrays are in ``file`` from byte ``offset``.

    Returns:
        ``(the rows' segment, {slot: state segments}, the byte offset after them)``.
    """
    lo, hi = geo.replica_rows(replica)
    rows = ix.Segment(file, offset, lo * geo.width, (hi - lo) * geo.width)
    offset += 4 * (hi - lo) * geo.width
    states: dict[str, list[ix.Segment]] = {}
    for slot in slots:
        segs = []
        for k in pages:
            a, b = geo.page_rows(replica, k)
            if b > a:
                segs.append(ix.Segment(file, offset, a * geo.width, (b - a) * geo.width))
            offset += 4 * (b - a) * geo.width
        states[slot] = segs
    return rows, states, offset


def merged_rows(segments: list[ix.Segment], width: int) -> list[list[int]]:
    """The global row ranges ``[[lo, hi), ...]`` the segments cover, merged, ascending."""
    spans = sorted((s.start // width, (s.start + s.count) // width) for s in segments)
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def restore_states(
    embedding: Any,
    replicas: tuple[int, ...],
    values: dict[str, np.ndarray],
    covered: np.ndarray,
) -> int:
    """Load a table's saved optimizer states into this process's replicas' row pages.

    Every current state page of ``replicas`` is freed first; then a row page gets states
    (all slots) when any of its rows is ``covered`` (had states when saved).

    Args:
        embedding: the current :class:`RowPagedEmbedding`.
        replicas: this process's replica ids.
        values: slot -> float32 ``(V, C)`` (zeros where nothing was saved).
        covered: bool ``(V,)``, rows whose states were saved.

    Returns:
        State pages written (row pages x slots).
    """
    table = embedding.table
    geo = TableGeometry.of(table)
    written = 0
    for r in replicas:
        embedding.clear_states(r)
        for k in range(geo.pages_per_shard):
            lo, hi = geo.page_rows(r, k)
            if hi <= lo or not covered[lo:hi].any():
                continue
            for slot, full in values.items():
                rows = np.zeros((table.page_rows(k), geo.width), np.float32)
                rows[: hi - lo] = full[lo:hi]
                embedding.write_state_page(r, k, slot, rows)
                written += 1
    return written
