"""ZeroBackupAndRestore: Keras ``BackupAndRestore`` semantics on sharded checkpoints.

Same contract as ``keras.callbacks.BackupAndRestore`` (keras/src/callbacks/
backup_and_restore.py): at the start of ``fit`` the newest backup, if any, is restored
(weights, optimizer states, step counter) and the completed epochs are skipped
(``model._initial_epoch``, as Keras's callback sets it); a backup is saved at the end of
every epoch (``save_freq='epoch'``) or every N batches; after ``fit`` completes the
backup directory is deleted unless ``delete_checkpoint=False``. As in Keras, a batch-level
backup resumes at the start of the epoch it was taken in (the epoch counts as not done).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import keras

from zero_runtime.checkpoint.manager import CheckpointManager


class ZeroBackupAndRestore(keras.callbacks.Callback):
    """Back up and restore the training state with sharded checkpoints.

    Args:
        backup_dir: the backup root (the same on every worker); used by this callback only.
        save_freq: ``'epoch'`` (default) or an int N >= 1: back up every N batches.
        delete_checkpoint: delete ``backup_dir`` when ``fit`` ends normally (default True).
        max_to_keep: backups kept (default 1, as Keras keeps one; 2 is Keras's
            ``double_checkpoint``).
        strategy: the strategy; default the current one at ``fit`` start.

    Raises:
        ValueError: empty ``backup_dir`` or a bad ``save_freq``.
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        max_to_keep: int = 1,
        strategy: Any = None,
    ) -> None:
        super().__init__()
        if not backup_dir:
            raise ValueError("Empty `backup_dir` argument passed")
        if save_freq != "epoch" and (
            not isinstance(save_freq, int) or isinstance(save_freq, bool) or save_freq < 1
        ):
            raise ValueError(f"save_freq must be 'epoch' or an int >= 1, got {save_freq!r}")
        self.backup_dir = backup_dir
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.max_to_keep = max_to_keep
        self._strategy = strategy
        self._manager: CheckpointManager | None = None
        self._epoch = 0
        self._batches_since_save = 0
        #: the epoch fit resumed from (0 without a backup).
        self.restored_epoch = 0

    def _mgr(self) -> CheckpointManager:
        if self._manager is None:
            strategy = self._strategy or getattr(self.model, "distribute_strategy", None)
            self._manager = CheckpointManager(
                self.backup_dir, self.model, strategy, max_to_keep=self.max_to_keep
            )
        return self._manager

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Restore the newest backup and skip the epochs it completed."""
        manager = self._mgr()
        self.restored_epoch = 0
        if manager.latest is None:
            return
        result = manager.restore()
        self.restored_epoch = int(result.client_state.get("epoch", 0))
        self._epoch = self.restored_epoch
        self.model._initial_epoch = self.restored_epoch  # as keras BackupAndRestore

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Track the epoch a batch-level backup belongs to."""
        self._epoch = epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Back up after the epoch (``save_freq='epoch'``)."""
        self._epoch = epoch + 1
        if self.save_freq == "epoch":
            self._save()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Back up every ``save_freq`` batches (int ``save_freq``)."""
        if self.save_freq == "epoch":
            return
        self._batches_since_save += 1
        if self._batches_since_save >= self.save_freq:
            self._batches_since_save = 0
            self._save()

    def _save(self) -> None:
        self._mgr().save(client_state={"epoch": self._epoch})

    def on_train_end(self, logs: dict | None = None) -> None:
        """Delete the backups after a completed ``fit`` (unless told not to).

        Also clears the ``model._initial_epoch`` set at restore (Keras's own callback
        leaves it set, so a later ``fit`` of the same model would silently skip epochs).
        """
        if self.restored_epoch and self.model is not None:
            self.model._initial_epoch = None
        if self.delete_checkpoint and os.path.isdir(self.backup_dir):
            cluster = getattr(self._mgr().strategy, "cluster", None)
            if cluster is None or cluster.is_chief:
                shutil.rmtree(self.backup_dir, ignore_errors=True)
