"""ZeroBackupAndRestore: Keras ``BackupAndRestore`` on sharded checkpoints, resuming at the
saved step (mid-epoch) with the batches that followed it, and saving on preemption.

Contract of ``keras.callbacks.BackupAndRestore`` (keras/src/callbacks/backup_and_restore.py):
at the start of ``fit`` the newest backup, if any, is restored (weights, optimizer states,
step counter) and the completed epochs are skipped (``model._initial_epoch``, as Keras's
callback sets it); a backup is saved at the end of every epoch (``save_freq='epoch'``) or
every N batches; after ``fit`` completes the backups are deleted unless
``delete_checkpoint=False``.

Two differences from Keras's callback:

- a batch-level backup resumes **at its batch**, not at the start of its epoch (Keras
  redoes the interrupted epoch): the strategy's next training iterator starts after the
  batches already trained (:mod:`zero_runtime.checkpoint.data_resume`), so the same
  batches follow as in an uninterrupted run;
- SIGTERM to any worker (:mod:`zero_runtime.preemption`) makes every worker back up at
  the next step boundary they agree on, then exit 42 (restartable).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import keras

from zero_runtime import preemption, progress
from zero_runtime.checkpoint import data_resume
from zero_runtime.checkpoint import reader as rd
from zero_runtime.checkpoint.manager import CheckpointManager

#: Keras's note when an epoch's iterator ends before its step count (epoch_iterator.py);
#: expected once in the epoch a backup resumes mid-way, so silenced there.
_RAN_OUT = "Your input ran out of data"


class ZeroBackupAndRestore(keras.callbacks.Callback):
    """Back up and restore the training state with sharded checkpoints.

    Args:
        backup_dir: the backup root (the same on every worker); used by this callback only.
        save_freq: ``'epoch'`` (default) or an int N >= 1: back up after every step whose
            count since the job's first step is a multiple of N. With gradient
            accumulation (``ZeroConfig.gradient_accumulation_steps`` = A) the steps are
            optimizer steps (A batches each): backups and a preemption's agreed step fall
            on optimizer-step boundaries only, so a backup holds no partial gradient sum
            and a job resized by ``zero-runtime launch --min-nproc`` (another A) resumes
            at the same example (:mod:`zero_runtime.elastic`).
        delete_checkpoint: delete the backups (published checkpoints, ``latest``,
            temporary directories; the directory itself when nothing else is in it) when
            ``fit`` ends normally (default True).
        max_to_keep: backups kept (default 1, as Keras keeps one; 2 is Keras's
            ``double_checkpoint``).
        strategy: the strategy; default the model's at ``fit`` start.

    Attributes:
        restored_epoch: the epoch ``fit`` resumed in (0 without a backup).
        restored_batch: batches of that epoch the backup had trained (0: at its start).
        steps: batches trained since the job's first step (restored, then counted).

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
        self._batch = 0  # batches of the current epoch trained
        self._last_begin = 0
        self._k = 0  # batches the current data iterator gave
        self._iterators = 0  # data iterators counted so far (DataResume.iterators)
        self._per_epoch: int | None = None
        self._stop_at: int | None = None
        self._plan: data_resume.DataResume | None = None
        self._quiet: warnings.catch_warnings | None = None
        self._watcher: preemption.PreemptionWatcher | None = None
        self._accumulation = 1  # the strategy's gradient_accumulation_steps
        self.restored_epoch = 0
        self.restored_batch = 0
        self.steps = 0

    def _mgr(self) -> CheckpointManager:
        if self._manager is None:
            strategy = self._strategy or getattr(self.model, "distribute_strategy", None)
            self._manager = CheckpointManager(
                self.backup_dir, self.model, strategy, max_to_keep=self.max_to_keep
            )
        return self._manager

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Restore the newest backup: skip its completed epochs and, for a mid-epoch
        backup, start the data after its batches; take SIGTERM (preemption). A backup
        taken at another gradient accumulation (a resized job) continues at the same
        example (:meth:`_rescaled`). Tells ``zero-runtime launch`` where training resumed
        (:meth:`~zero_runtime.preemption.PreemptionWatcher.resumed`).

        Raises:
            zero_runtime.checkpoint.CheckpointError: a damaged backup or one of another
                model (nothing is changed).
            TypeError: a mid-epoch backup under a strategy that cannot move its data on
                (not a ``ZeroInfinityStrategy``).
            ValueError: a backup of another gradient accumulation whose position or
                global batch does not convert (:meth:`_rescaled`).
        """
        manager = self._mgr()
        self._watcher = manager.preemption_watcher()
        self._plan = getattr(manager.strategy, "data_resume", None)
        self._per_epoch = self.params.get("steps") if self.params else None
        self.restored_epoch = self.restored_batch = self.steps = 0
        self._batch = self._k = self._iterators = 0
        self._stop_at = None
        self._accumulation = rd.accumulation_of(manager.strategy)
        result = state = None
        if manager.latest is not None:  # the position is checked before anything changes
            index = rd.CheckpointReader(rd.resolve(manager.directory, None)).index
            state = self._rescaled(dict(index.client_state), index.tag)
            result = manager.restore()
        position = None
        if result is not None:
            per = self._per_epoch
            self.restored_epoch = self._epoch = int(state.get("epoch", 0))
            self.restored_batch = self._batch = int(state.get("batch", 0))
            fallback = self.restored_epoch * per if per else result.step
            self.steps = int(state.get("steps", fallback + self.restored_batch))
            self._k = int(state.get("iterator_batches", self.restored_batch))
            self.model._initial_epoch = self.restored_epoch  # as keras BackupAndRestore
            if self._k or self.restored_batch:
                position = data_resume.Position(self._k, self.restored_batch, per)
                self._iterators = 1  # the first iterator is the resumed one
                if per and self.params.get("epochs"):
                    self._stop_at = int(self.params["epochs"]) * per
        progress.report(self.steps // self._accumulation, resumed=True, rank=self._watcher.rank)
        if self._plan is not None:
            self._plan.watch(position)
        elif self.restored_batch:
            raise TypeError(
                f"backup {result.tag!r} was taken at batch {self.restored_batch} of epoch "
                f"{self.restored_epoch}; continuing its data needs a ZeroInfinityStrategy "
                f"(got {type(manager.strategy).__name__})"
            )

    def _rescaled(self, state: dict, tag: str) -> dict:
        """The backup's position in batches of this run: a backup taken at gradient
        accumulation N (``state["accumulation"]``) restored at N' counts its batches x
        N'/N (the same examples: the global batch per optimizer step is kept across world
        sizes, :mod:`zero_runtime.elastic`).

        Raises:
            ValueError: the position is not a whole number of this run's batches, or the
                batches per epoch do not scale with the accumulation (the global batch
                changed between the runs); the message names the numbers.
        """
        before = int(state.get("accumulation", self._accumulation))
        now = self._accumulation
        if before == now:
            return state
        scaled = dict(state)
        for key in ("batch", "steps", "iterator_batches"):
            if key in state:
                value = int(state[key]) * now
                if value % before:
                    raise ValueError(
                        f"backup {tag!r} was taken at {key}={state[key]} with "
                        f"gradient_accumulation_steps={before}, not at an optimizer-step "
                        f"boundary: it cannot continue with gradient_accumulation_steps={now}"
                    )
                scaled[key] = value // before
        per_before, per = state.get("per_epoch"), self._per_epoch
        if per_before and per and per * before != int(per_before) * now:
            raise ValueError(
                f"backup {tag!r} had {per_before} batches per epoch at "
                f"gradient_accumulation_steps={before}; this fit has {per} at {now}: the "
                "global batch (fit's batch_size x gradient_accumulation_steps) must stay "
                "the same across a resize (zero_runtime.elastic.batch_plan)"
            )
        return scaled

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Track the epoch; in the epoch resumed mid-way, silence Keras's note that its
        (shorter) iterator ran out."""
        self._epoch = epoch
        if epoch == self.restored_epoch and self.restored_batch and self._batch:
            self._quiet = warnings.catch_warnings()
            self._quiet.__enter__()
            warnings.filterwarnings("ignore", message=_RAN_OUT)
        else:
            self._batch = 0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Note the first batch of this call (several with ``steps_per_execution``)."""
        self._last_begin = batch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Count the batches; back up at a preemption's agreed step (then exit 42) and
        every ``save_freq`` steps; after a resume on an endless dataset, stop ``fit``
        after the run's total steps."""
        done = batch - self._last_begin + 1
        before = self.steps
        if self._plan is not None and not self._plan.iterators:
            self._not_ours()  # fit's data did not come through the strategy
        if self._plan is not None and self._plan.iterators != self._iterators:
            self._iterators, self._k = self._plan.iterators, 0  # Keras made a new iterator
        elif self._plan is not None and self._plan.started_over:
            self._plan.started_over, self._k = False, 0  # resumed at an epoch's start
        self._k += done
        self._batch += done
        self.steps += done
        a = self._accumulation  # saves and the preemption at optimizer-step boundaries only
        if not self.steps % a and self._watcher is not None:  # (no partial gradient sum)
            progress.report(self.steps // a, rank=self._watcher.rank)  # launch's goodput
            if self._watcher.boundary(self.steps // a):
                saved = self._save()
                close = getattr(self._mgr().strategy, "close", None)
                if close is not None:
                    close()  # flush the summaries, remove the NVMe files
                self._watcher.exit(f"saved {saved.path} at step {self.steps // a}")
        if (
            self.save_freq != "epoch"
            and not self.steps % a
            and self.steps // a // self.save_freq > before // a // self.save_freq
        ):
            self._save()
        if self._stop_at is not None and self.steps >= self._stop_at:
            self.model.stop_training = True

    def _not_ours(self) -> None:
        """``fit``'s training data was distributed before ``fit`` (a ``DistributedDataset``
        was passed): its position cannot be tracked, nor continued after a mid-epoch
        backup.

        Raises:
            NotImplementedError: this ``fit`` resumes a mid-epoch backup.
        """
        self._plan.clear()
        self._plan = None
        if self.restored_batch:
            raise NotImplementedError(
                f"resuming fit at batch {self.restored_batch} of epoch {self.restored_epoch}: "
                "its data was distributed before fit (a DistributedDataset), so the batches "
                "after the backup cannot be chosen: pass the tf.data.Dataset (or arrays) to "
                "fit and let the strategy distribute it"
            )

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Back up after the epoch (``save_freq='epoch'``)."""
        self._loud()
        self._epoch, self._batch = epoch + 1, 0
        if self.save_freq == "epoch":
            self._save()

    def _save(self):
        """Back up with the position: ``epoch`` and ``batch`` (batches of it trained),
        ``steps`` (since the job's first step), ``iterator_batches`` (batches the
        current data iterator gave; 0 when Keras made a new one since the last batch),
        ``accumulation`` (the strategy's ``gradient_accumulation_steps``: a restore at
        another one converts the batch counts, :meth:`_rescaled`) and ``per_epoch``
        (Keras's steps per epoch, or None)."""
        if self._per_epoch:
            epoch, batch = divmod(self.steps, self._per_epoch)
        else:
            epoch, batch = self._epoch, self._batch
        if self._plan is None:  # not tracked: a new iterator per epoch assumed
            position = batch
        else:
            position = 0 if self._plan.iterators != self._iterators else self._k
        state = {"epoch": epoch, "batch": batch, "steps": self.steps, "iterator_batches": position}
        state.update(accumulation=self._accumulation, per_epoch=self._per_epoch)
        return self._mgr().save(client_state=state)

    def _loud(self) -> None:
        if self._quiet is not None:
            self._quiet.__exit__(None, None, None)
            self._quiet = None

    def on_train_end(self, logs: dict | None = None) -> None:
        """Delete the backups after a completed ``fit`` (unless told not to).

        Also clears the ``model._initial_epoch`` set at restore (Keras's own callback
        leaves it set, so a later ``fit`` of the same model would silently skip epochs)
        and the strategy's data position.
        """
        self._loud()
        manager = self._mgr()
        if self._watcher is not None:
            self._watcher.uninstall()  # SIGTERM back to what it was before fit
        if self._plan is not None:
            self._plan.clear()
        if self.restored_epoch or self.restored_batch:
            self.model._initial_epoch = None
        if self.delete_checkpoint and os.path.isdir(self.backup_dir):
            cluster = getattr(manager.strategy, "cluster", None)
            if cluster is None or cluster.is_chief:
                delete_checkpoints(self.backup_dir)


def delete_checkpoints(root: str) -> None:
    """Remove every checkpoint under ``root``: published tags, ``latest``, temporary
    ``.tmp-*`` directories; then ``root`` itself when nothing else is left in it (a
    launcher's ``restarts.jsonl`` stays)."""
    for name in rd.published_tags(root):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for name in os.listdir(root):
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    latest = os.path.join(root, "latest")
    if os.path.exists(latest):
        os.remove(latest)
    try:
        os.rmdir(root)
    except OSError:
        pass  # other files remain
