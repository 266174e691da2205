"""Hot and cold embedding rows: a large embedding table paged by row use (ZeRO stage 3).

A ``keras.layers.Embedding`` whose table has at least ``embedding_row_paging_threshold``
elements is not gathered whole like other stage-3 parameters; only the rows a step looks
up move. Vocabulary (the rest as in :mod:`zero_runtime.sharded_variable`):

- *table*: the logical value, float32 ``(V, C)``.
- *shard*: replica ``r`` owns rows ``[r * R, (r + 1) * R)``, ``R = ceil(V / N)``.
- *row page*: ``rows_per_page = page_size // (4 * C)`` consecutive rows of one shard, one
  pool tensor of one page, ``e/<uid>/r<r>/p<k>``, float32 ``(rows, C)``, kind 'param'.
  It starts on the tier ``offload_param`` selects ('none' -> device, 'cpu' -> host,
  'nvme' -> NVMe).
- *hot / cold*: a row page a step looked up is acquired on the device tier and stays
  there after its release until the pool's eviction moves it down (least recently used
  first). Cold pages wait on the host or NVMe.
- *touched rows*: the unique ids of all replicas' batches in a step, ``U`` (sorted),
  padded with -1 to ``K = N * L`` entries (``L`` = ids per replica).

A step on replica ``r`` (the layer is a unit of the units path, its lookup
:meth:`RowPagedEmbedding.use` inside the model's own call):

1. forward: its ids ``(L,)`` are all-gathered (:func:`zero_runtime.comm.all_gather_flat`)
   so every replica computes the same ``U``; replica ``r`` acquires on the device tier
   only the row pages holding its own rows of ``U`` (h2d / n2h moves for cold pages, LRU
   evictions d2h / h2n), copies those rows into ``(K, C)`` zeros, and an all-reduce
   (:func:`zero_runtime.comm.all_reduce_sum_flat`; exactly one replica contributes each
   row, so the sum is exact) gives every replica the rows of ``U``. The output is
   ``rows[inverse]``, as ``Embedding.call``'s ``take`` gives.
2. backward: the output gradient is summed per touched row
   (``unsorted_segment_sum``, the same accumulation TensorFlow's densified
   ``IndexedSlices`` uses) and all-reduced: the summed gradient of the touched rows,
   ``(K, C)``, identical on every replica: the gradient of the table's anchor, which
   ``fit``'s step and a user's ``tape.gradient`` both receive. The whole table never
   moves and no dense ``(V, C)`` gradient exists.
3. update (:meth:`RowPagedEmbedding.apply_update`): replica ``r`` updates its own touched
   rows with the optimizer's host kernel (Keras's operation order,
   :mod:`zero_runtime.optim.kernels`) and optimizer states that exist for touched row
   pages only: 'optimizer' pool pages, allocated zeroed when a row page is first touched,
   on the tier ``offload_optimizer`` selects. SGD (with or without momentum) on the rows
   a step touches equals SGD on the dense gradient exactly (the others' gradient is 0),
   except that momentum rows not touched keep their velocity unapplied (lazy momentum).
   Adam is **lazy Adam** (TF-Addons ``LazyAdam``; DeepSpeed's sparse gradients): ``m``,
   ``v`` and the row change only for touched rows, the bias correction uses the global
   step. AdamW's decoupled decay applies to touched rows only.

Across workers (``MultiWorkerMirroredStrategy``) the same three steps run unchanged: the
all-gather of ids and the two all-reduces are the strategy's collectives, which span
every replica of every worker, and replica ``r`` only ever touches its own rows. So a
worker allocates the row pages of its local replicas only (``local_replicas``); reading
the table between steps (``get_weights``, saving) gathers the other workers' shards with
``gather_remote`` (:func:`zero_runtime.comm.gather_local_shards`), as
:class:`~zero_runtime.sharded_variable.ShardedVariable` does.

Default budgets (:func:`row_paging_budget`): when ``device_budget_bytes`` is not given,
the stage-3 engine reserves for a row-paged table a *row cache* on the device tier (not
the table; an int budget needs ``ROW_CACHE_MIN_PAGES`` per local replica,
:mod:`zero_runtime.stage3.device_plan`): ``max(ROW_CACHE_MIN_PAGES, ceil(pages_per_shard
/ ROW_CACHE_DIVISOR))`` row pages per local replica, at most the whole shard; the
table's row pages count on their own tier, and ``MAX_ROW_STATE_SLOTS`` optimizer-state
pages per row page on the state tier.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow.core import Variable as _KerasTFVariable

from zero_runtime import comm
from zero_runtime.config import ZeroConfig
from zero_runtime.lifecycle import host_function
from zero_runtime.memory import PagedBufferPool
from zero_runtime.sharded_variable import (
    PARAM_TIER,
    ShardedVariable,
    ShardStateError,
    _moved_shape,
    _ReplicaShard,
)
from zero_runtime.stage3 import construction

#: Tier of the row optimizer-state pages for each ``offload_optimizer`` value.
STATE_TIER = {"none": "device", "cpu": "host", "nvme": "nvme"}

#: Default device row cache of a table: 1/ROW_CACHE_DIVISOR of a shard's row pages (per
#: local replica). Skewed (power-law) ids concentrate most lookups on few rows; a cache of
#: 1/8 of the table keeps those hot without reserving the table (see docs/stages/embeddings.md).
ROW_CACHE_DIVISOR = 8
#: ... and at least this many row pages per local replica (one page being read while the
#: previous one is still the most recently used).
ROW_CACHE_MIN_PAGES = 2
#: Optimizer-state pages reserved per row page: the largest slot count of the partitioned
#: optimizers (Adam/AdamW: momentum, velocity; SGD: 0 or 1).
MAX_ROW_STATE_SLOTS = 2


@dataclasses.dataclass(frozen=True)
class RowPagingBudget:
    """Pages a row-paged table needs in one process's pool (the engine's default budgets).

    Attributes:
        rows_per_page: rows of one row page (``page_size // (4 * C)``, at least 1).
        pages_per_shard: row pages of one replica's shard, ``ceil(R / rows_per_page)``.
        shard_pages: row pages of the local replicas' shards (on the ``offload_param``
            tier): ``local * pages_per_shard``.
        cache_pages: the default device row cache, ``local * min(pages_per_shard,
            max(ROW_CACHE_MIN_PAGES, ceil(pages_per_shard / ROW_CACHE_DIVISOR)))``.
        state_pages: optimizer-state pages at most (every row page touched),
            ``MAX_ROW_STATE_SLOTS * shard_pages``, on the ``offload_optimizer`` tier.
    """

    rows_per_page: int
    pages_per_shard: int
    shard_pages: int
    cache_pages: int
    state_pages: int


def row_paging_budget(
    shape: tuple[int, int], page_size: int, num_shards: int, local: int
) -> RowPagingBudget:
    """The pages of a row-paged table of ``shape`` ``(V, C)`` (float32) in one pool.

    Args:
        shape: the table's logical shape ``(V, C)``.
        page_size: the pool's page size, bytes.
        num_shards: N, replicas in sync.
        local: replicas whose shards this process holds (N in one process).

    Returns:
        The :class:`RowPagingBudget` (page counts).
    """
    vocab, width = int(shape[0]), int(shape[1])
    rows = -(-vocab // num_shards)  # R
    per_page = max(1, page_size // (4 * width))
    per_shard = -(-rows // per_page)
    cache = min(per_shard, max(ROW_CACHE_MIN_PAGES, -(-per_shard // ROW_CACHE_DIVISOR)))
    return RowPagingBudget(
        per_page,
        per_shard,
        local * per_shard,
        local * cache,
        MAX_ROW_STATE_SLOTS * local * per_shard,
    )


def row_paging_applies(layer: keras.layers.Layer, config: ZeroConfig) -> bool:
    """True when ``layer`` is a plain ``keras.layers.Embedding`` whose table has at least
    ``config.embedding_row_paging_threshold`` elements (float32, trainable, no LoRA, not
    quantized, no constraint). Other layers are sharded and gathered whole as before."""
    if type(layer) is not keras.layers.Embedding or not layer.trainable:
        return False
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return False
    if layer.embeddings_constraint is not None:
        return False
    table = layer.embeddings
    if np.dtype(table.dtype) != np.float32:
        return False
    return math.prod(table.shape) >= config.embedding_row_paging_threshold


class RowPagedTable(ShardedVariable):
    """An embedding table stored as row pages of the paged pool, one shard per replica.

    A :class:`~zero_runtime.sharded_variable.ShardedVariable` along dim 0 whose shard is
    not one pool tensor but ``pages_per_shard`` one-page tensors of consecutive rows, so
    that rows move page by page; it is never gathered whole in a step (its state stays
    SHARDED; the gather transitions raise :class:`ShardStateError`). Outside a step it
    reads and assigns like any Keras variable (``get_weights``, saving: gathered on
    demand through the host, no page moves).

    Args:
        value: the initial table, float32 ``(V, C)``.
        pool: the engine's :class:`~zero_runtime.memory.PagedBufferPool`.
        num_shards: N, replicas (int >= 1).
        tier: 'device', 'host' or 'nvme': where the row pages start.
        name: the variable's name; ``path``: the Keras path of the variable replaced.
        local_replicas: replica ids whose row pages this process holds (default: all;
            under ``MultiWorkerMirroredStrategy`` a worker's own, ``rank * local + i``).
        gather_remote: with ``local_replicas`` a subset, the collective assembling every
            replica's shard between steps, ``{replica: float32 [R * C]}`` -> float32
            ``[N, R * C]`` (:func:`zero_runtime.comm.gather_local_shards`).

    Attributes:
        row_paged: True (the partitioned optimizer leaves these to
            :meth:`RowPagedEmbedding.apply_update`).
        rows_per_page: rows of one row page (``page_size // (4 * C)``, at least 1).
        pages_per_shard: ``ceil(R / rows_per_page)``.

    Raises:
        ValueError: not float32 2-D, ``num_shards`` < 1, a row larger than a page, or
            ``local_replicas`` out of range / a subset without ``gather_remote``.
    """

    row_paged = True

    def __init__(
        self,
        value,
        *,
        pool: PagedBufferPool,
        num_shards: int,
        tier: str,
        name: str,
        path: str | None = None,
        local_replicas: tuple[int, ...] | None = None,
        gather_remote=None,
    ) -> None:
        value = np.asarray(value)
        if value.dtype != np.float32 or value.ndim != 2:
            raise ValueError(f"RowPagedTable {name!r}: float32 (V, C) expected, got {value.dtype}")
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        vocab, width = (int(d) for d in value.shape)
        if 4 * width > pool.page_size:
            raise ValueError(f"RowPagedTable {name!r}: a row of {width} floats exceeds a page")
        self.pool = pool
        self.num_shards = int(num_shards)
        self.tier = tier
        self.shard_dim = 0
        self.persistent = False
        self._logical_shape = (vocab, width)
        self._moved_shape = _moved_shape(self._logical_shape, 0)
        self.rows = -(-vocab // self.num_shards)  # R
        self.row_elements = width  # C
        self.shard_elements = self.rows * width
        local = tuple(range(self.num_shards) if local_replicas is None else local_replicas)
        if not local or any(not 0 <= r < self.num_shards for r in local):
            raise ValueError(f"local_replicas {local} not in [0, {self.num_shards})")
        if len(local) < self.num_shards and gather_remote is None:
            raise ValueError("local_replicas is a subset: gather_remote is required")
        self.local_replicas = local  # a worker holds its own replicas' row pages only
        self._gather_remote = gather_remote
        self.rows_per_page = max(1, pool.page_size // (4 * width))
        self.pages_per_shard = -(-self.rows // self.rows_per_page)
        self._lock = threading.Lock()
        self._uid = f"{(path or name).replace('/', '.')}#{id(self):x}"
        self._replicas = [_ReplicaShard(f"e/{self._uid}/r{r}", "") for r in range(self.num_shards)]
        for r in self.local_replicas:
            for k in range(self.pages_per_shard):
                shape = (self.page_rows(k), width)  # (rows, C)
                pool.allocate(self.page_id(r, k), shape, np.float32, "param", tier)
        _KerasTFVariable.__init__(
            self,
            initializer=lambda shape, dtype=None: value,
            shape=self._logical_shape,
            dtype="float32",
            trainable=True,
            name=name,
        )
        if path is not None:
            self._path = path

    # -- geometry --------------------------------------------------------------------------
    def page_id(self, replica: int, page: int) -> str:
        """Pool tensor id of row page ``page`` of ``replica``'s shard."""
        return f"e/{self._uid}/r{replica}/p{page}"

    def state_id(self, replica: int, page: int, slot: str) -> str:
        """Pool tensor id of the optimizer slot ``slot`` for row page ``page``."""
        return f"o/{self._uid}/r{replica}/p{page}/{slot}"

    def page_rows(self, page: int) -> int:
        """Rows held by row page ``page`` (the last page of a shard may be shorter)."""
        return min(self.rows_per_page, self.rows - page * self.rows_per_page)

    def shard_id(self, replica: int) -> str:
        """The id of ``replica``'s first row page (placement rows show its tier)."""
        return self.page_id(replica, 0)

    def page_ids(self, replica: int) -> list[str]:
        """Every row-page id of ``replica``'s shard, in row order."""
        return [self.page_id(replica, k) for k in range(self.pages_per_shard)]

    # -- shards (outside the step, through the host, no page moves) --------------------------
    def read_shard(self, replica: int) -> np.ndarray:
        """A copy of ``replica``'s shard, float32 ``[R * C]``, read page by page where the
        pages are (``PagedBufferPool.read``: no moves)."""
        return np.concatenate([self.pool.read(p).reshape(-1) for p in self.page_ids(replica)])

    def write_shard(self, replica: int, shard: np.ndarray) -> None:
        """Store ``replica``'s whole shard, float32 ``[R * C]``, page by page in place."""
        rows = np.asarray(shard, np.float32).reshape(self.rows, self.row_elements)
        for k in range(self.pages_per_shard):
            start = k * self.rows_per_page
            self.pool.write(self.page_id(replica, k), rows[start : start + self.page_rows(k)])

    def gather_on_demand(self) -> np.ndarray:
        """The whole table, float32 ``(V, C)``, read from every replica's row pages where
        they are (outside a step: ``numpy()``, ``get_weights()``, saving; no page moves).
        With shards on other workers, ``gather_remote`` all-gathers them (every worker
        must call this, in the same order)."""
        if len(self.local_replicas) < self.num_shards:
            local = {r: self.read_shard(r) for r in self.local_replicas}
            return self.logical_from_shards(self._gather_remote(local))
        shards = np.stack([self.read_shard(r) for r in range(self.num_shards)])
        return self.logical_from_shards(shards)

    def begin_gather(self, replica: int) -> None:
        """Not allowed: a row-paged table is never gathered whole in a step."""
        raise ShardStateError(f"{self._uid}: a row-paged table is not gathered whole")

    def finish_gather(self, replica: int, gathered: np.ndarray) -> None:
        """Not allowed (see :meth:`begin_gather`)."""
        raise ShardStateError(f"{self._uid}: a row-paged table is not gathered whole")

    def free(self) -> None:
        """Free every row page and optimizer-state page of the table."""
        ids = set(self.pool.tensor_ids())
        for tid in ids:
            if tid.startswith((f"e/{self._uid}/", f"o/{self._uid}/")):
                self.pool.free(tid)

    def _write_logical(self, value: np.ndarray) -> None:
        shards = self.shards_from_logical(value)
        for r in self.local_replicas:
            self.write_shard(r, shards[r])

    def __repr__(self) -> str:
        return (
            f"<RowPagedTable path={getattr(self, '_path', '?')} shape={self._logical_shape} "
            f"shards={self.num_shards}x{self.pages_per_shard} pages of {self.rows_per_page} "
            f"rows tier={self.tier}>"
        )


@dataclasses.dataclass
class RowStats:
    """Rows and row pages one replica looked up in its last forward.

    Attributes:
        unique_rows: touched rows of all replicas in the step (``|U|``).
        owned_rows: the replica's own rows among them.
        pages: row pages of the replica acquired on the device tier.
        seconds: host time of the lookup (page-ins included), seconds.
    """

    unique_rows: int = 0
    owned_rows: int = 0
    pages: int = 0
    seconds: float = 0.0


class RowPagedEmbedding:
    """One row-paged ``Embedding`` unit of the stage-3 engine (see the module docstring).

    Args:
        layer: the ``keras.layers.Embedding`` (``row_paging_applies`` is True).
        pool: the engine's pool.
        num_shards: N, replicas.
        config: the active ZeroConfig (``offload_param``, ``offload_optimizer``).
        local_replicas: replica ids this process holds (default all; see
            :class:`RowPagedTable`).
        gather_remote: the cross-worker shard gather (required with a subset).

    Attributes:
        layer: the layer; its ``embeddings`` is replaced by :attr:`table` by the engine.
        table: the :class:`RowPagedTable`.
        last_rows: per replica, the :class:`RowStats` of its last forward.
        updated_rows: per replica, rows updated by the last :meth:`apply_update`.
    """

    def __init__(
        self,
        layer: keras.layers.Layer,
        pool: PagedBufferPool,
        num_shards: int,
        config: ZeroConfig,
        local_replicas: tuple[int, ...] | None = None,
        gather_remote=None,
    ) -> None:
        old = layer.embeddings
        self.layer = layer
        self.pool = pool
        self.num_shards = num_shards
        self.table = RowPagedTable(
            # A deferred table (strategy.zero_init) is initialized here, on the host.
            np.asarray(construction.consume(old), np.float32),
            pool=pool,
            num_shards=num_shards,
            tier=PARAM_TIER[config.offload_param],
            name=old.name,
            path=old.path,
            local_replicas=local_replicas,
            gather_remote=gather_remote,
        )
        state_tier = STATE_TIER[config.offload_optimizer]
        self.state_tier = "host" if state_tier == "nvme" and pool.nvme_file is None else state_tier
        self.last_rows = [RowStats() for _ in range(num_shards)]
        self.updated_rows = [0] * num_shards
        self._pending: dict[int, tuple[tf.Tensor, tf.Tensor]] = {}  # trace time: U, grad
        self._allocated: set[str] = set()  # optimizer-state page ids allocated so far
        self._alloc_lock = threading.Lock()

    # -- graph side (replica context) ------------------------------------------------------
    def use(self, x, anchor, replica: int):
        """One use of the table in a units-path step (the model's own call): the layer's
        output for this replica's ids ``x`` (int, any shape ``S``), float32 ``S + (C,)``.

        ``anchor`` is the table's gradient anchor in the step (a float32 scalar zero,
        :mod:`zero_runtime.stage3.gather`): its gradient is the touched rows' summed
        gradient, float32 ``(K, C)``, identical on every replica (the all-reduce of step
        2 in the module docstring), which a tape returns for the table
        (``tape.gradient(loss, model.trainable_variables)``) and :meth:`apply_update`
        takes; the rows ``U`` it belongs to are kept for :meth:`apply_update`.
        """

        @tf.custom_gradient
        def run(x, anchor):
            y, uniq, inv_local = self._lookup(x, replica)
            self._pending[replica] = (uniq, None)

            def grad(dy):
                return None, self._row_gradient(dy, uniq, inv_local)

            return y, grad

        return run(x, anchor)

    def keep_gradient(self, replica: int, grad: tf.Tensor) -> None:
        """Keep ``grad``, the gradient of the table's anchor in this replica's step (the
        touched rows' float32 ``(K, C)``, or a scalar zero when the lookup did not reach
        the loss), for :meth:`apply_update`; nothing when the step did not look up."""
        pending = self._pending.get(replica)
        if pending is not None:
            self._pending[replica] = (pending[0], grad)

    def discard(self, replica: int) -> None:
        """Forget what an earlier trace kept for ``replica`` (a step begins)."""
        self._pending.pop(replica, None)

    def _row_gradient(self, dy, uniq, inv_local) -> tf.Tensor:
        """The touched rows' gradient, float32 ``(K, C)``: ``dy`` (``S + (C,)``) summed
        per row of ``U`` (``unsorted_segment_sum``, the accumulation TensorFlow's
        densified ``IndexedSlices`` uses), all-reduced over the replicas."""
        width = self.table.row_elements
        dflat = tf.reshape(tf.cast(dy, tf.float32), [-1, width])  # (L, C)
        k = tf.shape(uniq)[0]
        local = tf.math.unsorted_segment_sum(dflat, inv_local, k)  # (K, C)
        return comm.all_reduce_sum_flat(local)  # (K, C), same on every replica

    def forward(self, x, replica: int):
        """Output without gradient (inference through the engine), float32 ``S + (C,)``."""
        return self._lookup(x, replica)[0]

    def _lookup(self, x, replica: int):
        ids = tf.reshape(tf.cast(x, tf.int32), [-1])  # (L,)
        all_ids = comm.all_gather_flat(ids)  # (N * L,), replica order
        uniq, inv, owned = host_function(
            functools.partial(self._fetch_rows, replica),
            [all_ids],
            [tf.int32, tf.int32, tf.float32],
            stateful=False,  # ordered by data only (see unit_comm's docstring)
            name="zero3_fetch_rows",
        )
        width = self.table.row_elements
        uniq.set_shape([None])
        inv.set_shape([None])
        owned.set_shape([None, width])
        rows = comm.all_reduce_sum_flat(owned)  # (K, C): every replica's rows of U
        n_local = tf.shape(ids)[0]
        inv_local = tf.slice(inv, [replica * n_local], [n_local])  # (L,)
        out = tf.gather(rows, inv_local)  # (L, C)
        out = tf.reshape(out, tf.concat([tf.shape(x), [width]], axis=0))
        out.set_shape(x.shape.concatenate([width]))  # S + (C,): static rank for Keras
        return out, uniq, inv_local

    def apply_update(self, optimizer, replica: int, grad=None) -> tf.Tensor | None:
        """Update this replica's own touched rows (after the backward of this step).

        Args:
            optimizer: the partitioned optimizer (``zero_runtime.optim`` Adam, AdamW,
                SGD): its learning rate (schedules at the step's iteration), its
                ``_zero_scalars`` and host kernel ``_zero_host_step``.
            replica: the replica id.
            grad: the touched rows' gradient, float32 ``(K, C)`` (the gradient of the
                table's anchor, :meth:`use`, possibly changed by a custom loop), or None
                (default): the one the step's backward kept. A scalar (the table did not
                reach the loss) updates nothing.

        Returns:
            An int64 scalar that exists once the rows are written, or None when the
            step's backward did not reach this table.

        Raises:
            NotImplementedError: gradient clipping (as at stage 3 generally).
            ValueError: ``grad`` not of shape ``(K, C)``.
        """
        pending = self._pending.pop(replica, None)
        if pending is None:
            return None
        uniq, kept = pending
        grad = kept if grad is None else tf.convert_to_tensor(grad)
        if grad is None or grad.shape.rank == 0:
            return None
        width = self.table.row_elements
        if grad.shape.rank != 2 or grad.shape[1] not in (None, width):
            raise ValueError(
                f"stage 3: the gradient of the row-paged table {self.table.path!r} has "
                f"shape {grad.shape}, not its touched rows' (K, {width}): pass the "
                "gradient tape.gradient returned inside the same step"
            )
        if optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue:
            raise NotImplementedError(
                f"stage 3: gradient clipping is not implemented for the row-paged "
                f"embedding table {self.table.path!r} (its touched rows are updated "
                "unclipped): raise embedding_row_paging_threshold above its "
                f"{math.prod(self.table.shape)} elements, or drop clipnorm / "
                "global_clipnorm / clipvalue"
            )
        lr = tf.cast(optimizer._zero_learning_rate(), tf.float32)  # noqa: SLF001
        scalars = optimizer._zero_scalars(lr)  # noqa: SLF001 (reads iterations before +1)
        decay = bool(optimizer.weight_decay) and optimizer._use_weight_decay(self.table)  # noqa: SLF001
        wd = tf.cast(optimizer.weight_decay if decay else 0.0, tf.float32)
        return host_function(
            functools.partial(self._update_rows, optimizer, replica),
            [uniq, grad, wd, lr, *scalars],
            tf.int64,
            stateful=True,
            name="zero3_update_rows",
        )

    # -- host side ---------------------------------------------------------------------------
    def _owned(self, replica: int, uniq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Positions in ``U`` of the replica's rows, their page and their row in it."""
        t = self.table
        valid = uniq >= 0
        pos = np.nonzero(valid & (uniq // t.rows == replica))[0]
        local = uniq[pos].astype(np.int64) - replica * t.rows  # row in the shard
        return pos, local // t.rows_per_page, local % t.rows_per_page

    def _fetch_rows(self, replica: int, all_ids: np.ndarray):
        """``(U padded to K with -1, inverse of all ids in U, own rows of U (K, C))``."""
        start = time.perf_counter()
        t = self.table
        flat = np.asarray(all_ids, np.int64).reshape(-1)  # (N * L,)
        vocab = t.shape[0]
        if flat.size and (flat.min() < 0 or flat.max() >= vocab):
            bad = flat[(flat < 0) | (flat >= vocab)][0]
            raise ValueError(f"embedding {t.path!r}: id {bad} is outside [0, {vocab})")
        uniq, inv = np.unique(flat, return_inverse=True)
        padded = np.full(flat.size, -1, np.int32)  # (K,)
        padded[: uniq.size] = uniq
        rows = np.zeros((flat.size, t.row_elements), np.float32)  # (K, C)
        pos, page, row = self._owned(replica, padded)
        pages = np.unique(page)
        for k in pages:
            pid = t.page_id(replica, int(k))
            data = self.pool.acquire(pid, "device")  # h2d (and n2h) when cold
            try:
                sel = page == k
                rows[pos[sel]] = np.asarray(data)[row[sel]]
            finally:
                self.pool.release(pid)  # unpinned; stays on the device until evicted (LRU)
        self.last_rows[replica] = RowStats(
            int(uniq.size), int(pos.size), int(pages.size), time.perf_counter() - start
        )
        return padded, inv.astype(np.int32).reshape(-1), rows

    def _update_rows(self, optimizer, replica: int, uniq, grad, wd, lr, *scalars) -> np.int64:
        t = self.table
        pos, page, row = self._owned(replica, np.asarray(uniq))
        slots = tuple(optimizer._zero_slots)  # noqa: SLF001
        pages = np.unique(page)
        data = {}  # page -> (param rows page, {slot: state page})
        parts, states = [], {s: [] for s in slots}
        for k in pages:
            k = int(k)
            sel = row[page == k]
            param = self.pool.read(t.page_id(replica, k))  # (rows, C), where it is
            st = {s: self._state_page(replica, k, s) for s in slots}
            data[k] = (param, st)
            parts.append(param[sel])
            for s in slots:
                states[s].append(st[s][sel])
        n = int(pos.size)
        width = t.row_elements
        p = np.concatenate(parts).reshape(-1) if parts else np.zeros(0, np.float32)  # (n*C,)
        # Rows in page order; the gradient rows in the same order.
        order = np.concatenate([pos[page == k] for k in pages]) if n else pos
        g = np.ascontiguousarray(np.asarray(grad, np.float32)[order]).reshape(-1)
        slot_arrays = {
            s: (np.concatenate(states[s]).reshape(-1) if n else np.zeros(0, np.float32))
            for s in slots
        }
        if n:
            wd, lr = np.float32(wd), np.float32(lr)
            if wd:
                p = p - p * wd * lr  # Keras: v - v * wd * lr, touched rows only (lazy)
            scratch = [np.empty_like(p), np.empty_like(p)]
            optimizer._zero_host_step(slot_arrays, scratch, p, g, scalars)  # noqa: SLF001
        off = 0
        for k in pages:
            k = int(k)
            sel = row[page == k]
            param, st = data[k]
            cnt = sel.size * width
            param[sel] = p[off : off + cnt].reshape(-1, width)
            self.pool.write(t.page_id(replica, k), param)
            for s in slots:
                st[s][sel] = slot_arrays[s][off : off + cnt].reshape(-1, width)
                self.pool.write(t.state_id(replica, k, s), st[s])
            off += cnt
        self.updated_rows[replica] = n
        return np.int64(n)

    def _state_page(self, replica: int, page: int, slot: str) -> np.ndarray:
        """The optimizer slot's rows of one row page (zeros when first touched)."""
        t = self.table
        sid = t.state_id(replica, page, slot)
        if sid not in self._allocated:
            with self._alloc_lock:
                if sid not in self._allocated:
                    shape = (t.page_rows(page), t.row_elements)  # (rows, C), zero-filled
                    self.pool.allocate(sid, shape, np.float32, "optimizer", self.state_tier)
                    self._allocated.add(sid)
        return self.pool.read(sid)

    def state_rows(self, slot: str) -> np.ndarray:
        """The optimizer slot over the whole table, float32 ``(V, C)`` (zeros for row
        pages never touched, and for other workers' replicas); for tests and
        checkpoints, outside a step."""
        t = self.table
        out = np.zeros((t.num_shards * t.rows, t.row_elements), np.float32)
        for r in t.local_replicas:
            for k in range(t.pages_per_shard):
                sid = t.state_id(r, k, slot)
                if sid in self._allocated:
                    start = r * t.rows + k * t.rows_per_page
                    out[start : start + t.page_rows(k)] = self.pool.read(sid)
        return out[: t.shape[0]]

    def touched_state_pages(self) -> int:
        """Optimizer-state pages allocated so far (row pages touched at least once x slots)."""
        return len(self._allocated)

    # -- row optimizer states by page (checkpoints: zero_runtime/checkpoint) ----------------
    def state_pages(self, replica: int) -> list[int]:
        """Row pages of ``replica``'s shard that have optimizer states (touched at least
        once), ascending; the other pages' states are zero and not allocated."""
        t = self.table
        with self._alloc_lock:
            allocated = set(self._allocated)
        prefixes = [(k, t.state_id(replica, k, "")) for k in range(t.pages_per_shard)]
        return [k for k, pre in prefixes if any(sid.startswith(pre) for sid in allocated)]

    def read_state_page(self, replica: int, page: int, slot: str) -> np.ndarray:
        """A copy of slot ``slot`` of row page ``page`` of ``replica``, float32
        ``(page_rows(page), C)``; zeros (nothing allocated) when the page has no states."""
        t = self.table
        sid = t.state_id(replica, page, slot)
        if sid not in self._allocated:
            return np.zeros((t.page_rows(page), t.row_elements), np.float32)
        return self.pool.read(sid)

    def write_state_page(self, replica: int, page: int, slot: str, rows: np.ndarray) -> None:
        """Set slot ``slot`` of row page ``page`` of ``replica`` to ``rows``, float32
        ``(page_rows(page), C)``, allocating the state page on :attr:`state_tier` first
        (outside a step).

        Raises:
            ValueError: ``rows`` of another shape.
        """
        self._state_page(replica, page, slot)  # allocates (zeroed) on first use
        self.pool.write(self.table.state_id(replica, page, slot), rows)

    def clear_states(self, replica: int) -> int:
        """Free every optimizer-state page of ``replica`` (its rows' states become zero,
        as before the first step); returns the pages freed. Outside a step."""
        prefix = self.table.state_id(replica, 0, "").rsplit("/p", 1)[0] + "/p"
        with self._alloc_lock:
            doomed = sorted(sid for sid in self._allocated if sid.startswith(prefix))
            for sid in doomed:
                self.pool.free(sid)
                self._allocated.discard(sid)
        return len(doomed)

    def placement_row(self) -> dict:
        """The table's row of ``memory_hierarchy/placement`` (docs/events.md).

        The fields of every placement row, plus (bytes are whole pages, as the tiers
        record counts them; this process's replicas only):

        - ``tier_bytes``: ``{"device", "host", "nvme"}`` bytes of its row pages per tier,
          by the pool's page table now (a page in flight counts on its source tier);
        - ``optimizer_tier_bytes``: the same for its row optimizer-state pages;
        - ``rows_touched``: unique ids of the last step (all replicas, ``|U|``);
          ``own_rows_touched``: those in this process's shards;
          ``pages_touched``: this process's row pages acquired by the last lookup;
        - ``row_pages``: this process's row pages; ``rows_per_page``.

        ``param_tier`` names the tiers holding any of its row pages, joined with '+';
        ``optimizer_tier`` is :attr:`state_tier` (where its row states are allocated).
        """
        t = self.table
        order = ("device", "host", "nvme")
        page = self.pool.page_size
        params = dict.fromkeys(order, 0)
        states = dict.fromkeys(order, 0)
        for r in t.local_replicas:
            for pid in t.page_ids(r):
                for info in self.pool.describe(pid).pages:
                    if info.tier:
                        params[info.tier] += page
        with self._alloc_lock:  # a copy: another replica's update may allocate meanwhile
            allocated = sorted(self._allocated)
        for sid in allocated:
            try:
                pages_of = self.pool.describe(sid).pages
            except KeyError:  # freed since (clear_states)
                continue
            for info in pages_of:
                if info.tier:
                    states[info.tier] += page
        stats = [self.last_rows[r] for r in t.local_replicas]
        rows, pages = stats[0].unique_rows, sum(s.pages for s in stats)
        text = (
            f"row-paged 1/{t.num_shards} along dim 0: {t.pages_per_shard} pages of "
            f"{t.rows_per_page} rows per shard (ZeRO-3 hot/cold rows); last step "
            f"{rows} rows, {pages} pages touched"
        )
        return {
            "name": t.path,
            "shape": list(t.shape),
            "dtype": "float32",
            "bytes": 4 * math.prod(t.shape),
            "partitioning": text,
            "shard_bytes_per_replica": 4 * t.shard_elements,
            "param_tier": "+".join(k for k in order if params[k]) or t.tier,
            "grad_tier": "device",
            "optimizer_tier": self.state_tier,
            "row_paged": True,
            "tier_bytes": params,
            "optimizer_tier_bytes": states,
            "rows_touched": rows,
            "own_rows_touched": sum(s.owned_rows for s in stats),
            "pages_touched": pages,
            "row_pages": len(t.local_replicas) * t.pages_per_shard,
            "rows_per_page": t.rows_per_page,
        }
