"""Step transactions of the NVMe optimizer-state store: journal, commit, roll back.

A mixin of :class:`~zero_runtime.optim.nvme_state.NvmeOptimizerState`: before a state
sub-group changes for the first time in a step its old values are copied into the step's
undo journal (host memory); a sub-group the step allocates is noted as new. The optimizer
(:mod:`zero_runtime.optim.transaction`) commits the step once its counter moved, or rolls
it back: every journalled sub-group is written back, every new one freed.
"""

from __future__ import annotations

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
        undo: sub-group -> its slots' values before the step (float32 copies, slot
            order), or None for a sub-group the step allocated (a rollback frees it).
    """

    step: int | None
    done: bool = False
    counted: bool = False
    undo: dict[int, list[np.ndarray] | None] = dataclasses.field(default_factory=dict)


class StateTransactions:
    """Commit/rollback of a store's steps, per replica (the store provides ``pool``,
    ``_record(replica)`` with a ``txn`` attribute, ``_ids(replica, j)``, ``_lock``,
    ``_replicas``)."""

    pool: Any
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

    def _settle(self, rec: Any, replica: int, step: int | None) -> str | None:
        txn = rec.txn
        if txn is None:
            return None
        if txn.done and (step is None or txn.step is None or step > txn.step):
            rec.txn = None  # commit: the journal is dropped
            return "commit"
        self._rollback(rec, replica)
        return "rollback"

    def _rollback(self, rec: Any, replica: int) -> None:
        """Put back every sub-group the transaction changed (free those it allocated)."""
        txn, rec.txn = rec.txn, None
        if txn is None:
            return
        for j, old in txn.undo.items():
            ids = self._ids(replica, j)
            if old is None:
                for tid in ids:
                    try:
                        self.pool.free(tid)
                    except KeyError:  # its allocation failed part-way
                        pass
                rec.allocated.discard(j)
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
