"""A failed optimizer step leaves nothing applied: the optimizer's side of the step
transaction.

With optimizer states on NVMe (:class:`~zero_runtime.optim.nvme_state.NvmeOptimizerState`)
every step is a transaction (without one, an ``ENOSPC`` inside a step would leave every
state changed while ``iterations`` had not, and a checkpoint then would be inconsistent):

- the store journals the old values of every state sub-group the step changes
  (:class:`~zero_runtime.optim.nvme_state.StepTransaction`);
- at stage 3 the parameter shards are written by the update itself (all at the end of the
  step, or block by block during backward: :mod:`.backward_update`), so the old values of
  the shards it writes are journalled here (:class:`StepJournals`), on the host;
- at stages 1-2 the parameters are assigned from the all-gathered new shards, which exist
  only if every replica's update succeeded, and ``iterations`` is incremented only after
  them (the optimizer's gate, ``PartitionedOptimizer._backend_apply_gradients``); AdamW's
  decoupled weight decay is applied inside the update for the same reason;
- the step commits right after ``iterations`` increments (a host call that reads it), and
  rolls back (states and parameter shards put back, bitwise) when it raised, when
  ``ShardedModel.recover`` settles it, or, lazily, when the next update, a checkpoint or a
  read of the states finds the counter not advanced.

The rule is one comparison: a finished step ``s`` commits once the committed step count
(``iterations // gradient_accumulation_steps``) is past ``s``; anything else rolls back.
The host holds the journals only while a step is uncommitted: at most one copy of the
replica's state sub-groups and (stage 3) parameter shards that the step changed.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
import tensorflow as tf

from zero_runtime.lifecycle import host_function
from zero_runtime.memory.staging import StagingPool
from zero_runtime.optim.nvme_state import NvmeOptimizerState


class StepJournals:
    """Commit/rollback of one optimizer's steps, per local replica.

    Args:
        optimizer: a built partitioned optimizer whose store has transactions (``begin``,
            ``resolve``, ``rollback``: the NVMe store).

    The parameter journal of a replica is a list of ``(variables, old)``: ShardedVariables
    (one contiguous run of the optimizer layout) and their shards' float32 values before
    the step, in the order they were read.

    The old values are copied into recycled buffers (:attr:`buffers`, a
    :class:`~zero_runtime.memory.staging.StagingPool` of the journal's own that keeps up
    to the journal's peak idle between steps): the next step's copies reuse the memory the
    last commit released instead of faulting in fresh pages. Measured on the 1B-parameter
    step of ``bench/bench_max_model.py`` (k = 22): a fresh copy per block cost
    the update threads 5 CPU-seconds per step (``_zero3_read_shards``'s own time in
    ``bench/profile_step.py --py-sample-hz``), most of it page faults on 4 GB of new
    memory.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._params: dict[int, list[tuple[tuple, np.ndarray]]] = {}
        self._lock = threading.Lock()
        self._held = 0  # bytes of the journals' old values now: see host_bytes
        self._peak = 0  # bytes: see peak_host_bytes
        #: the old values' buffers; idle blocks kept up to the most the journal held.
        self.buffers = StagingPool(idle_limit_bytes=0)

    @property
    def host_bytes(self) -> int:
        """Host bytes of the parameter journals held now (every local replica's old
        shard values, float32), outside the pools and their host budgets."""
        with self._lock:
            return self._held

    @property
    def peak_host_bytes(self) -> int:
        """The most :attr:`host_bytes` held at once since construction (bytes): at
        stage 3 with the update in backward, a whole step's parameter shards, 4 bytes
        per parameter (the step commits at its end)."""
        with self._lock:
            return self._peak

    @property
    def store(self) -> Any:
        """The optimizer's state store."""
        return self.optimizer.zero_state.store

    def begin(self, replica: int, step: int) -> None:
        """Before an update of optimizer step ``step`` on ``replica``: join its open
        transaction, or resolve the previous one (commit or roll back, parameters too)."""
        self._follow(replica, self.store.begin(replica, int(step)))

    def resolve(self, replica: int, step: int | None) -> str | None:
        """Commit ``replica``'s finished step when ``step`` (the committed step count now)
        is past it, else roll it back; the parameter journal follows. Returns the
        outcome ('commit', 'rollback') or None (nothing uncommitted)."""
        outcome = self.store.resolve(replica, step)
        self._follow(replica, outcome)
        return outcome

    def rollback(self, replica: int) -> None:
        """Roll back ``replica``'s uncommitted step (states and parameter shards)."""
        self.store.rollback(replica)
        self._follow(replica, "rollback")

    def pending(self, replica: int) -> bool:
        """True when ``replica`` has journalled parameter shards (an uncommitted step)."""
        with self._lock:
            return bool(self._params.get(replica))

    def record_params(self, replica: int, variables: tuple, values: np.ndarray) -> None:
        """Journal ``variables``' shards of ``replica`` before the step writes them:
        ``values`` (float32 ``[sum(v.shard_elements)]``, their values concatenated) is
        copied into a buffer of :attr:`buffers`, so the caller may change it afterwards."""
        old = self.buffers.copy(values)
        with self._lock:
            self._params.setdefault(replica, []).append((tuple(variables), old))
            self._held += old.nbytes
            self._peak = max(self._peak, self._held)
        # Keep up to the journal's largest step (its blocks' bytes) idle for the next.
        self.buffers.idle_limit_bytes = max(
            self.buffers.idle_limit_bytes, self.buffers.peak_live_bytes
        )

    def _follow(self, replica: int, outcome: str | None) -> None:
        if outcome == "continue":
            return
        with self._lock:
            entries = self._params.pop(replica, [])
            self._held -= sum(old.nbytes for _, old in entries)
        if outcome == "commit":
            return
        # Rolled back, or no transaction left in the store (an update that raised rolled
        # its states back at once): the parameter shards written since go back too.
        for variables, old in reversed(entries):
            self.optimizer._zero3_write_shards(variables, replica, old)  # noqa: SLF001


class TransactionalUpdate:
    """The step transactions' hooks; mixed into the partitioned optimizer (which provides
    ``_zero``, ``_iterations`` and ``_zero3_write_shards``)."""

    _zero: Any = None

    def _zero_attach_journals(self) -> None:
        """Give an NVMe store's steps their journals (parameters at stage 3) and let the
        store settle uncommitted steps before it is read or overwritten from outside."""
        zs = self._zero
        if isinstance(zs.store, NvmeOptimizerState):
            zs.journals = StepJournals(self)
            zs.store.before_access = self.zero_settle

    def _zero_committed_step(self) -> int:
        """The committed optimizer step count now: ``iterations // N`` (host int)."""
        n = self._zero.accumulation_steps if self._zero is not None else 1
        return int(self._iterations.numpy()) // n

    def _zero_begin(self, replica: int, step: int) -> None:
        if self._zero.journals is not None:
            self._zero.journals.begin(replica, step)

    def _zero_rollback(self, replica: int) -> None:
        if self._zero.journals is not None:
            self._zero.journals.rollback(replica)

    def zero_settle(self) -> dict[int, str]:
        """Commit or roll back every local replica's uncommitted step now, by the step
        counter: a finished step whose ``iterations`` advanced commits, any other is rolled
        back (states and stage-3 parameter shards bitwise as before it). Run by
        ``ShardedModel.recover``, checkpoints, and reads of the states; a no-op without
        step transactions (states not on NVMe).

        Returns:
            ``{replica: 'commit' | 'rollback'}`` for the replicas that had one.
        """
        zs = self._zero
        if zs is None or zs.journals is None:
            return {}
        step = self._zero_committed_step()
        out = {}
        for replica in range(zs.layout.num_shards):
            if zs.store.uncommitted(replica) is not None or zs.journals.pending(replica):
                outcome = zs.journals.resolve(replica, step)
                if outcome is not None:
                    out[replica] = outcome
        return out

    def _zero_commit_op(self, replica: int, after: tf.Tensor) -> tf.Tensor:
        """Graph: after ``iterations`` was incremented, commit ``replica``'s step (a host
        call reading the counter). Returns ``after`` (identity) once it ran."""
        if self._zero.journals is None:
            return tf.identity(after)
        counter = tf.convert_to_tensor(self._iterations)  # read after the increment
        done = host_function(
            functools.partial(self._zero_commit, replica=replica),
            [counter],
            tf.int64,
            stateful=True,
            name="zero_step_commit",
        )
        with tf.control_dependencies([done]):
            return tf.identity(after)

    def _zero_commit(self, counter: np.ndarray, replica: int) -> np.int64:
        n = self._zero.accumulation_steps
        self._zero.journals.resolve(replica, int(counter) // n)
        return np.int64(counter)
