"""ShardedVariable: one logical Keras variable whose storage is split across replicas.

Vocabulary (used by :mod:`zero_runtime.stage3` and the stage-3 optimizer path):

- *logical value*: the variable as the model sees it, ``shape`` (e.g. ``(D, C)``).
- *moved value*: the logical value with ``shard_dim`` moved to axis 0, ``(D, *rest)``.
- *shard*: replica ``r``'s rows ``[r * R, (r + 1) * R)`` of the moved value, zero-padded
  to ``R = ceil(D / N)`` rows, flattened: float32 ``[R * prod(rest)]`` (ZeRO-3, parameter
  partitioning, Rajbhandari et al., SC20, section 5.3). It lives as pages of the paged
  pool on the tier ``offload_param`` selects ('cpu' -> host, 'nvme' -> NVMe): with a
  ``space`` (:class:`~zero_runtime.memory.FlatShardSpace`, the stage-3 engine's), a range
  of the replica's flat space, packed with the other variables' shards into page-sized
  chunks; without one, its own pool tensor per replica (:meth:`ShardedVariable.page_ids`
  names the pool tensors either way). On the device tier ('none', with ``devices`` given) it is a
  TensorFlow variable on the replica's device (:meth:`ShardedVariable.device_shard`,
  read and assigned inside a step with no host call) and the pool holds a reservation
  of its pages (``PagedBufferPool.reserve``: counted, pinned, no bytes).
- *gathered buffer*: the all-gathered, padded moved value ``(N * R, *rest)``, a pool
  tensor of kind 'param' on the device tier while the variable is GATHERED.
- *deferred variable*: a Keras variable created inside ``strategy.zero_init()`` with no
  value yet, to become a ShardedVariable straight from its initializer
  (:mod:`zero_runtime.stage3.construction`); :func:`is_deferred` tells one apart. It is
  defined here, below both the optimizers and stage 3, which both ask.

Lifecycle per replica (:class:`ShardState`), one method per transition, each guarded:

====================  ============================================  ==================
state                 counts toward memory                          left by
====================  ============================================  ==================
SHARDED               the shard (its tier)                          ``begin_gather``
GATHERING             the shard; the collective's buffers (TF)      ``finish_gather``
GATHERED              the shard + the gathered buffer (device; the  ``release``
                      pool may move its pages to the host under
                      device pressure, ``gathered_value`` brings
                      them back)
RELEASED              the shard (gathered buffer freed)             ``begin_gather``,
                                                                    ``write_shard``
====================  ============================================  ==================

``write_shard`` (the optimizer's update) is legal only in SHARDED or RELEASED and leaves
SHARDED. Whether a shard's pages are offloaded or in flight is the pool's state
(:class:`zero_runtime.memory.PageState`), not duplicated here.

Outside a training step the variable reads like any Keras variable: ``numpy()``,
``model.get_weights()`` and saving gather on demand from all replicas' shards through
the host (no collective); ``assign`` (``set_weights``, loading) scatters into the shards.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import threading
from collections.abc import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common.stateless_scope import get_stateless_scope, in_stateless_scope
from keras.src.backend.tensorflow.core import Variable as _KerasTFVariable

from zero_runtime.lifecycle import host_function
from zero_runtime.memory import FlatShardSpace, PagedBufferPool, ShardStorage, staging

#: Tier of a shard's pages for each ``offload_param`` value.
PARAM_TIER = {"none": "device", "cpu": "host", "nvme": "nvme"}


def is_deferred(variable) -> bool:
    """True when ``variable`` is a Keras variable without a value (created deferred)."""
    return (
        isinstance(variable, keras.Variable)
        and getattr(variable, "_value", 0) is None
        and getattr(variable, "_initializer", None) is not None
    )


def redirect(original, sharded: _KerasProtocol) -> None:
    """Make the Keras variable ``original`` an alias of ``sharded``, the variable that
    replaced it in its model (stage 3 shards a model in place).

    A user's loop may hold the originals (``train_vars = model.trainable_variables`` read
    before ``optimizer.build`` sharded the model). Keras's TensorFlow variable keeps its
    storage in ``_value`` and reads ``handle``, ``numpy()`` and ``assign`` through it, so
    with ``sharded`` there the original reads and assigns the logical value, and inside a
    step ``tape.gradient`` over it returns ``sharded``'s reduced gradient shard (its
    ``handle`` is the gradient anchor); :func:`resolve` gives ``sharded`` back to the
    optimizer. The replicated storage is released (nothing else holds it).
    """
    original._value = sharded  # noqa: SLF001  (Keras's own storage slot)


def resolve(variable):
    """``variable``, or the sharded variable it is an alias of (:func:`redirect`)."""
    value = getattr(variable, "_value", None)
    return value if isinstance(value, _KerasProtocol) else variable


class ShardState(enum.Enum):
    """Per-replica lifecycle of a :class:`ShardedVariable` (see the module table)."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"
    RELEASED = "released"


class ShardStateError(RuntimeError):
    """A lifecycle transition was requested from a state that does not allow it."""


@dataclasses.dataclass
class _ReplicaShard:
    """One replica's record: its state, its shard's name and its gathered buffer's pool
    tensor (one owner; the shard's storage is :class:`~zero_runtime.memory.ShardStorage`)."""

    shard_id: str
    gathered_id: str
    state: ShardState = ShardState.SHARDED


class _KerasProtocol(_KerasTFVariable):
    """The Keras-variable protocol of a variable stored as shards, with no TensorFlow
    variable behind it (:class:`ShardedVariable` and stage 3's row-paged tables).

    Reads (``value``: ``numpy()``, a layer's call, ``get_weights``, saving) gather on
    demand; assignments (initialization, ``assign``, ``set_weights``, loading) scatter
    into the shards; there is no resource ``handle``. A subclass provides
    ``gather_on_demand()`` (the logical value, float32 ``shape``), ``_write_logical(value)``
    (scatter a float32 value of ``shape``), ``local_replicas``, ``num_shards`` and
    ``_logical_shape``. Keras calls these as methods of the variable, so they are a base
    class, not a collaborator.
    """

    def _initialize(self, value) -> None:
        if callable(value):
            value = value()
        self._write_logical(np.asarray(value, np.float32))
        self._value = None

    def _initialize_with_initializer(self, initializer) -> None:
        self._initialize(lambda: initializer(self._shape, dtype=self._dtype))

    @property
    def value(self):
        """The logical value: inside a stateless call the value given to it; otherwise a
        gather on demand of every replica's shard (a ``tf.numpy_function`` when traced)."""
        if in_stateless_scope():
            current = get_stateless_scope().get_current_value(self)
            if current is not None:
                return self._maybe_autocast(current)
        if tf.inside_function():
            # Inside a stage-3 step of a model run by units, a read outside the units'
            # calls is a gathered use with a backward (zero_runtime/stage3/gather.py).
            reader = self.__dict__.get("_zero_outside_read")
            out = reader(self) if reader is not None else None
            if out is not None:
                return self._maybe_autocast(out)
            fn = self.gather_on_demand
            if len(self.local_replicas) < self.num_shards:
                fn = self._remote_read_in_graph  # traced (Keras's symbolic build), never run
            out = host_function(fn, [], tf.float32, stateful=True)
            out.set_shape(self._logical_shape)
            return self._maybe_autocast(out)
        return self._maybe_autocast(tf.constant(self.gather_on_demand()))

    @property
    def _shared_name(self) -> str:
        """The name ``tf.train.Checkpoint`` records the variable under (its path)."""
        return self.path

    @property
    def _unique_id(self) -> str:
        """The key Keras's TensorFlow optimizers give a variable's storage (``_var_key``
        of an alias, :func:`redirect`, reads it: a LossScaleOptimizer keeps the variables
        it was built over): unique per object."""
        return f"zero_sharded_{id(self):x}"

    def _serialize_to_tensors(self) -> dict:
        """``tf.train.Checkpoint`` saving: the logical value, gathered on demand (float32
        ``shape``), under the name a ``tf.Variable`` uses, so the checkpoint holds what a
        replicated variable's would."""
        return {"VARIABLE_VALUE": tf.constant(self.gather_on_demand())}

    def _restore_from_tensors(self, restored_tensors: dict):
        """``tf.train.Checkpoint`` restoring: scatter the saved logical value into the
        shards (eagerly; ``_direct_assign``)."""
        value = restored_tensors["VARIABLE_VALUE"]
        self._direct_assign(np.asarray(value))
        return value

    def _remote_read_in_graph(self) -> np.ndarray:
        # A collective issued from a host callback inside a running graph could deadlock
        # the step; with shards on other workers the value is read eagerly between steps.
        raise RuntimeError(
            f"ShardedVariable {self.path!r}: with shards on other workers the value is "
            "gathered eagerly between steps (get_weights, numpy), not inside a tf.function"
        )

    def _direct_assign(self, value) -> None:
        if tf.inside_function():
            raise RuntimeError(
                f"ShardedVariable {self.path!r} cannot be assigned inside a traced function; "
                "the stage-3 optimizer updates shards with write_shard"
            )
        self._write_logical(np.asarray(value, np.float32).reshape(self._logical_shape))

    @property
    def handle(self):
        """Inside a stage-3 step under a user's ``tf.GradientTape`` (a custom loop), the
        replica's gradient anchor of this variable: a float32 scalar whose gradient is
        the replica's reduced gradient shard, float32 ``[shard_elements]``
        (:meth:`zero_runtime.stage3.units_path.UnitsPath.user_forward`), which is what
        ``tape.gradient(loss, model.trainable_variables)`` returns for it.

        Raises:
            AttributeError: anywhere else: a sharded variable has no single TensorFlow
                resource.
        """
        anchor_of = self.__dict__.get("_zero_anchor")
        anchor = anchor_of(self) if anchor_of is not None else None
        if anchor is not None:
            return anchor
        raise AttributeError(
            f"ShardedVariable {self.path!r} has no resource handle outside a stage-3 "
            "training step: its value is gathered from shards (read v.numpy() or "
            "v.value). A tf.GradientTape differentiates it inside a @tf.function step "
            "run by strategy.run, where the model was called under the tape"
        )


class ShardedVariable(_KerasProtocol):
    """A Keras variable stored as per-replica shards in a paged pool (ZeRO stage 3).

    Args:
        value: the initial logical value, array-like of ``shape`` (float32).
        pool: the :class:`~zero_runtime.memory.PagedBufferPool` holding the pages.
        num_shards: N, the number of replicas (int >= 1).
        tier: 'device', 'host' or 'nvme': where the shards' pages are placed.
        name: the variable's name (no '/'); ``path`` is set to ``path`` if given.
        path: the Keras path of the variable this one replaces (for saving/reading).
        shard_dim: the axis split across replicas (default 0; negative counts from the
            end). A scalar variable is treated as shape ``(1,)``.
        persistent: True for a parameter below ``persistence_threshold``: it is still
            stored as shards, but once gathered in a step it stays gathered until the
            optimizer updates it (DeepSpeed's persistent parameters).
        trainable: Keras's flag (default True).
        local_replicas: the replica ids whose shards this process holds (default: all
            ``range(num_shards)``, one process). Under ``MultiWorkerMirroredStrategy`` a
            worker holds only its own replicas' shards (ids ``rank * local + i``).
        gather_remote: with ``local_replicas`` a subset, the collective that assembles
            every replica's shard outside a step: ``{replica: float32 [shard_elements]}``
            of the local replicas -> float32 ``[num_shards, shard_elements]`` (every
            worker calls it; :func:`zero_runtime.comm.gather_local_shards`).
        devices: with ``tier='device'``, the local replicas' devices (replica ``r``'s is
            ``devices[r % len(devices)]``): each local shard is then a float32
            ``[shard_elements]`` resource variable on its replica's device and the pool
            holds a reservation of its pages. Default None: the shards are pool pages on
            ``tier`` (also 'device': pages as TensorFlow tensors, read by host calls).
        space: a :class:`~zero_runtime.memory.FlatShardSpace` on ``tier`` ('host' or
            'nvme') over ``local_replicas``: each shard is then a range of the replica's
            flat space (packed with other variables' shards, page-sized chunks) instead
            of its own pool tensor of whole pages. Default None.
        autocast: Keras's flag (default True): under a mixed-precision policy a layer's
            read is cast to its compute dtype. The variable this one replaces gives it
            (normalization layers keep theirs in float32: ``autocast=False``).

    Raises:
        ValueError: a non-float32 value, ``num_shards`` < 1, a bad ``shard_dim``,
            ``local_replicas`` out of range / a subset without ``gather_remote``, or a
            ``space`` on another tier / over other replicas, or with device ``devices``.
    """

    #: Where the local replicas' shards live (pool pages, a flat space's range, device
    #: variables). None in a subclass that stores its shards itself (stage 3's row-paged
    #: tables), whose ``device_shard`` is then None.
    _storage: ShardStorage | None = None

    def __init__(
        self,
        value,
        *,
        pool: PagedBufferPool,
        num_shards: int,
        tier: str,
        name: str,
        path: str | None = None,
        shard_dim: int = 0,
        persistent: bool = False,
        trainable: bool = True,
        local_replicas: Sequence[int] | None = None,
        gather_remote: Callable[[dict[int, np.ndarray]], np.ndarray] | None = None,
        devices: Sequence[str] | None = None,
        space: FlatShardSpace | None = None,
        autocast: bool = True,
    ) -> None:
        value = np.asarray(value)
        if value.dtype != np.float32:
            raise ValueError(
                f"ShardedVariable {name!r}: only float32 is supported, got {value.dtype}"
            )
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        shape = tuple(int(d) for d in value.shape)
        ndim = max(1, len(shape))
        if not -ndim <= shard_dim < ndim:
            raise ValueError(f"shard_dim={shard_dim} out of range for shape {shape}")
        self.pool = pool
        self.num_shards = int(num_shards)
        local = tuple(range(self.num_shards) if local_replicas is None else local_replicas)
        if not local or any(not 0 <= r < self.num_shards for r in local):
            raise ValueError(f"local_replicas {local} not in [0, {self.num_shards})")
        if len(local) < self.num_shards and gather_remote is None:
            raise ValueError("local_replicas is a subset: gather_remote is required")
        self.local_replicas = local
        self._gather_remote = gather_remote
        self.tier = tier
        self.shard_dim = shard_dim % ndim
        self.persistent = bool(persistent)
        self._logical_shape = shape
        moved = _moved_shape(shape, self.shard_dim)  # (D, *rest)
        self.rows = -(-moved[0] // self.num_shards)  # R = ceil(D / N)
        self.row_elements = math.prod(moved[1:])
        self.shard_elements = self.rows * self.row_elements  # [R * prod(rest)]
        self._moved_shape = moved
        self._lock = threading.Lock()
        uid = f"{(path or name).replace('/', '.')}#{id(self):x}"
        self._replicas = [
            _ReplicaShard(f"p/{uid}/r{r}", f"g/{uid}/r{r}") for r in range(self.num_shards)
        ]
        self.space = space
        if space is not None and (space.tier != tier or set(space.replicas) != set(local)):
            raise ValueError(
                f"ShardedVariable {name!r}: space {space!r} is not on tier {tier!r} over "
                f"local replicas {local}"
            )
        ids = [rec.shard_id for rec in self._replicas]
        self._storage = ShardStorage(
            pool, tier, self.shard_elements, ids, local, name, devices, space
        )
        super().__init__(
            initializer=lambda shape, dtype=None: value,
            shape=shape,
            dtype="float32",
            trainable=trainable,
            name=name,
            autocast=autocast,
        )
        if path is not None:
            self._path = path

    # -- geometry ------------------------------------------------------------------------
    @property
    def padded_rows(self) -> int:
        """``N * R``: rows of the gathered (padded, moved) value."""
        return self.num_shards * self.rows

    def state(self, replica: int) -> ShardState:
        """The lifecycle state of ``replica``'s copy."""
        return self._replicas[replica].state

    def shard_id(self, replica: int) -> str:
        """The name of ``replica``'s shard (in messages); without a ``space`` also its pool
        tensor id (or device reservation). Pool calls use :meth:`page_ids`."""
        return self._replicas[replica].shard_id

    def page_ids(self, replica: int) -> tuple[str, ...]:
        """The pool tensor ids holding ``replica``'s shard, in order: the chunks of the
        flat space its range overlaps (shared with other variables; empty for an empty
        shard), or its own tensor (a device shard's reservation) without a space."""
        return self._storage.page_ids(replica)

    def shards_from_logical(self, value: np.ndarray) -> np.ndarray:
        """Split a logical value into shards: float32 ``[N, shard_elements]``."""
        value = np.asarray(value, np.float32)
        if self._logical_shape:
            moved = np.moveaxis(value.reshape(self._logical_shape), self.shard_dim, 0)
        else:
            moved = value.reshape(1)
        padded = np.zeros((self.padded_rows, *self._moved_shape[1:]), np.float32)
        padded[: self._moved_shape[0]] = moved
        return padded.reshape(self.num_shards, self.shard_elements)

    def logical_from_shards(self, shards: np.ndarray) -> np.ndarray:
        """Reassemble ``[N, shard_elements]`` (or the flat gathered buffer) into the value."""
        padded = np.asarray(shards, np.float32).reshape(self.padded_rows, *self._moved_shape[1:])
        moved = padded[: self._moved_shape[0]]
        if not self._logical_shape:
            return moved.reshape(())
        return np.ascontiguousarray(np.moveaxis(moved, 0, self.shard_dim))

    # -- shards --------------------------------------------------------------------------
    def device_shard(self, replica: int) -> tf.Variable | None:
        """``replica``'s shard as a resource variable on its device, float32
        ``[shard_elements]`` (tier 'device' with ``devices`` given), else None. A step
        reads it for the all-gather and the optimizer assigns it, inside the graph."""
        return None if self._storage is None else self._storage.device_variable(replica)

    def read_shard(self, replica: int) -> np.ndarray:
        """A copy of ``replica``'s shard, float32 ``[shard_elements]`` (pages it in)."""
        return self._storage.read(replica)

    def read_shard_into(self, replica: int, out: np.ndarray) -> None:
        """Copy ``replica``'s shard into ``out`` (float32 ``[shard_elements]``, e.g. a slice
        of a unit's concatenated shards): one copy, from its pages (paged in to the host)
        or its device variable."""
        if self.tier == "device":  # one copy through read_shard (a subclass's, too)
            out[:] = self.read_shard(replica)
            return
        self._storage.read_into(replica, out)

    def read_shard_slice(self, replica: int, axis: int, start: int, size: int) -> np.ndarray:
        """A copy of ``[start, start + size)`` along ``axis`` of ``replica``'s shard seen as
        ``[rows, *shape[1:]]`` (``shard_dim`` 0): float32, flat, ``rows * size *
        prod(the other axes)`` elements, in row-major order of the sliced block. A column
        tile of a kernel (``zero_runtime/stage3/tiling.py``): only the tile's elements are
        copied from the pages.

        Raises:
            ValueError: ``shard_dim`` is not 0, ``axis`` not in ``[1, ndim)``, or the
                slice outside the axis.
            zero_runtime.memory.PagingError: a page-in from NVMe failed.
        """
        shape = tuple(self.shape)
        if self.shard_dim != 0 or not 1 <= axis < len(shape):
            raise ValueError(
                f"read_shard_slice: axis {axis} of {shape} (shard_dim {self.shard_dim}); "
                "a slice of a shard needs shard_dim 0 and an axis in [1, ndim)"
            )
        if not 0 <= start <= start + size <= shape[axis]:
            raise ValueError(
                f"read_shard_slice: [{start}, {start + size}) outside [0, "
                f"{shape[axis]}] on axis {axis} of {shape}"
            )
        inner = math.prod(shape[axis + 1 :])
        outer = self.rows * math.prod(shape[1:axis])
        out = staging.empty(outer * size * inner)  # recycled, aligned (memory/staging.py)
        self._storage.read_columns_into(
            replica, shape[axis] * inner, start * inner, (start + size) * inner, out
        )
        return out

    def update_shard_in_place(self, replica: int, fn: Callable[[np.ndarray], None]) -> None:
        """Run ``fn`` on ``replica``'s shard where it lives on the host (SHARDED or RELEASED
        -> SHARDED): ``fn`` gets a writable float32 ``[shard_elements]`` array (the page
        itself for a one-page shard; a copy written back after ``fn`` otherwise) and
        updates it in place. The optimizer's update without a read and a write copy.
        With a ``space``: the page itself when the shard's range lies in one chunk, a copy
        written back otherwise.

        Raises:
            ShardStateError: the replica's copy is GATHERING or GATHERED.
            ValueError: a shard that is not in host-tier pages (``tier`` 'host').
        """
        rec = self._replicas[replica]
        if self.tier != "host" or self.device_shard(replica) is not None:
            raise ValueError(
                f"update_shard_in_place: {getattr(self, '_path', '?')!r} is on tier "
                f"{self.tier!r}; in place is for host-tier shards (use write_shard)"
            )
        with self._lock:
            self._expect(rec, (ShardState.SHARDED, ShardState.RELEASED), "update_shard_in_place")
            self._storage.update_in_place(replica, fn)
            rec.state = ShardState.SHARDED

    def write_shard(self, replica: int, shard: np.ndarray) -> None:
        """Store ``replica``'s updated shard (SHARDED or RELEASED -> SHARDED).

        Raises:
            ShardStateError: the replica's copy is GATHERING or GATHERED (a gathered
                buffer would go stale); ``release`` it first.
        """
        rec = self._replicas[replica]
        with self._lock:
            self._expect(rec, (ShardState.SHARDED, ShardState.RELEASED), "write_shard")
            self._store(replica, shard)
            rec.state = ShardState.SHARDED

    # -- transitions ---------------------------------------------------------------------
    def begin_gather(self, replica: int) -> None:
        """SHARDED or RELEASED -> GATHERING (the shard was read for the all-gather)."""
        rec = self._replicas[replica]
        with self._lock:
            self._expect(rec, (ShardState.SHARDED, ShardState.RELEASED), "begin_gather")
            rec.state = ShardState.GATHERING

    def finish_gather(self, replica: int, gathered: np.ndarray) -> None:
        """GATHERING -> GATHERED: store the all-gathered padded buffer on the device tier.

        Args:
            replica: the replica id.
            gathered: float32, ``N * shard_elements`` elements (the all-gather output).

        Raises:
            ShardStateError: not GATHERING.
            PoolOutOfMemoryError: the device tier cannot hold the gathered buffer.
        """
        rec = self._replicas[replica]
        with self._lock:
            self._expect(rec, (ShardState.GATHERING,), "finish_gather")
            shape = (self.padded_rows, *self._moved_shape[1:])
            self.pool.allocate(rec.gathered_id, shape, np.float32, "param", "device")
            self.pool.write(rec.gathered_id, np.asarray(gathered, np.float32).reshape(shape))
            rec.state = ShardState.GATHERED

    def gathered_value(self, replica: int) -> np.ndarray:
        """The logical value read from ``replica``'s gathered buffer (must be GATHERED).

        The buffer is acquired on the device tier: pages the pool moved down to the host
        under device pressure (a kept block, a lowered ``device_budget_bytes``) come back
        first (``h2d`` page moves).
        """
        rec = self._replicas[replica]
        self._expect(rec, (ShardState.GATHERED,), "gathered_value")
        out = self.pool.acquire(rec.gathered_id, "device")
        try:
            return self.logical_from_shards(out.numpy())
        finally:
            self.pool.release(rec.gathered_id)

    def release(self, replica: int) -> None:
        """GATHERED -> RELEASED: free the gathered buffer's device pages."""
        rec = self._replicas[replica]
        with self._lock:
            self._expect(rec, (ShardState.GATHERED,), "release")
            self.pool.free(rec.gathered_id)
            rec.state = ShardState.RELEASED

    def reset(self, replica: int) -> ShardState:
        """Any state -> SHARDED or RELEASED, after a step that failed part-way.

        A step aborted by an error never runs its remaining host calls, so a replica can
        be left GATHERING (its all-gather never finished) or GATHERED (its release never
        ran). GATHERING returns to RELEASED (nothing was allocated), GATHERED is released
        (its device pages freed); the shard itself is unchanged. Returns the state the
        replica was in.
        """
        rec = self._replicas[replica]
        with self._lock:
            before = rec.state
            if before is ShardState.GATHERED:
                self.pool.free(rec.gathered_id)
            if before in (ShardState.GATHERED, ShardState.GATHERING):
                rec.state = ShardState.RELEASED
            return before

    def gather_on_demand(self) -> np.ndarray:
        """The logical value assembled from every replica's shard on the host (outside a
        step: ``numpy()``, ``get_weights()``, saving). No state changes. With shards on
        other workers, ``gather_remote`` all-gathers them (every worker must call this)."""
        if len(self.local_replicas) < self.num_shards:
            shards = self._gather_remote({r: self.read_shard(r) for r in self.local_replicas})
            return self.logical_from_shards(shards)
        shards = np.stack([self.read_shard(r) for r in range(self.num_shards)])
        return self.logical_from_shards(shards)

    def free(self) -> None:
        """Free every page this variable owns (shards and gathered buffers); with a
        ``space``, give its range back (chunks no other shard uses are freed)."""
        for rec in self._replicas:
            if rec.state is ShardState.GATHERED:
                self.pool.free(rec.gathered_id)
        self._storage.free()

    # -- helpers -------------------------------------------------------------------------
    def _write_logical(self, value: np.ndarray) -> None:
        shards = self.shards_from_logical(value)
        for r in self.local_replicas:
            rec = self._replicas[r]
            with self._lock:
                self._expect(rec, (ShardState.SHARDED, ShardState.RELEASED), "assign")
                self._store(r, shards[r])

    def _store(self, replica: int, shard: np.ndarray) -> None:
        """Write one replica's shard where it lives (its device variable, its range of the
        flat space, or its pages: :meth:`~zero_runtime.memory.ShardStorage.write`)."""
        flat = np.asarray(shard, np.float32).reshape(-1)
        if self.device_shard(replica) is not None and flat.shape != (self.shard_elements,):
            raise ValueError(
                f"shard of {getattr(self, '_path', '?')!r} has {flat.size} elements, "
                f"expected {self.shard_elements}"
            )
        self._storage.write(replica, flat)

    def _expect(self, rec: _ReplicaShard, allowed: tuple[ShardState, ...], what: str) -> None:
        if rec.state not in allowed:
            raise ShardStateError(
                f"{what} on {getattr(self, '_path', '?')!r} ({rec.shard_id}) needs state "
                f"{'/'.join(s.name for s in allowed)}, but it is {rec.state.name}"
            )

    def __repr__(self) -> str:
        return (
            f"<ShardedVariable path={getattr(self, '_path', '?')} shape={self._logical_shape} "
            f"shards={self.num_shards}x{self.shard_elements} tier={self.tier}"
            f"{' persistent' if self.persistent else ''}>"
        )


def least_padding_dim(shape: Sequence[int], num_shards: int) -> int:
    """The axis to split ``shape`` along over ``num_shards`` replicas with the fewest
    padding elements: axis ``d`` is padded to ``N * ceil(shape[d] / N)`` rows of
    ``prod(other axes)`` elements. Axis 0 on a tie (tiling and row-paged tables need it,
    and a kernel's input dimension usually divides); 0 for a scalar. A 1x1 convolution's
    ``(1, 1, C_in, C_out)`` kernel split along axis 0 over 2 replicas is half padding.

    Raises:
        ValueError: ``num_shards`` < 1.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    dims = [int(d) for d in shape]
    total = math.prod(dims)

    def padding(d: int) -> int:
        size = dims[d]
        return (-(-size // num_shards) * num_shards - size) * (total // size) if size else 0

    return min(range(len(dims)), key=lambda d: (padding(d), d), default=0)


def _moved_shape(shape: tuple[int, ...], shard_dim: int) -> tuple[int, ...]:
    if not shape:
        return (1,)
    dims = list(shape)
    d = dims.pop(shard_dim)
    return (d, *dims)
