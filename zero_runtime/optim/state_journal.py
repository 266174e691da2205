"""Step transactions of the NVMe optimizer-state store: journal, commit, roll back.

A mixin of :class:`~zero_runtime.optim.nvme_state.NvmeOptimizerState`: before a state
sub-group changes for the first time in a step its old values are copied into the step's
undo journal; a sub-group the step allocates is noted as new. The optimizer
(:mod:`zero_runtime.optim.transaction`) commits the step once its counter moved, or rolls
it back: every journalled sub-group is written back, every new one freed.

Where the old values live: numpy copies in host memory while a step's copies fit in
``journal_host_limit`` bytes (per replica); past that, shadow paging: the sub-group is
copied into its other *generation* (pool tensors ``"{prefix}/r{replica}/g{j}.1/{slot}"``
and ``".../g{j}/{slot}"`` alternate), which the step updates and writes behind, and the
previous generation stays on NVMe untouched (its pages were only read: clean, they leave
the host with no write). So a step over a billion-element shard keeps only the streamed
window in host memory and writes each state page once. Committing frees the host copies
and the previous generations; rolling back writes the copies back and frees the new
generations.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np


@dataclasses.dataclass
class StepTransaction:
    """The uncommitted step of one replica's shard.

    Lifecycle: OPEN (``done`` False: updates of step ``step`` running; the stage-3 update
    in backward makes several) -> DONE (the step's updates all finished: ``update(...,
    count=True)`` or :meth:`NvmeOptimizerState.mark_updated`) -> committed or rolled back
    by :meth:`NvmeOptimizerState.resolve` (or rolled back at once when an update fails).

    Attributes:
        step: the optimizer step (0-based) being applied, or None (a call without one:
            committed when it returns).
        done: every update of the step finished.
        counted: the step was counted in ``updates`` (undone by a rollback).
        undo: sub-group -> its slots' values before the step, slot order: float32 copies
            in host memory, or the ids of its previous generation's pool tensors (past
            ``journal_host_limit``: :meth:`StateTransactions._shadow`), or None for a
            sub-group the step allocated (a rollback frees it).
        host_bytes: bytes of the host copies in ``undo``.
        covered: sub-group -> elements of it this step's updates have changed so far.
        resident: sub-groups changed in this step but not written behind yet (a later
            partial update of the step changes more of them; written at its end).
        writes: the write-behinds of the sub-groups the step finished, in flight while
            the next updates run; waited for at the step's end or before a rollback.
        held: sub-group -> the ids of its slots, acquired once more by the store between
            two partial updates of the step (at most one; ``NvmeOptimizerState._hold``):
            its host copy stays, written back to its pages once, when released.
    """

    step: int | None
    done: bool = False
    counted: bool = False
    undo: dict[int, list[np.ndarray] | list[str] | None] = dataclasses.field(default_factory=dict)
    host_bytes: int = 0
    covered: dict[int, int] = dataclasses.field(default_factory=dict)
    resident: set[int] = dataclasses.field(default_factory=set)
    held: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    writes: list[concurrent.futures.Future] = dataclasses.field(default_factory=list)


class StateTransactions:
    """Commit/rollback of a store's steps, per replica (the store provides ``pool``,
    ``prefix``, ``slot_names``, ``_writer`` (the write-behind executor),
    ``_record(replica)`` with ``txn`` and ``generation`` attributes, ``_forget_expected``
    (drops the notes of queued calls), ``_ids(replica, j)``
    (the current generation's ids), ``subgroup_range(j)``, ``_lock``, ``_replicas``)."""

    pool: Any
    prefix: str
    slot_names: tuple[str, ...]
    _writer: concurrent.futures.ThreadPoolExecutor
    #: Bytes of host copies one replica's step journal may hold; further sub-groups are
    #: journalled in the pool, on NVMe.
    journal_host_limit: int = 0
    #: Called before the shard is read or overwritten from outside a step
    #: (``read_shard``, ``write_shard``, ``slot_values``): the optimizer resolves
    #: uncommitted steps there (its parameters too). None: a finished step is committed,
    #: an unfinished one rolled back.
    before_access: Callable[[], None] | None = None

    def _begin(self, rec: Any, replica: int, step: int | None) -> StepTransaction:
        """The transaction an update of ``step`` joins: the open one of the same step (the
        next block of a stage-3 update in backward), else a new one, after resolving the
        previous (a finished step whose counter advanced commits; any other rolls back)."""
        txn = rec.txn
        if txn is not None:
            if not txn.done and step is not None and txn.step == step:
                return txn
            self._settle(rec, replica, step)
        rec.txn = StepTransaction(step)
        return rec.txn

    def _fits_host_journal(self, txn: StepTransaction, elements: int) -> bool:
        """Whether the old values of a sub-group of ``elements`` elements (every slot) fit
        the step's host journal (``journal_host_limit``) beside what it holds."""
        return txn.host_bytes + 4 * elements * len(self.slot_names) <= self.journal_host_limit

    def _journal(self, txn: StepTransaction, j: int, arrays: list[np.ndarray]) -> None:
        """Journal sub-group ``j``'s old values (``arrays``, one per slot) as host copies
        (the caller checked they fit: :meth:`_fits_host_journal`)."""
        txn.undo[j] = [np.array(a, np.float32, copy=True) for a in arrays]
        txn.host_bytes += sum(a.nbytes for a in arrays)

    def _shadow(self, rec: Any, txn: StepTransaction, replica: int, j: int) -> None:
        """Start a new generation of sub-group ``j`` and keep the previous one as its
        undo record (shadow paging; Lorie, "Physical integrity in a large segmented
        database", ACM TODS 2(1), 1977).

        Each slot becomes a new pool tensor (the other generation's id,
        :meth:`~zero_runtime.optim.nvme_state.NvmeOptimizerState.tensor_id`), which the
        step then updates and writes behind: ``PagedBufferPool.fork`` hands the old
        pages' host copies to it and leaves the old generation its NVMe copies (no
        write, no copy, no host room to make); a slot written on the host since it was
        read (no NVMe copy to keep) is copied into a new tensor instead, and its old
        pages leave the host with a write. The copy on NVMe is what a rollback returns
        to. Compared with an
        undo journal in the pool this saves one page write per journalled page (and the
        host room of the journal's copy while it waits for its write); it costs NVMe
        room for both generations until the step commits, as the journal did.

        Raises:
            zero_runtime.memory.PagingError: reading the old values failed (nothing is
                changed: the new tensors made so far are freed).
            zero_runtime.memory.PoolOutOfMemoryError: no host room for the copy (same).
        """
        old = self._ids(replica, j)
        lo, hi = self.subgroup_range(j)
        shape = (hi - lo,)
        rec.generation[j] = 1 - rec.generation.get(j, 0)
        made: list[str] = []
        try:
            for tid, new in zip(old, self._ids(replica, j)):
                if self.pool.fork(tid, new):  # host copies handed over, NVMe copies kept
                    made.append(new)
                    continue
                source = self.pool.acquire_pages(tid)  # read-only: the pages stay clean
                try:
                    self.pool.allocate(new, shape, np.float32, kind="optimizer", tier="host")
                    made.append(new)
                    target = self.pool.acquire_pages(new, writable=True)
                    try:
                        for out, page in zip(target, source):  # page to page: one copy
                            out[...] = page
                    finally:
                        self.pool.release(new)
                finally:
                    self.pool.release(tid)
        except BaseException:
            for tid in made:
                self.pool.free(tid)
            rec.generation[j] = 1 - rec.generation[j]
            raise
        txn.undo[j] = old
        self.pool.evict(old, "nvme")  # clean: their host slots return with no write

    @staticmethod
    def _wait_writes(txn: StepTransaction, raise_error: bool) -> None:
        """Wait for the step's write-behinds; with ``raise_error``, raise the first one's
        error (``PagingError``)."""
        writes, txn.writes = txn.writes, []
        concurrent.futures.wait(writes)
        if raise_error:
            for f in writes:
                f.result()

    def _release_held(self, txn: StepTransaction, subgroups: list[int]) -> None:
        """Release the extra acquire of each held sub-group in ``subgroups`` (its host
        copy written back to its pages, which are unpinned)."""
        for j in subgroups:
            for tid in txn.held.pop(j, ()):
                self.pool.release(tid)

    def _drop_previous(self, txn: StepTransaction) -> None:
        """Commit: free the previous generations ``txn`` kept (their NVMe slots)."""
        for old in txn.undo.values():
            for tid in old or ():
                if isinstance(tid, str):
                    self.pool.free(tid)

    def _settle(self, rec: Any, replica: int, step: int | None) -> str | None:
        txn = rec.txn
        if txn is None:
            return None
        self._release_held(txn, list(txn.held))
        if txn.done and (step is None or txn.step is None or step > txn.step):
            rec.txn = None  # commit: the journal and previous generations are dropped
            self._drop_previous(txn)
            return "commit"
        self._rollback(rec, replica)
        return "rollback"

    def _rollback(self, rec: Any, replica: int) -> None:
        """Put back every sub-group the transaction changed (free those it allocated)."""
        txn, rec.txn = rec.txn, None
        self._forget_expected(replica)
        if txn is None:
            return
        self._wait_writes(txn, raise_error=False)  # before any page is touched
        self._release_held(txn, list(txn.held))  # before the journal is written back
        for j, old in txn.undo.items():
            ids = self._ids(replica, j)
            if old is None:
                for tid in ids:
                    try:
                        self.pool.free(tid)
                    except KeyError:  # its allocation failed part-way
                        pass
                rec.allocated.discard(j)
            elif isinstance(old[0], str):  # a shadow: back to the previous generation
                for tid in ids:
                    try:
                        self.pool.free(tid)
                    except KeyError:
                        pass
                rec.generation[j] = 1 - rec.generation.get(j, 0)
            else:
                for tid, values in zip(ids, old):
                    self.pool.write(tid, values)
        if txn.counted:
            rec.updates -= 1

    def begin(self, replica: int, step: int | None) -> str | None:
        """Before an update of ``step``: 'continue' when ``replica``'s uncommitted step is
        that step, still open (the next block of a stage-3 update in backward); else
        resolve the uncommitted step as :meth:`resolve` does and return its outcome."""
        rec = self._record(replica)
        txn = rec.txn
        if txn is not None and not txn.done and step is not None and txn.step == step:
            return "continue"
        return self._settle(rec, replica, step)

    def resolve(self, replica: int, step: int | None) -> str | None:
        """Commit or roll back ``replica``'s uncommitted step.

        Args:
            replica: the replica id.
            step: the optimizer's committed step count now (``iterations // N``); None:
                commit a finished step, roll back an unfinished one.

        Returns:
            'commit' (the step finished and ``step`` is past it), 'rollback' (every
            state put back as before the step), or None (no uncommitted step).
        """
        rec = self._record(replica)
        return self._settle(rec, replica, step)

    def rollback(self, replica: int) -> bool:
        """Roll back ``replica``'s uncommitted step, if any (True when there was one)."""
        rec = self._record(replica)
        had = rec.txn is not None
        self._rollback(rec, replica)
        return had

    def uncommitted(self, replica: int) -> StepTransaction | None:
        """``replica``'s uncommitted step, or None."""
        return self._record(replica).txn

    def _access(self) -> None:
        """Resolve uncommitted steps before an outside read/write of the states."""
        if self.before_access is not None:
            self.before_access()
            return
        with self._lock:
            replicas = list(self._replicas)
        for r in replicas:
            self.resolve(r, None)
