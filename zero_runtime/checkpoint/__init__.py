"""Sharded checkpoints: atomic save, restore onto any number of replicas, export.

Public API::

    from zero_runtime.checkpoint import CheckpointManager, ZeroBackupAndRestore, export

    manager = CheckpointManager("ckpt", model, strategy, max_to_keep=3)
    manager.save(client_state={"epoch": 1})     # every worker: its own shards
    manager.restore()                           # latest; any replica count
    export("ckpt", "model.keras")               # consolidated, plain Keras

``strategy.save_checkpoint(dir, model)`` / ``strategy.load_checkpoint(dir, model)`` are
the same through the strategy. Modules: :mod:`.index` (the JSON schema), :mod:`.state`
(what is saved), :mod:`.partition` (shards <-> tensors), :mod:`.tables` (row-paged
embedding tables and their lazy states), :mod:`.coordination` (workers agree),
:mod:`.writer` (atomic save), :mod:`.reader` (verify, re-partition, restore),
:mod:`.export`, :mod:`.manager`, :mod:`.callback`.
See docs/checkpoint.md.
"""

from zero_runtime.checkpoint.callback import ZeroBackupAndRestore
from zero_runtime.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from zero_runtime.checkpoint.export import consolidated_model, export
from zero_runtime.checkpoint.index import CheckpointIndex, read_index
from zero_runtime.checkpoint.manager import CheckpointManager
from zero_runtime.checkpoint.reader import CheckpointReader, RestoreResult, resolve
from zero_runtime.checkpoint.writer import SaveResult, list_checkpoints

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointWriteError",
    "RestoreResult",
    "SaveResult",
    "ZeroBackupAndRestore",
    "consolidated_model",
    "export",
    "list_checkpoints",
    "read_index",
    "resolve",
]
