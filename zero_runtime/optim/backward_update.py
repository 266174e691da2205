"""Stage 3: each block's parameter shards updated during backward, on the host.

With ``offload_optimizer`` 'cpu' or 'nvme' the optimizer update of stage 3 runs on the
host anyway (ZeRO-Offload, Ren et al., USENIX ATC 2021, section 4.1: the fp32 gradients
move to the CPU, where the optimizer steps). Done once at the end of the step, as
:meth:`PartitionedOptimizer.apply_shard_gradients` does, every block's reduced gradient
shard stays on the device until the whole backward has run: ``4 Ψ / N`` bytes per replica
plus the concatenation handed to the host (docs/stages/optimizer.md: the largest
term of a stage-3 step's device peak). A :class:`BackwardShardUpdate` instead hands each
block's gradient shard to the host as soon as it is reduced (ZeRO-Offload's per-bucket
gradient offload): a host call copies it (the device buffer is freed when the call
returns) and queues the block's update on the replica's update thread, which steps the
optimizer block after block while backward goes on (the overlap of the optimizer step
with backward, ZeRO-Infinity, Rajbhandari et al., SC21, section 6.2). The device never
holds a gradient for the host optimizer: a slow host update queues host copies, not
device buffers. The queued copies are bounded: past :data:`MAX_QUEUED_BYTES` per replica
the host call waits for the update thread before copying (backpressure, as DeepSpeed's
fixed set of offload buffers bounds its own), so the host holds at most that many bytes
of queued gradients plus the one block being admitted, whatever the model's size
(unbounded, a 1B-parameter model at NVMe speed queued most of its 4 GB gradient).

The result is exactly the end-of-step update's: an element-wise optimizer (Adam, AdamW,
SGD) updates each element from its own gradient and states with the step's scalars
(learning rate, bias corrections, read once before backward), and every parameter
belongs to one block, whose backward is its last use in the step. Not used (the
end-of-step update is) with gradient accumulation or clipping, which need every
gradient shard first, with loss scaling (``mixed_float16``: a step with a non-finite
gradient is skipped, known only after every shard), or with optimizer states on the
device ('none').

A model run by units (:mod:`zero_runtime.stage3.units_path`) calls :meth:`update` per
use whose originals no other use reads (its backward is their last read), and once
after the backward for the rest (tied weights, uses inside control flow or as tiles).

Lifecycle per replica and step (traced once into the step's graph): ``__init__`` reads
the step's scalars; :meth:`update` once per block, in backward order (copy + queue);
:meth:`finish` after the last, which waits for the queued updates (raising the first
error), reports the step to the runtime and increments ``iterations``. A step that fails
before its end leaves updates queued: :func:`settle` waits for them
(``ShardedModel.recover`` calls it). With optimizer states on NVMe the step is a
transaction (:mod:`zero_runtime.optim.transaction`): the blocks' parameter shards and
states are journalled, committed after ``iterations`` increments, and put back bitwise
when an update raised (:meth:`finish` rolls back before raising) or by :func:`settle`.
The update threads belong to the optimizer's strategy: ``strategy.close()`` (or
``ShardedModel.close()``, :func:`close`) waits for their queued updates and stops them
(:mod:`zero_runtime.lifecycle`).

The host update's seconds are not recorded as runtime compute (the end-of-step host
update's are not either): counting it, which includes the NVMe state I/O, made every
step's overlap ratio 1.0.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from zero_runtime.lifecycle import (
    ClosePhase,
    LifecycleState,
    StrategyClosedError,
    host_function,
    resources_of,
)
from zero_runtime.memory import staging
from zero_runtime.optim.device_state import DeviceOptimizerState

MAX_QUEUED_BYTES = 64 << 20
"""Host bytes of gradient copies one replica's update queue may hold before the next
block's host call waits (bytes; a block larger than this is admitted alone, once the queue
is empty). Four 16 MB MLP shards of a d_model-1408 model at 2 replicas."""


def supported(optimizer: Any) -> bool:
    """True when ``optimizer`` (a built partitioned optimizer at stage 3) can update
    during backward: optimizer states on the host or NVMe, no gradient accumulation, no
    clipping (``clipnorm``, ``global_clipnorm``, ``clipvalue``), no loss scaling.

    False for a ``keras.optimizers.LossScaleOptimizer`` (``mixed_float16``): a step
    whose gradient has a non-finite element anywhere, on any replica, must change no
    parameter (Keras skips it), and a block updated during backward would be written
    before the other blocks' gradients, so the step's finiteness, are known. The update
    after the backward is used (zero_runtime/stage3/loss_scaling.py)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return False
    zs = getattr(optimizer, "_zero", None)
    if zs is None or zs.stage != 3 or isinstance(zs.store, DeviceOptimizerState):
        return False
    if zs.accumulation_steps != 1:
        return False
    return not any(
        getattr(optimizer, name, None) for name in ("clipnorm", "global_clipnorm", "clipvalue")
    )


class BackwardShardUpdate:
    """The optimizer update of one replica's step, one block at a time during backward.

    Args:
        optimizer: a built stage-3 partitioned optimizer (``zero_runtime.optim.Adam``,
            ``AdamW``, ``SGD``) for which :func:`supported` is True.
        replica: the replica id (static), in replica context.

    Raises:
        ValueError: ``optimizer`` is not :func:`supported`.

    Attributes:
        step: int64 scalar tensor, the optimizer step (0-based) this update applies.
    """

    def __init__(self, optimizer: Any, replica: int) -> None:
        if not supported(optimizer):
            raise ValueError(
                f"{type(optimizer).__name__}: the update in backward needs a built stage-3 "
                "partitioned optimizer with offload_optimizer 'cpu' or 'nvme', "
                "gradient_accumulation_steps=1 and no clipping"
            )
        self.optimizer = optimizer
        self.replica = replica
        zs = optimizer.zero_state
        order = optimizer._zero3_variables  # noqa: SLF001
        self._offset = {id(v): b.shard_offset for b, v in zip(zs.layout.buckets, order)}
        lr = optimizer._zero_learning_rate()  # noqa: SLF001
        self.step = optimizer._zero_step()  # noqa: SLF001
        wd = tf.cast(optimizer.weight_decay if optimizer.weight_decay else 0.0, tf.float32)
        self._scalars = [wd, tf.cast(lr, tf.float32), *optimizer._zero_step_scalars(lr)]  # noqa: SLF001

    def update(self, variables: list, shard: tf.Tensor, after: tf.Tensor) -> tf.Tensor:
        """Hand ``variables``' reduced gradient ``shard`` to the host update.

        Args:
            variables: one block's ShardedVariables, in the order of ``shard``.
            shard: float32 ``[sum(v.shard_elements)]``, the replica's reduced gradient
                shard of the block (summed over replicas).
            after: a float32 scalar that must exist first (the block's release).

        Returns:
            A float32 scalar 0.0 that exists once the shard is copied to the host and
            its update queued; the caller must use it (it is a stateless host call:
            Grappler prunes unused ones).

        A variable the optimizer does not update (a layer frozen after the model was
        sharded: ``layer.trainable = False``, then a new optimizer over the trainable
        rest) is left out with its piece of ``shard``, as Keras leaves it unchanged.
        """
        kept = [i for i, v in enumerate(variables) if id(v) in self._offset]
        if len(kept) < len(variables):
            pieces = tf.split(shard, [v.shard_elements for v in variables])
            shard = tf.concat([pieces[i] for i in kept] or [tf.zeros([0])], axis=0)
            variables = [variables[i] for i in kept]
        fn = functools.partial(self._host_enqueue, tuple(variables))
        # Stateless, ordered by its inputs only: see zero_runtime.stage3.unit_comm's docstring.
        done = host_function(
            fn,
            [shard, after, self.step, *self._scalars],
            tf.float32,
            stateful=False,
            name="zero3_grad_d2h",
        )
        done.set_shape([])
        return done

    def finish(self, after: list) -> tf.Tensor:
        """End the replica's update: report the step to the runtime (telemetry), then
        increment ``iterations``. ``after``: tensors that must exist first (the last
        block's token, row-paged tables' updates). Returns the int64 optimizer step."""
        step = host_function(
            self._host_finish, [self.step, *after], tf.int64, stateful=True, name="zero3_finish"
        )
        step.set_shape([])
        with tf.control_dependencies([step]):
            self.optimizer._iterations.assign_add(1)  # noqa: SLF001
        return self.optimizer._zero_commit_op(self.replica, step)  # noqa: SLF001

    # -- host side -----------------------------------------------------------------------
    def _host_enqueue(
        self, variables: tuple, grad: np.ndarray, _after, step, *scalars
    ) -> np.float32:
        queue = _queue(self.optimizer, self.replica)
        nbytes = 4 * int(np.size(grad))
        queue.admit(nbytes)  # waits while the queued copies exceed MAX_QUEUED_BYTES
        try:
            grad = staging.copy(grad)  # the input may alias the device buffer
        except BaseException:
            queue.done(nbytes)
            raise
        expect = getattr(self.optimizer.zero_state.store, "expect", None)
        if expect is not None:  # the NVMe store reads this block's states ahead
            for run in _contiguous_runs(variables, self._offset):
                off = self._offset[id(run[0])]
                expect(self.replica, ((off, off + sum(v.shard_elements for v in run)),))
        queue.submit(self._host_update, variables, grad, int(step), scalars, nbytes=nbytes)
        return np.float32(0.0)

    def _host_update(self, variables: tuple, grad: np.ndarray, step: int, scalars: tuple) -> None:
        wd, lr, *rest = scalars
        opt, replica = self.optimizer, self.replica
        zs = opt.zero_state
        step_fn = functools.partial(opt._zero_tile_step, scalars=rest)  # noqa: SLF001
        opt._zero_begin(replica, step)  # noqa: SLF001 (joins the step's transaction)
        pos = 0
        try:
            for run in _contiguous_runs(variables, self._offset):
                n = sum(v.shard_elements for v in run)
                off = self._offset[id(run[0])]
                param = opt._zero3_read_shards(run, replica, wd, lr)  # noqa: SLF001 (decayed)
                grad_run = grad[pos : pos + n]
                zs.store.update(
                    replica, ((off, off + n),), param, grad_run, step_fn, off, False, step=step
                )
                opt._zero3_write_shards(run, replica, param)  # noqa: SLF001
                pos += n
        except BaseException:
            opt._zero_rollback(replica)  # noqa: SLF001 (the blocks updated before, too)
            raise

    def _host_finish(self, step, *_) -> np.int64:
        first = _queue(self.optimizer, self.replica).wait()
        if first is not None:
            self.optimizer._zero_rollback(self.replica)  # noqa: SLF001 (blocks run since)
            raise first
        zs = self.optimizer.zero_state
        zs.store.mark_updated(self.replica)
        if zs.runtime is not None:
            zs.runtime.on_shard_updated(self.optimizer, self.replica, int(step), 0.0)
        return np.int64(step)


def settle(optimizer: Any) -> int:
    """Wait for every update still queued by ``optimizer``'s steps and forget them.

    After a step that failed before its end (an error in backward), block updates queued
    by that step may still be running on the update threads and writing parameter
    shards; :meth:`~zero_runtime.stage3.model.ShardedModel.recover` calls this before the
    model is read, saved, restored or trained again. Errors of those updates are dropped
    (the step already failed). With step transactions (optimizer states on NVMe) the
    failed step is then rolled back (``optimizer.zero_settle``): parameter shards and
    states exactly as before it. Returns the number of updates waited for.
    """
    with _QUEUES_LOCK:
        threads = _QUEUES.get(optimizer)
    waited = threads.settle() if threads is not None else 0
    settle_steps = getattr(optimizer, "zero_settle", None)
    if settle_steps is not None:  # roll back the failed step (NVMe states: transactions)
        settle_steps()
    return waited


def close(optimizer: Any) -> int:
    """Stop ``optimizer``'s update threads after their queued updates (idempotent).

    Called by ``ShardedModel.close`` and, through the strategy's
    :class:`~zero_runtime.lifecycle.Resources` (phase ``UPDATES``), by
    ``strategy.close()``. Returns the number of queued updates waited for.
    """
    with _QUEUES_LOCK:
        threads = _QUEUES.get(optimizer)
    return threads.close() if threads is not None else 0


class _UpdateQueue:
    """One replica's update thread, the futures of its current step's updates and the
    host bytes of the gradient copies they hold (``queued_bytes``, ``peak_bytes``:
    bounded by ``limit``, default :data:`MAX_QUEUED_BYTES` read at construction, through
    :meth:`admit`)."""

    def __init__(self, replica: int, limit: int | None = None) -> None:
        # One thread: a replica's block updates run one after the other (the store
        # updates a replica's shard one range at a time).
        self.executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"zero3-update-r{replica}"
        )
        self.pending: list[concurrent.futures.Future] = []
        self.lock = threading.Lock()
        self.limit = MAX_QUEUED_BYTES if limit is None else limit
        self.queued_bytes = 0
        self.peak_bytes = 0
        self._room = threading.Condition(threading.Lock())

    def admit(self, nbytes: int) -> None:
        """Reserve ``nbytes`` of queued gradient copies, first waiting until they fit
        ``limit`` beside those queued (or none are: a larger block goes alone)."""
        with self._room:
            self._room.wait_for(
                lambda: self.queued_bytes == 0 or self.queued_bytes + nbytes <= self.limit
            )
            self.queued_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.queued_bytes)

    def done(self, nbytes: int) -> None:
        """Give back ``nbytes`` reserved by :meth:`admit` (its update ended or failed)."""
        with self._room:
            self.queued_bytes -= nbytes
            self._room.notify_all()

    def submit(self, fn, *args, nbytes: int = 0) -> None:
        """Queue ``fn(*args)`` on the thread; ``nbytes`` admitted bytes are given back
        when it ends (its arguments are dropped then, so is the gradient copy)."""

        def run() -> None:
            try:
                fn(*args)
            finally:
                self.done(nbytes)

        with self.lock:
            try:
                self.pending.append(self.executor.submit(run))
            except BaseException:
                self.done(nbytes)
                raise

    def wait(self) -> BaseException | None:
        """Wait for the queued updates; forget them; return the first error (or None)."""
        with self.lock:
            pending, self.pending = self.pending, []
        errors = [f.exception() for f in pending]
        return next((e for e in errors if e is not None), None)

    def discard(self) -> int:
        """Wait for the queued updates, forget them and their errors; return how many."""
        with self.lock:
            pending, self.pending = self.pending, []
        concurrent.futures.wait(pending)
        return len(pending)

    def shutdown(self) -> None:
        """Stop the thread (after the updates it runs)."""
        self.executor.shutdown(wait=True)


class _UpdateThreads:
    """The update queues of one optimizer, one per local replica, and their lifecycle.

    States (:class:`~zero_runtime.lifecycle.LifecycleState`): OPEN (queues made on first
    use) -> CLOSED (:meth:`close`: queued updates waited for, threads stopped; a new
    update raises :class:`~zero_runtime.lifecycle.StrategyClosedError`).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = LifecycleState.OPEN
        self._queues: dict[int, _UpdateQueue] = {}
        self._lock = threading.Lock()

    def queue(self, replica: int) -> _UpdateQueue:
        """The queue of ``replica`` (created at first use).

        Raises:
            StrategyClosedError: after :meth:`close`.
        """
        with self._lock:
            if self.state is not LifecycleState.OPEN:
                raise StrategyClosedError(
                    f"{self.name}: the update in backward ran after its model or strategy "
                    "was closed"
                )
            if replica not in self._queues:
                self._queues[replica] = _UpdateQueue(replica)
            return self._queues[replica]

    def peak_queued_bytes(self) -> int:
        """The most host bytes of gradient copies the replicas' queues held at once,
        summed over the replicas (each bounded by :data:`MAX_QUEUED_BYTES`, or by its
        largest block when larger)."""
        with self._lock:
            return sum(q.peak_bytes for q in self._queues.values())

    def settle(self) -> int:
        """Wait for the queued updates of every replica, dropping their errors."""
        with self._lock:
            queues = list(self._queues.values())
        return sum(q.discard() for q in queues)

    def close(self) -> int:
        """OPEN -> CLOSED: wait for the queued updates, stop the threads; idempotent.
        Returns the number of updates waited for."""
        with self._lock:
            if self.state is LifecycleState.CLOSED:
                return 0
            self.state = LifecycleState.CLOSED
            queues, self._queues = list(self._queues.values()), {}
        waited = sum(q.discard() for q in queues)
        for q in queues:
            q.shutdown()
        return waited


_QUEUES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> threads
_QUEUES_LOCK = threading.Lock()


def _queue(optimizer: Any, replica: int) -> _UpdateQueue:
    """The update queue of ``(optimizer, replica)``, created at first use; the
    optimizer's threads are owned by its strategy (closed by ``strategy.close()``)."""
    with _QUEUES_LOCK:
        threads = _QUEUES.get(optimizer)
        if threads is None:
            threads = _QUEUES[optimizer] = _UpdateThreads(f"{optimizer.name} update threads")
            owner = resources_of(getattr(optimizer, "_distribution_strategy", None))
            if owner is not None:
                owner.adopt(threads, ClosePhase.UPDATES, threads.name)
    return threads.queue(replica)


def peak_queued_bytes(optimizer: Any) -> int:
    """Host bytes of queued gradient copies at their most, summed over ``optimizer``'s
    replicas, since its first update in backward (0 when it never updated so)."""
    with _QUEUES_LOCK:
        threads = _QUEUES.get(optimizer)
    return 0 if threads is None else threads.peak_queued_bytes()


def _contiguous_runs(variables: tuple, offset: dict) -> list[list]:
    """Split ``variables`` into runs whose shards are adjacent in the optimizer layout."""
    runs: list[list] = []
    end = None
    for v in variables:
        if runs and offset[id(v)] == end:
            runs[-1].append(v)
        else:
            runs.append([v])
        end = offset[id(v)] + v.shard_elements
    return runs
