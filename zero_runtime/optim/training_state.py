"""What a checkpoint holds for one model + optimizer under a strategy: the training state.

:class:`TrainingState` enumerates, in a fixed order, the tensors of
:mod:`zero_runtime.checkpoint.index` for a live model and tells, for each local replica,
its shard of the parameters and of every optimizer slot:

- ``params``: the trainable variables in the optimizer's layout order. Under stages 1-2
  they are replicated (``MirroredVariable``), and each replica saves the piece of the
  flat parameter buffer that its optimizer shard updates (the same partition as the
  states). At stage 3 they are :class:`~zero_runtime.sharded_variable.ShardedVariable`
  and each replica saves its row shard.
- ``slots``: the partitioned optimizer's per-element states (e.g. Adam's ``momentum``,
  ``velocity``), one shard per replica on the device, host or NVMe tier.
- ``tables``: stage-3 row-paged embedding tables (``zero_runtime.stage3.embedding``).
  They are parameters like the others but outside the optimizer's flat layout: each
  replica saves its rows, and its *lazy* optimizer states only for the row pages that
  have them (:meth:`RowPagedEmbedding.state_pages`); the rest are zero.
- ``replicated``: model variables outside the layout (non-trainable weights) and the
  Keras optimizer variables (``iterations``: the step counter; the learning rate; the
  stock optimizer's slots when it runs unpartitioned). The chief saves these whole.

Restore matches tensors by position within each group and checks every shape, so a
checkpoint restores onto the same architecture built in another process (Keras's
auto-generated layer names may differ between processes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np

from zero_runtime.optim.layout import FlatLayout, layout_from_sharded
from zero_runtime.sharded_variable import ShardedVariable


@dataclasses.dataclass
class TrainingState:
    """The checkpointable state of one model and its optimizer under a strategy.

    Attributes:
        model: the Keras model (a ``ShardedModel`` at stage 3).
        optimizer: its optimizer (built), or None for a model without one.
        strategy: the ``tf.distribute`` strategy (a ZeroInfinityStrategy, or any).
        params: trainable variables in the optimizer's order (row-paged tables included).
        dense: positions in ``params`` of the variables the flat layout covers, in layout
            order (all of them unless there are row-paged tables).
        tables: position in ``params`` -> its
            :class:`~zero_runtime.stage3.embedding.RowPagedEmbedding` (stage 3).
        layout: the flat layout the shards follow (``num_shards`` = replicas in sync).
        kind: 'flat' (stages 0-2) or 'rows' (stage 3 ShardedVariables).
        store: the optimizer-state store, or None (unpartitioned optimizer).
        slots: the store's slot names (empty without a store).
        replicated: ``(name, variable)`` of the tensors the chief saves whole.
        local_replicas: this worker's global replica ids, local index order.
        rank: this worker's rank (0 in one process).
        num_workers: worker processes in the job (1 in one process).
    """

    model: Any
    optimizer: Any
    strategy: Any
    params: list
    dense: tuple[int, ...]
    tables: dict[int, Any]
    layout: FlatLayout
    kind: str
    store: Any
    slots: tuple[str, ...]
    replicated: list[tuple[str, Any]]
    local_replicas: tuple[int, ...]
    rank: int
    num_workers: int

    @classmethod
    def of(cls, model: keras.Model, optimizer: Any, strategy: Any) -> TrainingState:
        """Describe ``model``'s state, building ``optimizer`` first if needed.

        An uncommitted optimizer step (one that raised: NVMe step transactions,
        ``zero_runtime.optim.transaction``) is resolved first, so a checkpoint never holds
        a half-applied step.

        Args:
            model: a built Keras model (or ``ShardedModel``).
            optimizer: its optimizer, or None.
            strategy: the strategy the model was created under.

        Raises:
            ValueError: the model is not built, or two parameters share a path.
        """
        if not getattr(model, "inner", model).built:
            raise ValueError(f"model {model.name!r} must be built before checkpointing")
        if optimizer is not None and not optimizer.built:
            with strategy.scope():
                optimizer.build(model.trainable_variables)
        zero = getattr(optimizer, "_zero", None) if optimizer is not None else None
        settle = getattr(optimizer, "zero_settle", None)
        if zero is not None and settle is not None:
            settle()  # a failed step is rolled back before anything is read or written
        n = strategy.num_replicas_in_sync
        params = list(
            optimizer._trainable_variables if zero is not None else model.trainable_variables
        )
        row_paged = {id(e.table): e for e in _row_paged_embeddings(model)}
        tables = {i: row_paged[id(v)] for i, v in enumerate(params) if id(v) in row_paged}
        dense = tuple(i for i in range(len(params)) if i not in tables)
        if zero is not None:
            layout, store, slots = zero.layout, zero.store, tuple(zero.store.slot_names)
        else:
            store, slots = None, ()
            covered = [params[i] for i in dense]
            if covered and all(isinstance(v, ShardedVariable) for v in covered):
                layout = layout_from_sharded(covered, n)
            else:
                layout = FlatLayout.from_variables(covered, n)
        if len(layout.sizes) != len(dense):
            raise ValueError(
                f"the optimizer's layout has {len(layout.sizes)} tensors, the model "
                f"{len(dense)} densely updated parameters"
            )
        kind = "rows" if params and all(isinstance(v, ShardedVariable) for v in params) else "flat"
        in_layout = {id(_unwrap(v)) for v in params}
        replicated = []
        others = [v for v in model.trainable_variables if id(_unwrap(v)) not in in_layout]
        for j, v in enumerate(others + list(model.non_trainable_variables)):
            replicated.append((f"model_var/{j}", v))
        if optimizer is not None:
            for j, v in enumerate(optimizer.variables):
                replicated.append((f"optimizer_var/{j}", v))
        cluster = getattr(strategy, "cluster", None)
        rank = cluster.rank if cluster is not None else 0
        num_workers = cluster.num_workers if cluster is not None else 1
        local_n = len(strategy.extended.worker_devices)
        local = tuple(rank * local_n + i for i in range(local_n))
        return cls(
            model,
            optimizer,
            strategy,
            params,
            dense,
            tables,
            layout,
            kind,
            store,
            slots,
            replicated,
            local,
            rank,
            num_workers,
        )

    # -- geometry ------------------------------------------------------------------------
    @property
    def sizes(self) -> list[int]:
        """True element counts of the layout's parameters, layout order."""
        return [math.prod(tuple(self.params[i].shape)) for i in self.dense]

    def shard_dim(self, i: int) -> int:
        """The canonical-order axis of parameter ``i`` (0 unless a ShardedVariable says)."""
        return int(getattr(self.params[i], "shard_dim", 0)) if self.kind == "rows" else 0

    def moved_flat(self, i: int, value: np.ndarray) -> np.ndarray:
        """Parameter ``i``'s (position in ``params``) logical value in canonical (moved,
        C) order, 1-D."""
        value = np.asarray(value)
        if value.ndim == 0:
            return value.reshape(1)
        return np.ascontiguousarray(np.moveaxis(value, self.shard_dim(i), 0)).reshape(-1)

    # -- shards --------------------------------------------------------------------------
    def param_shard(self, replica: int, local: int) -> np.ndarray:
        """``replica``'s parameter shard, float32 ``[layout.shard_size]``."""
        from zero_runtime.optim.partition import build_shard

        if self.kind == "rows":
            parts = [self.params[i].read_shard(replica) for i in self.dense]
            if not parts:
                return np.zeros(0, np.float32)
            return np.concatenate(parts).astype(np.float32, copy=False)
        flats = {
            j: self.moved_flat(i, np.asarray(_local_value(self.params[i], local), np.float32))
            for j, i in enumerate(self.dense)
        }
        return build_shard(self.layout, replica, flats, self.sizes)

    @property
    def model_config(self) -> dict[str, Any] | None:
        """The Keras serialisation of the model's architecture (the wrapped model at stage
        3; without its compile config), or None when the model cannot be serialised (a
        subclassed model without ``get_config``)."""
        inner = getattr(self.model, "inner", self.model)
        try:
            config = keras.saving.serialize_keras_object(inner)
        except Exception:  # noqa: BLE001 - export then needs the model passed in
            return None
        config.pop("compile_config", None)  # the architecture only: no (partitioned) optimizer
        return config


def _row_paged_embeddings(model) -> list:
    """The stage-3 engine's row-paged embeddings of ``model`` (a ShardedModel), else []."""
    engine = getattr(model, "engine", None)
    return list(getattr(engine, "row_paged", {}).values())


def _unwrap(v):
    return v.value if isinstance(v, keras.Variable) and not isinstance(v, ShardedVariable) else v


def _local_value(variable, local: int):
    """The value of a (mirrored) variable as replica ``local`` of this worker sees it."""
    inner = _unwrap(variable)
    values = getattr(inner, "values", None)
    if values is not None and len(values) > local:
        return values[local].numpy()
    return variable.numpy()
