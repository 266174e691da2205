"""Optimizer state shards on NVMe, streamed through the paged buffer pool by sub-group.

ZeRO-Infinity (Rajbhandari et al., SC21, sections 5.2 and 6.3): the optimizer states of
each replica's shard live on NVMe; the update walks the shard in *sub-groups* of
``sub_group_size`` elements. While sub-group ``j`` is updated on the host, sub-group
``j + 1`` is read ahead (``PagedBufferPool.prefetch``) and sub-group ``j - 1`` is written
behind (``PagedBufferPool.evict`` on a background thread), so NVMe I/O overlaps the
host compute. At the end of the update every written sub-group is back on NVMe; between
steps the host holds only the pool's (empty or cached) page slots.

Tensor ids in the pool: ``"{prefix}/r{replica}/g{subgroup}/{slot}"``, kind
``'optimizer'``, float32 ``[subgroup elements]``.

Steps are transactions (:class:`StepTransaction`): before a sub-group's states change for
the first time in a step, its old values are kept in an undo journal (a sub-group
allocated by the step is noted as new), so a step that fails part-way (an NVMe write that
hits ``ENOSPC``, a read error) is rolled back exactly: every state as before the step.
The optimizer decides (:meth:`NvmeOptimizerState.resolve`) from its step counter: a step
whose counter advanced commits (the journal is dropped), any other rolls back. The journal
holds at most one slot set of the sub-groups the step updated (float32) until the step
commits, right after the optimizer's ``iterations`` increments: on the host while it fits
beside the window; past that a changed sub-group is copied to its other generation and
the previous one stays on NVMe until the commit (shadow paging, :mod:`.state_journal`).

The window is sized once (:func:`stream_window`); checkpoints read and overwrite the
states between steps through :mod:`.nvme_access`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np
import psutil

from zero_runtime.memory import PagedBufferPool
from zero_runtime.optim import kernels, nvme_access
from zero_runtime.optim.host_state import StepFn, run_tiles
from zero_runtime.optim.layout import FlatLayout
from zero_runtime.optim.state_journal import StateTransactions, StepTransaction

logger = logging.getLogger(__name__)

#: Sub-groups whose pages the host tier holds at once per replica: the one being
#: updated, its previous generation while it is copied (past the host journal), the one
#: read ahead and the one being written behind.
_LIVE_SUBGROUPS = 4

#: Sub-groups of later calls (:meth:`NvmeOptimizerState.expect`) read ahead while a
#: call updates its own: the window's "sub-group read ahead".
READ_AHEAD = 1

#: Without a host budget, the share of the host's available memory
#: (``psutil.virtual_memory().available``) the streamed window may take.
WINDOW_SHARE = 0.25


def window_bytes(sub_group: int, n_slots: int, n_shards: int, page_size: int) -> int:
    """Host bytes of the streamed window: 4 sub-groups (the one being updated, its previous
    generation while copied, the one read ahead, the one written behind) of every slot
    (at least 1) of every replica, each ``sub_group`` float32 elements in whole pages of
    ``page_size`` bytes."""
    pages = -(-sub_group * 4 // page_size)
    return _LIVE_SUBGROUPS * max(1, n_slots) * n_shards * pages * page_size


def bounded_subgroup(
    requested: int, n_slots: int, n_shards: int, page_size: int, allowed_bytes: int
) -> int:
    """The sub-group size the NVMe store uses: ``requested`` elements, or fewer if the
    window (:func:`window_bytes`) of ``requested``-element sub-groups would not fit in
    ``allowed_bytes``.

    A reduced sub-group is a whole number of pages (``page_size / 4`` elements), at least
    one page, so the window exceeds ``allowed_bytes`` only when even one page per
    sub-group does not fit.

    Args:
        requested: ``sub_group_size`` (elements, >= 1), already capped at the shard size.
        n_slots: state buffers per element (e.g. 2 for Adam's m and v).
        n_shards: replicas whose shards this store streams.
        page_size: the pool's page size (bytes).
        allowed_bytes: host bytes the window may take.

    Returns:
        Elements per sub-group (``<= requested``).
    """
    if window_bytes(requested, n_slots, n_shards, page_size) <= allowed_bytes:
        return requested
    page_elements = page_size // 4
    pages = allowed_bytes // window_bytes(page_elements, n_slots, n_shards, page_size)
    return min(requested, max(1, pages) * page_elements)


@dataclasses.dataclass(frozen=True)
class StreamWindow:
    """How the NVMe store streams its states through the host (:func:`stream_window`).

    Attributes:
        sub_group_size: elements per sub-group (``<=`` the requested size).
        journal_host_limit: host bytes one replica's step journal may hold in numpy (what
            the window leaves of the allowance, split evenly over the replicas; >= 0).
        pool_host_bytes: the pool's host tier, bytes: the window (the journal's host
            copies take the rest of the allowance).
    """

    sub_group_size: int
    journal_host_limit: int
    pool_host_bytes: int


def stream_window(
    layout: FlatLayout,
    n_slots: int,
    sub_group_size: int,
    page_size_bytes: int,
    host_budget_bytes: int | None,
) -> StreamWindow:
    """The streamed window of :class:`NvmeOptimizerState` (its arguments of the same names).

    The allowance is ``host_budget_bytes``, or without one :data:`WINDOW_SHARE` of the
    host's available memory now; the sub-group is ``sub_group_size`` capped at the shard
    size, reduced (:func:`bounded_subgroup`) when its window (:func:`window_bytes`) would
    not fit the allowance, which is logged once (warning). The step journal's host copies
    may take what the window leaves; further sub-groups keep their previous generation
    on NVMe instead (state_journal.py).

    Args:
        layout: the flat layout (its ``shard_size`` elements, ``num_shards`` replicas).
        n_slots: state buffers per element.
        sub_group_size: the requested elements per sub-group (>= 1).
        page_size_bytes: the pool's page size, bytes.
        host_budget_bytes: the store's host allowance, bytes, or None.

    Returns:
        The :class:`StreamWindow` (sub-group elements, journal and pool bytes).
    """
    requested = min(sub_group_size, layout.shard_size)
    allowed = (
        host_budget_bytes
        if host_budget_bytes is not None
        else int(psutil.virtual_memory().available * WINDOW_SHARE)
    )
    sub_group = bounded_subgroup(requested, n_slots, layout.num_shards, page_size_bytes, allowed)
    if sub_group < requested:
        logger.warning(
            "sub_group_size=%d: 4 sub-groups of %d state buffer(s) for %d replica(s) "
            "would take %d host bytes, more than the %d allowed (%s); the NVMe "
            "optimizer streams sub-groups of %d elements instead",
            sub_group_size,
            max(1, n_slots),
            layout.num_shards,
            window_bytes(requested, n_slots, layout.num_shards, page_size_bytes),
            allowed,
            "host_budget_bytes"
            if host_budget_bytes is not None
            else f"{WINDOW_SHARE:.0%} of the available host memory",
            sub_group,
        )
    window = window_bytes(sub_group, n_slots, layout.num_shards, page_size_bytes)
    return StreamWindow(
        sub_group_size=sub_group,
        journal_host_limit=max(0, allowed - window) // layout.num_shards,
        # The pool holds the window; the journal's host copies take the rest of the
        # allowance (the pool sized to the whole allowance would let both fill it).
        pool_host_bytes=window,
    )


@dataclasses.dataclass
class _Replica:
    """Bookkeeping of one replica's streamed shard (one record per replica)."""

    allocated: set[int] = dataclasses.field(default_factory=set)
    #: sub-group -> its current generation (0 or 1; absent: 0), see ``tensor_id``.
    generation: dict[int, int] = dataclasses.field(default_factory=dict)
    scratch: tuple[np.ndarray, np.ndarray] | None = None
    updates: int = 0
    txn: StepTransaction | None = None
    #: Ranges of updates queued after the running one, in order (:meth:`expect`).
    expected: collections.deque = dataclasses.field(default_factory=collections.deque)


class NvmeOptimizerState(StateTransactions):
    """Optimizer-state shards paged to NVMe, updated sub-group by sub-group.

    Args:
        layout: the flat layout of the optimizer's trainable variables.
        slot_names: per-element state buffers (e.g. ``("momentum", "velocity")``).
        nvme_path: an existing writable directory for the pool's slab file.
        sub_group_size: elements per sub-group (int >= 1; DeepSpeed's ``sub_group_size``).
        page_size_bytes: pool page size, bytes (power of two >= 64 KiB).
        host_budget_bytes: the host bytes the store may hold (ZeroConfig
            ``optimizer_host_budget_bytes``): its pool's host tier, the window of ``4``
            sub-groups of every slot for every local replica (:func:`window_bytes`), and
            the step journal's host copies in what the window leaves; or None (default).
            The sub-group is reduced (:func:`bounded_subgroup`) when those would not fit
            this budget, or, without one, :data:`WINDOW_SHARE` of the available host
            memory: so the host holds a bounded window of the states at any
            ``sub_group_size`` (DeepSpeed's default 1e9 would otherwise put a whole
            billion-element shard's states in host memory). A reduction is logged once
            (warning); results are the same (the update is elementwise).
        nvme_budget_bytes: bytes the pool may write under ``nvme_path``, or None.
        prefix: tensor-id prefix in the pool (unique per optimizer).
        tile: elements per update tile (default ``kernels.tile_elements()``).

    Raises:
        ValueError: ``sub_group_size`` < 1 or a bad pool argument.
        zero_runtime.memory.NvmePathError: ``nvme_path`` unusable.
    """

    tier = "nvme"

    def __init__(
        self,
        layout: FlatLayout,
        slot_names: tuple[str, ...],
        nvme_path: str,
        sub_group_size: int,
        page_size_bytes: int,
        host_budget_bytes: int | None = None,
        nvme_budget_bytes: int | None = None,
        prefix: str = "opt",
        tile: int | None = None,
    ) -> None:
        if sub_group_size < 1:
            raise ValueError(f"sub_group_size must be >= 1, got {sub_group_size}")
        self.layout = layout
        self.slot_names = tuple(slot_names)
        window = stream_window(
            layout, len(self.slot_names), sub_group_size, page_size_bytes, host_budget_bytes
        )
        self.sub_group_size = window.sub_group_size
        self.journal_host_limit = window.journal_host_limit
        self.prefix = prefix
        tile = kernels.tile_elements() if tile is None else tile
        self.tile = max(1, min(tile, self.sub_group_size))
        self.pool = PagedBufferPool(
            host_budget_bytes=window.pool_host_bytes,
            page_size_bytes=page_size_bytes,
            nvme_path=nvme_path,
            nvme_budget_bytes=nvme_budget_bytes,
        )
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zr-wb")
        self._replicas: dict[int, _Replica] = {}
        self._lock = threading.Lock()
        self._peak_host = 0  # bytes: see peak_nbytes
        #: Called before the shard is read or overwritten from outside a step
        #: (:meth:`read_shard`, :meth:`write_shard`, :meth:`slot_values`): the optimizer
        #: resolves uncommitted steps there (its parameters too). None: a finished step
        #: is committed, an unfinished one rolled back.
        self.before_access: Callable[[], None] | None = None

    # -- sub-groups ---------------------------------------------------------------------
    @property
    def num_subgroups(self) -> int:
        """Sub-groups per shard, ``ceil(shard_size / sub_group_size)``."""
        return -(-self.layout.shard_size // self.sub_group_size)

    def subgroup_range(self, j: int) -> tuple[int, int]:
        """Shard-local ``[start, end)`` of sub-group ``j``."""
        start = j * self.sub_group_size
        return start, min(self.layout.shard_size, start + self.sub_group_size)

    def tensor_id(self, replica: int, j: int, slot: str, generation: int | None = None) -> str:
        """The pool tensor id of one slot of one sub-group: of its current generation
        (default; the committed one outside a step), or of ``generation`` (0 or 1).

        A step that changes a sub-group past its host journal writes a new generation
        and keeps the previous one on NVMe until it commits (shadow paging:
        :meth:`StateTransactions._shadow`); ids: ``"{prefix}/r{replica}/g{j}/{slot}"``
        (generation 0) and ``"{prefix}/r{replica}/g{j}.1/{slot}"`` (generation 1)."""
        if generation is None:
            generation = self._record(replica).generation.get(j, 0)
        return f"{self.prefix}/r{replica}/g{j}{'.1' if generation else ''}/{slot}"

    def _ids(self, replica: int, j: int) -> list[str]:
        return [self.tensor_id(replica, j, s) for s in self.slot_names]

    def _record(self, replica: int) -> _Replica:
        if not 0 <= replica < self.layout.num_shards:
            raise ValueError(f"replica {replica} out of range [0, {self.layout.num_shards})")
        with self._lock:
            return self._replicas.setdefault(replica, _Replica())

    def _ensure_allocated(self, rec: _Replica, replica: int, j: int) -> None:
        if j in rec.allocated:
            return
        start, end = self.subgroup_range(j)
        if rec.txn is not None:
            rec.txn.undo.setdefault(j, None)  # new in this step: a rollback frees it
        done = []
        try:
            for tid in self._ids(replica, j):
                self.pool.allocate(tid, (end - start,), np.float32, kind="optimizer", tier="host")
                done.append(tid)
        except BaseException:
            for tid in done:
                self.pool.free(tid)
            raise
        rec.allocated.add(j)

    # -- read-ahead across calls ---------------------------------------------------------
    def expect(self, replica: int, ranges: Sequence[tuple[int, int]]) -> None:
        """Note that an update of ``ranges`` (shard-local ``[start, end)``) is queued for
        ``replica`` after those running or noted before: while the store updates the
        current call's sub-groups it reads the next calls' first sub-groups ahead
        (:data:`READ_AHEAD` of them), so a call's first read does not wait for the disk.
        The stage-3 update in backward notes each block as its gradient is queued
        (backward_update.py); a call whose ranges are not noted is read as it comes."""
        rec = self._record(replica)
        with self._lock:
            rec.expected.append(tuple((int(s), int(e)) for s, e in ranges))

    def _forget_expected(self, replica: int) -> None:
        """Drop ``replica``'s notes of queued calls (its step ended or rolled back)."""
        rec = self._record(replica)
        with self._lock:
            rec.expected.clear()

    def _drop_expected(self, rec: _Replica, ranges) -> None:
        """Drop this call's note from ``rec.expected`` (and any stale notes before it)."""
        key = tuple((int(s), int(e)) for s, e in ranges)
        with self._lock:
            if key in rec.expected:
                while rec.expected.popleft() != key:
                    pass

    def _upcoming(self, rec: _Replica, exclude: set[int]) -> list[int]:
        """The allocated sub-groups the noted later calls will update first, beyond
        ``exclude``, in order (at most :data:`READ_AHEAD`)."""
        with self._lock:
            later = list(rec.expected)
        out: list[int] = []
        for later_ranges in later:
            for s, e in later_ranges:
                for j in range(s // self.sub_group_size, -(-e // self.sub_group_size)):
                    if j not in exclude and j not in out and j in rec.allocated:
                        out.append(j)
                        if len(out) >= READ_AHEAD:
                            return out
        return out

    # -- the update ---------------------------------------------------------------------
    def update(
        self,
        replica: int,
        ranges: Sequence[tuple[int, int]],
        param: np.ndarray,
        grad: np.ndarray,
        step_fn: StepFn,
        offset: int = 0,
        count: bool = True,
        step: int | None = None,
    ) -> None:
        """Stream ``replica``'s shard through the host and update it over ``ranges``.

        Part of the transaction of optimizer step ``step`` (see :class:`StepTransaction`):
        if it raises, every state this step changed is put back first.

        Args:
            replica: the replica id.
            ranges: shard-local ``[start, end)`` ranges to update (active variables),
                within ``[offset, offset + len(param))``.
            param: float32 parameter elements ``[offset, offset + len(param))`` of the
                shard (the whole ``[shard_size]`` shard with the default offset 0),
                updated in place.
            grad: float32 reduced gradient, the same elements as ``param``.
            step_fn: the optimizer's per-tile update.
            offset: shard-local element index of ``param[0]`` (default 0; see
                :meth:`HostOptimizerState.update`).
            count: count this call in :meth:`updates` and finish the step (default True;
                False for the stage-3 update in backward's blocks, finished by
                :meth:`mark_updated`).
            step: the optimizer step (0-based) this update belongs to; None (default):
                a transaction of its own, committed when the call returns.

        Raises:
            zero_runtime.memory.PagingError: an NVMe read or write failed (including
                ``NvmeFullError``); the write-behind's error is raised here, after the
                step's changes to the states were rolled back.
        """
        rec = self._record(replica)
        txn = self._begin(rec, replica, step)
        try:
            self._update(rec, txn, replica, ranges, param, grad, step_fn, offset)
            if count:
                self._write_behind_rest(txn, replica)
        except BaseException:
            self._rollback(rec, replica)
            raise
        if count:
            rec.updates += 1
            txn.done = txn.counted = True
        if step is None:  # a transaction of its own: committed now
            txn.done = True
            self._settle(rec, replica, None)

    def _update(self, rec, txn, replica, ranges, param, grad, step_fn, offset) -> None:
        if rec.scratch is None:
            rec.scratch = (np.empty(self.tile, np.float32), np.empty(self.tile, np.float32))
        work = []  # (subgroup, [(start, end) within the sub-group's shard range])
        for j in range(self.num_subgroups):
            lo, hi = self.subgroup_range(j)
            parts = [(max(s, lo), min(e, hi)) for s, e in ranges if s < hi and e > lo]
            if parts:
                work.append((j, parts))
        for j, _ in work:
            self._ensure_allocated(rec, replica, j)
        if not self.slot_names:
            for _, parts in work:
                for s, e in parts:
                    run_tiles(step_fn, {}, rec.scratch, param, grad, s - offset, e - offset)
            return
        # This call's sub-groups, then the first ones of the calls queued after it (as
        # noted by then: a block's gradient may arrive while this call runs): each is
        # read ahead while the one before it is updated.
        mine = {j for j, _ in work}
        self._drop_expected(rec, ranges)
        if work:
            self.pool.prefetch(self._ids(replica, work[0][0]))
        for k, (j, parts) in enumerate(work):
            ahead = [work[k + 1][0]] if k + 1 < len(work) else self._upcoming(rec, mine)
            if ahead:
                self.pool.prefetch([t for a in ahead for t in self._ids(replica, a)])
            lo, hi = self.subgroup_range(j)
            if j not in txn.undo and not self._fits_host_journal(txn, hi - lo):
                self._shadow(rec, txn, replica, j)  # a new generation, the old one kept
            ids = self._ids(replica, j)
            # Each slot as its pages' own memory (no copy in, none back); a sub-group
            # held since an earlier partial update of this step is resident already.
            pages = [self.pool.acquire_pages(tid, writable=True) for tid in ids]
            try:
                if j not in txn.undo:  # first change in this step: journal the old values
                    self._journal(txn, j, [np.concatenate(v) for v in pages])
                self._note_host()  # the window and the journal are at their largest
                for s, e in parts:
                    for a, b, page, at in self._page_spans(s - lo, e - lo):
                        slots = {
                            name: v[page][at : at + b - a]
                            for name, v in zip(self.slot_names, pages)
                        }
                        p = param[lo + a - offset : lo + b - offset]
                        g = grad[lo + a - offset : lo + b - offset]
                        run_tiles(step_fn, slots, rec.scratch, p, g, 0, b - a)
                txn.covered[j] = txn.covered.get(j, 0) + sum(e - s for s, e in parts)
                full = txn.covered[j] >= hi - lo
                if not full and j not in txn.held:
                    self._hold(txn, j, ids)  # before the release below: kept acquired
            finally:
                for tid in ids:
                    self.pool.release(tid)
            # Write-behind once the step has changed the whole sub-group: the stage-3
            # update in backward changes it block by block, and writing (then reading
            # again) it after each block moved it once per block.
            if full:
                self._release_held(txn, [j])  # unpinned
                txn.resident.discard(j)
                # Waited for at the step's end (or before a rollback), not here: the
                # next block's update overlaps this write.
                txn.writes.append(self._writer.submit(self.pool.evict, ids, "nvme"))
            else:
                txn.resident.add(j)  # on host until the step's end (or the pool evicts it)

    def _page_spans(self, a: int, b: int) -> list[tuple[int, int, int, int]]:
        """Split sub-group-local elements ``[a, b)`` at page boundaries: ``(start, end,
        page index, start within the page)`` per piece (float32, ``page_size // 4``
        elements a page)."""
        per = self.pool.page_size // 4
        return [
            (max(a, k * per), min(b, (k + 1) * per), k, max(a, k * per) - k * per)
            for k in range(a // per, (b - 1) // per + 1)
        ]

    def _hold(self, txn: StepTransaction, j: int, ids: list[str]) -> None:
        """Acquire sub-group ``j``'s slots once more, to the step's next partial update
        of it (``txn.held``; the one held before is released first: at most one per
        replica, the window's "sub-group being updated").

        The stage-3 update in backward updates a sub-group unit by unit; acquired and
        released per unit, each call copied the sub-group's pages into one host array and
        back (``PageAccess.materialise`` / ``write_back``): a whole-shard sub-group
        (the default ``sub_group_size`` when the window fits) was copied twice per unit.
        Held, it is copied in once and back once per step."""
        self._release_held(txn, list(txn.held))
        for tid in ids:
            self.pool.acquire_pages(tid, writable=True)
        txn.held[j] = list(ids)

    def _write_behind_rest(self, txn, replica: int) -> None:
        """Write the sub-groups the step changed only in part (``txn.resident``) to NVMe
        and wait for the step's write-behinds: the step's end. Raises the first write's
        error (``PagingError``)."""
        self._release_held(txn, list(txn.held))
        self._forget_expected(replica)  # the step's calls are done
        rest, txn.resident = sorted(txn.resident), set()
        if rest:  # one call: all their page writes in flight at once
            self.pool.evict([tid for j in rest for tid in self._ids(replica, j)], "nvme")
        self._wait_writes(txn, raise_error=True)

    # -- accounting ---------------------------------------------------------------------
    def mark_updated(self, replica: int) -> None:
        """Count one completed update of ``replica``'s shard made of partial updates
        (``update(..., count=False)``, the stage-3 update in backward) and finish its
        step's transaction (committed by :meth:`resolve` once the step counter moved).
        Sub-groups the partial updates changed only in part are written behind to NVMe
        now.

        Raises:
            zero_runtime.memory.PagingError: that write failed (the step is rolled back).
        """
        rec = self._record(replica)
        if rec.txn is not None:
            try:
                self._write_behind_rest(rec.txn, replica)
            except BaseException:
                self._rollback(rec, replica)
                raise
        rec.updates += 1
        if rec.txn is not None:
            rec.txn.done = rec.txn.counted = True

    def updates(self, replica: int) -> int:
        """Completed updates of ``replica``'s shard."""
        with self._lock:
            rec = self._replicas.get(replica)
        return 0 if rec is None else rec.updates

    @property
    def state_bytes(self) -> int:
        """Logical optimizer-state bytes of the allocated sub-groups (all tiers)."""
        total = 0
        with self._lock:
            for rec in self._replicas.values():
                for j in rec.allocated:
                    s, e = self.subgroup_range(j)
                    total += 4 * (e - s) * len(self.slot_names)
        return total

    def usage(self) -> dict[str, tuple[int, int]]:
        """``{"host": (state pages, scratch), "nvme": (state pages, 0)}``, bytes.

        Host state is the pool's host pages that hold optimizer states (whole pages);
        scratch is the per-replica tile buffers.
        """
        u = self.pool.usage()
        with self._lock:
            scratch = sum(
                sum(a.nbytes for a in rec.scratch)
                for rec in self._replicas.values()
                if rec.scratch is not None
            )
        return {
            "host": (u["host"].bytes_by_kind.get("optimizer", 0), scratch),
            "nvme": (u["nvme"].bytes_by_kind.get("optimizer", 0), 0),
        }

    @property
    def nbytes(self) -> int:
        """Host bytes held now (pool host pages of optimizer states plus scratch); the
        step journals' host copies are not counted (:attr:`peak_nbytes` counts them)."""
        state, scratch = self.usage()["host"]
        return state + scratch

    @property
    def journal_host_bytes(self) -> int:
        """Host bytes of the uncommitted steps' journal copies held in numpy (all local
        replicas), outside the pool (``journal_host_limit`` per replica at most)."""
        with self._lock:
            txns = [rec.txn for rec in self._replicas.values() if rec.txn is not None]
        return sum(t.host_bytes for t in txns)

    @property
    def peak_nbytes(self) -> int:
        """The most host bytes held at once since construction or :meth:`reset_peak`:
        pool host pages of optimizer states (the streamed window and journal tensors not
        yet written behind) + scratch + the journals' host copies, sampled after each
        sub-group is brought in and journalled during an update (when the window and
        the journal are at their largest), and now. Bytes.

        After a step the journal of the step before it has been freed (a step commits
        the previous one), so :attr:`nbytes` read then under-counts what the step held;
        this is the figure to compare with a host budget."""
        return max(self._peak_host, self.nbytes + self.journal_host_bytes)

    def reset_peak(self) -> None:
        """Start :attr:`peak_nbytes` again from the bytes held now."""
        self._peak_host = self.nbytes + self.journal_host_bytes

    def _note_host(self) -> None:
        self._peak_host = max(self._peak_host, self.nbytes + self.journal_host_bytes)

    # -- outside a step: checkpoints, a slot's values (nvme_access.py) ------------------
    def slot_values(self, slot: str) -> np.ndarray:
        """One slot's full (unpadded) flat buffer, float32 ``[layout.total]``, in variable
        order (:func:`.nvme_access.slot_values`; raises ``KeyError`` for an unknown slot)."""
        return nvme_access.slot_values(self, slot)

    def read_shard(self, replica: int, slot: str) -> np.ndarray:
        """A copy of one slot of ``replica``'s shard, float32 ``[layout.shard_size]``
        (:func:`.nvme_access.read_shard`, which lists the errors)."""
        return nvme_access.read_shard(self, replica, slot)

    def write_shard(self, replica: int, slot: str, values: np.ndarray) -> None:
        """Overwrite one slot of ``replica``'s shard with float32 ``[layout.shard_size]``
        ``values`` (:func:`.nvme_access.write_shard`, which lists the errors)."""
        nvme_access.write_shard(self, replica, slot, values)

    def step_boundary(self, step: int):
        """Close the pool's step; returns its ``PageCounters``."""
        return self.pool.step_boundary(step)

    def close(self) -> None:
        """Stop the write-behind thread and close the pool (removes its NVMe file)."""
        self._writer.shutdown(wait=True)
        if not self.pool.closed:
            self.pool.close()
