"""Replica-context helpers of the partitioned optimizer (used while a step is traced)."""

from __future__ import annotations

import keras
import tensorflow as tf


def unwrap(v):
    """The backend variable of a Keras variable (``v`` itself otherwise)."""
    return v.value if isinstance(v, keras.Variable) else v


def local_copy(variable):
    """This replica's component of a mirrored variable (the variable itself otherwise)."""
    get = getattr(variable, "_get_on_device_or_primary", None)
    return get() if get is not None else variable


def local_replicas(strategy, n_local: int) -> range:
    """The global ids of this process's replicas: ``rank * n_local + i`` (rank 0 in one
    process), as the checkpoint's ``local`` (zero_runtime/optim/training_state.py).

    Args:
        strategy: the optimizer's strategy (its ``cluster`` gives the rank, if any).
        n_local: replicas in this process.
    """
    cluster = getattr(strategy, "cluster", None)
    rank = cluster.rank if cluster is not None else 0
    return range(rank * n_local, (rank + 1) * n_local)


def replica_id() -> int:
    """The static replica id of the current replica context.

    Raises:
        RuntimeError: the id is not static (the optimizer needs one per traced replica).
    """
    ctx = tf.distribute.get_replica_context()
    rid = tf.get_static_value(ctx.replica_id_in_sync_group)
    if rid is None:
        raise RuntimeError("the partitioned optimizer needs a static replica id")
    return int(rid)
