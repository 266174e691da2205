"""Collective groups for the raw V2 collectives the runtime issues itself.

TensorFlow's ``tf.distribute`` replica context has ``all_reduce`` and ``all_gather`` but
no reduce-scatter, so :func:`zero_runtime.comm.reduce_scatter_sum_flat` issues
``CollectiveReduceScatterV2`` (NCCL, GPUs) or ``CollectiveAllToAllV2`` (CPU) directly.
Those ops need what a strategy's collective launcher normally keeps (TF_NOTES section 2):

- a *group key* of their own, distinct from the strategy's groups, so the runtime's
  collectives never share an instance with ``tf.distribute``'s;
- an *instance key* per call site that is the same on every replica: replicas trace
  their functions concurrently, so keys are counted per local replica, and the i-th call
  traced by each replica gets the same key;
- an *ordering token* per device (a resource variable): raw V2 collectives of several
  local devices in one ``tf.function`` hang without one, and the token also orders one
  device's collectives the same way on every device.

This module holds that bookkeeping; :mod:`.collectives` stays stateless.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

#: Reduce-scatter implementations: the native collective (GPUs, NCCL), all-to-all plus a
#: local sum (CPU; TF has no CPU reduce-scatter kernel), or all-reduce plus a slice.
REDUCE_SCATTER_IMPLS = ("nccl", "all_to_all", "all_reduce")

# Group keys of the runtime's own collectives: far above the ranges MirroredStrategy
# allocates from its ``_collective_key_base`` (multiples of 100_000 plus a few groups),
# and unique in the process so that several strategies/optimizers never collide.
_GROUP_KEYS = itertools.count(start=1_900_000_001, step=7)


@dataclasses.dataclass
class CollectiveGroup:
    """The local replicas' devices taking part in the runtime's raw collectives.

    Attributes:
        group_key: the group's key (int32), unique in the process.
        devices: one device name per local replica, index = replica id.
        reduce_scatter_impl: one of :data:`REDUCE_SCATTER_IMPLS`.
        timeout_seconds: a collective that does not complete in this many seconds fails
            (``DeadlineExceededError``), float > 0; enforced by the process's
            :data:`~zero_runtime.comm.watchdog.WATCHDOG`, not by TensorFlow (whose
            per-op timeout keeps an OS thread alive per op for the whole timeout).
        tokens: one scalar float32 resource variable per device (the ordering token).
        fallback_impl: None, or 'all_reduce' once a reduce-scatter of this group was
            given a buffer its implementation cannot serve (a length not known at trace
            time) and ran as an all-reduce plus a slice instead
            (:func:`~zero_runtime.comm.reduce_scatter_sum_flat`, which logs it once).
    """

    group_key: int
    devices: tuple[str, ...]
    reduce_scatter_impl: str
    timeout_seconds: float
    tokens: tuple = ()
    fallback_impl: str | None = None
    _counters: dict[int, itertools.count] = dataclasses.field(default_factory=dict)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _tally: dict[str, float] | None = None  # armed by start_tally (trace time)
    step_tally: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def create(
        cls,
        devices: tuple[str, ...] | list[str],
        reduce_scatter_impl: str | None = None,
        timeout_seconds: float = 60.0,
    ) -> CollectiveGroup:
        """Make a group over ``devices`` with a fresh group key and ordering tokens.

        Call outside any ``tf.function`` trace or under ``tf.init_scope()``; the tokens
        are plain resource variables on each device, not strategy variables.

        Args:
            devices: the local replicas' device names, in replica order (non-empty).
            reduce_scatter_impl: one of :data:`REDUCE_SCATTER_IMPLS`, or None (default) to
                choose: 'nccl' when the devices are GPUs, else 'all_to_all'.
            timeout_seconds: collective timeout, seconds (> 0). Default 60.

        Raises:
            ValueError: no devices, an unknown implementation, 'nccl' on non-GPU devices,
                or a non-positive timeout.
        """
        devices = tuple(devices)
        if not devices:
            raise ValueError("a collective group needs at least one device")
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds}")
        on_gpu = all("gpu" in d.lower() for d in devices)
        impl = reduce_scatter_impl or ("nccl" if on_gpu else "all_to_all")
        if impl not in REDUCE_SCATTER_IMPLS:
            raise ValueError(
                f"reduce_scatter_impl must be one of {REDUCE_SCATTER_IMPLS}, got {impl!r}"
            )
        if impl == "nccl" and not on_gpu:
            raise ValueError(f"reduce_scatter_impl='nccl' needs GPU devices, got {devices}")
        tokens = []
        with tf.init_scope():
            for d in devices:
                with tf.device(d):
                    # ResourceVariable(...) directly, not tf.Variable: it bypasses the
                    # strategy's variable creator, so this is one plain variable per device
                    # (as tf.distribute's own CollectiveReplicaLauncher does).
                    tokens.append(resource_variable_ops.ResourceVariable(0.0, trainable=False))
        return cls(next(_GROUP_KEYS), devices, impl, float(timeout_seconds), tuple(tokens))

    @property
    def impl_used(self) -> str:
        """The reduce-scatter implementation the group's collectives run: ``fallback_impl``
        when one was needed, else ``reduce_scatter_impl``."""
        return self.fallback_impl or self.reduce_scatter_impl

    @property
    def group_size(self) -> int:
        """Number of devices (replicas) in the group."""
        return len(self.devices)

    # -- bytes per traced step (telemetry) ------------------------------------------------
    def start_tally(self) -> None:
        """Start counting the collectives traced from now on (a training step's trace
        begins; call once per trace, before the first local replica's collectives)."""
        with self._lock:
            self._tally = {}

    def stop_tally(self) -> dict[str, float]:
        """Stop counting; the counts become :attr:`step_tally` (what one run of the
        traced step moves, every local replica) and are returned: ``<kind>_bytes`` and
        ``<kind>_calls`` for each kind recorded (``zero_runtime.telemetry.comm``)."""
        with self._lock:
            tally, self._tally = self._tally or {}, None
            self.step_tally = dict(tally)
            return dict(self.step_tally)

    def record(self, kind: str, flat: tf.Tensor) -> None:
        """Count one traced collective of ``kind`` (``all_reduce``, ``reduce_scatter``,
        ``all_gather``) whose per-replica input is ``flat``: its bytes by its real dtype
        (``elements * dtype.size``; a length unknown at trace time counts as 0 bytes)."""
        kind = "reduce_scatter" if kind == "all_to_all" else kind  # its implementation
        with self._lock:
            if self._tally is None:
                return
            n = flat.shape.num_elements() or 0
            for key, add in ((f"{kind}_bytes", float(n * flat.dtype.size)), (f"{kind}_calls", 1.0)):
                self._tally[key] = self._tally.get(key, 0.0) + add

    def next_instance_key(self, replica: int) -> int:
        """The next instance key for ``replica``'s trace (1, 2, ... per replica).

        Replicas make the same calls in the same order, so the i-th call of each replica
        gets key i and the collective instances match across replicas.
        """
        with self._lock:
            counter = self._counters.setdefault(replica, itertools.count(start=1))
            return next(counter)

    def token(self, replica: int):
        """The ordering token's handle for ``replica`` (a resource tensor).

        Args:
            replica: the replica id in the sync group. Under MultiWorkerMirroredStrategy
                ids are global (``rank * local_replicas + local index``,
                ``CollectiveAllReduceExtended._get_replica_id_in_sync_group``) and the
                group holds only this worker's devices, so the token is
                ``tokens[replica % len(devices)]`` (the identity in one process).
        """
        return self.token_variable(replica).handle

    def token_variable(self, replica: int):
        """The ordering-token variable of ``replica`` (see :meth:`token`)."""
        return self.tokens[replica % len(self.tokens)]


@dataclasses.dataclass
class WorkerGroup:
    """One device per worker, for eager collectives issued between or inside steps from
    host code: the chief's live-tuning decision (:func:`~.collectives.broadcast_bytes`) and
    stage-3 reads of sharded variables (:func:`~.collectives.gather_local_shards`).

    Create it on every worker in the same order (the group key comes from the same
    process-wide sequence as :class:`CollectiveGroup`'s), and make the same calls on every
    worker in the same order: the i-th call of each worker gets instance key i.

    Attributes:
        group_key: the group's key (int32), unique in the process.
        device: this worker's device taking part (e.g. its first replica's).
        group_size: number of workers (one device each).
        timeout_seconds: a call that does not complete in this many seconds fails with
            ``DeadlineExceededError`` (float > 0; enforced by the process's
            :data:`~zero_runtime.comm.watchdog.WATCHDOG`).
    """

    group_key: int
    device: str
    group_size: int
    timeout_seconds: float
    _counter: itertools.count = dataclasses.field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @classmethod
    def create(cls, device: str, group_size: int, timeout_seconds: float) -> WorkerGroup:
        """A group over ``group_size`` workers with a fresh group key.

        Raises:
            ValueError: ``group_size`` < 1 or a non-positive timeout.
        """
        if group_size < 1 or not timeout_seconds > 0:
            raise ValueError(f"bad group_size={group_size} / timeout={timeout_seconds}")
        return cls(next(_GROUP_KEYS), device, int(group_size), float(timeout_seconds))

    def next_instance_key(self) -> int:
        """The next instance key (1, 2, ...), the same sequence on every worker."""
        with self._lock:
            return next(self._counter)
