"""CheckpointManager: save and restore one model's sharded checkpoints under a root.

DeepSpeed's vocabulary: checkpoints are tags under a root directory, ``latest`` names
the newest, ``save`` takes an optional tag and client state, ``restore`` (DeepSpeed's
``load_checkpoint``) takes an optional tag and returns the client state::

    manager = CheckpointManager("ckpt", model, strategy, max_to_keep=3)
    manager.save(client_state={"epoch": 3})          # every worker calls it
    ...
    info = manager.restore()                         # after model + optimizer are built
"""

from __future__ import annotations

import os
from typing import Any

import tensorflow as tf

from zero_runtime import preemption, progress
from zero_runtime.checkpoint import reader as rd
from zero_runtime.checkpoint import writer as wr
from zero_runtime.optim.training_state import TrainingState


class CheckpointManager:
    """Sharded checkpoints of ``model`` (and its optimizer) under ``directory``.

    Args:
        directory: the checkpoint root (created at the first save); the same path on
            every worker (a shared file system across hosts).
        model: the built Keras model (a ``ShardedModel`` at stage 3).
        strategy: the strategy the model was created under; default: the current one.
        optimizer: the optimizer; default ``model.optimizer``, or for an uncompiled model
            (a custom loop) the partitioned optimizer built over its variables
            (:attr:`optimizer`); None when there is neither: parameters only.
        max_to_keep: published checkpoints kept, int >= 1 or None for all (default 3).
        timeout_seconds: bound on waits for other workers during a save, seconds;
            default the strategy's ``collective_timeout_seconds`` (60 s without one).
        save_every: :meth:`after_step` saves after every step count that is a multiple
            of this, int >= 1; None (default): only on preemption.

    Attributes:
        last_save: the last :class:`~zero_runtime.checkpoint.writer.SaveResult` (bytes
            written, seconds), or None.
        last_restore: the last :class:`~zero_runtime.checkpoint.reader.RestoreResult`.

    A custom loop that survives restarts and preemption (every worker runs it)::

        manager = CheckpointManager("ckpt", model, strategy, save_every=100)
        start = manager.restore_or_initialize()  # 0, or the step of `latest`
        for step in range(start, total_steps):
            train_step(batches[step])  # the data from `start` on: e.g. dataset.skip(start)
            manager.after_step(step + 1)  # saves every 100; on SIGTERM: saves, exits 42

    Raises:
        ValueError: ``max_to_keep`` or ``save_every`` < 1.
    """

    def __init__(
        self,
        directory: str,
        model: Any,
        strategy: Any = None,
        optimizer: Any = None,
        max_to_keep: int | None = 3,
        timeout_seconds: float | None = None,
        save_every: int | None = None,
    ) -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be an int >= 1 or None, got {max_to_keep!r}")
        if save_every is not None and (
            not isinstance(save_every, int) or isinstance(save_every, bool) or save_every < 1
        ):
            raise ValueError(f"save_every must be an int >= 1 or None, got {save_every!r}")
        self.save_every = save_every
        self.directory = os.path.abspath(directory)
        self.model = model
        self.strategy = strategy if strategy is not None else tf.distribute.get_strategy()
        self._optimizer = optimizer
        self.max_to_keep = max_to_keep
        self._watcher: preemption.PreemptionWatcher | None = None
        self.last_save: wr.SaveResult | None = None
        self.last_restore: rd.RestoreResult | None = None
        config = getattr(self.strategy, "config", None)
        self.timeout_seconds = float(
            timeout_seconds
            if timeout_seconds is not None
            else getattr(config, "collective_timeout_seconds", 60.0)
        )

    @property
    def optimizer(self) -> Any:
        """The optimizer checkpointed with the model: the one given, else
        ``model.optimizer``, else (a custom loop's uncompiled model) the optimizer the
        strategy's runtime registered over this model's trainable variables; None for
        parameters only."""
        if self._optimizer is not None:
            return self._optimizer
        opt = getattr(self.model, "optimizer", None)
        if opt is not None:
            return opt
        runtime = getattr(self.strategy, "runtime", None)
        accounting = getattr(runtime, "accounting", None)
        ours = {id(v) for v in getattr(self.model, "trainable_variables", ())}
        for candidate in getattr(accounting, "optimizers", ()):
            held = getattr(candidate, "_trainable_variables", ())
            if held and {id(v) for v in held} <= ours:
                return candidate
        return None

    def state(self) -> TrainingState:
        """The model's :class:`TrainingState` now (builds the optimizer if needed)."""
        return TrainingState.of(self.model, self.optimizer, self.strategy)

    def save(self, tag: str | None = None, client_state: dict | None = None) -> wr.SaveResult:
        """Save a checkpoint; every worker must call this at the same step.

        Args:
            tag: the checkpoint name (default ``step<iterations:08d>``).
            client_state: JSON-serialisable data returned by :meth:`restore`.

        Returns:
            The :class:`~zero_runtime.checkpoint.writer.SaveResult` (path, bytes, seconds).

        Raises:
            ValueError: an invalid tag.
            OSError, tensorflow.errors.OpError: see :func:`zero_runtime.checkpoint.writer.save`.
        """
        result = wr.save(
            self.state(),
            self.directory,
            tag=tag,
            client_state=client_state,
            max_to_keep=self.max_to_keep,
            timeout_seconds=self.timeout_seconds,
        )
        self.last_save = result
        self._record(
            op="save",
            tag=result.tag,
            path=result.path,
            step=result.step,
            bytes=result.bytes_written,
            seconds=result.seconds,
        )
        return result

    def restore(self, tag: str | None = None) -> rd.RestoreResult:
        """Restore the checkpoint ``tag`` (default: ``latest``) onto the model.

        Works on any number of replicas (the states are re-partitioned from the index).

        Raises:
            CheckpointNotFoundError: no such directory, tag, or no checkpoint yet.
            CheckpointCorruptError: a missing or altered shard file, a bad index.
            CheckpointMismatchError: the checkpoint does not fit the model/optimizer.
        """
        reader = rd.CheckpointReader(rd.resolve(self.directory, tag))
        result = rd.restore(self.state(), reader)
        self.last_restore = result
        self._record(
            op="restore",
            tag=result.tag,
            path=result.path,
            step=result.step,
            bytes=result.bytes_read,
            seconds=result.seconds,
            saved_replicas=result.saved_replicas,
        )
        return result

    def _record(self, **record: Any) -> None:
        """Send a save/restore record to the strategy's runtime (a ``memory_hierarchy/
        checkpoint`` summary in its run; nothing without a runtime or a log directory)."""
        runtime = getattr(self.strategy, "runtime", None)
        if runtime is None or not hasattr(runtime, "record_checkpoint"):
            return
        cluster = getattr(self.strategy, "cluster", None)
        record["replicas"] = int(self.strategy.num_replicas_in_sync)
        record["rank"] = cluster.rank if cluster is not None else 0
        runtime.record_checkpoint(record)

    def preemption_watcher(self) -> preemption.PreemptionWatcher:
        """This process's :class:`~zero_runtime.preemption.PreemptionWatcher` (installed
        at the first call: SIGTERM handled from then on; main thread)."""
        cluster = getattr(self.strategy, "cluster", None)
        if cluster is None:
            return preemption.watcher(0, 1)
        return preemption.watcher(cluster.rank, cluster.num_workers)

    def restore_or_initialize(self) -> int:
        """Restore ``latest`` when there is one and take SIGTERM (preemption); returns the
        number of training steps already done: the checkpoint's ``client_state["step"]``
        (what :meth:`after_step` saves), else its optimizer step; 0 when nothing was
        published. Every worker calls it, before the first step. Rank 0 tells
        ``zero-runtime launch`` where training resumed (:mod:`zero_runtime.progress`).

        Raises:
            CheckpointNotFoundError: ``latest`` names no loadable checkpoint.
            CheckpointCorruptError: the checkpoint's files do not match its index.
            CheckpointMismatchError: a checkpoint of another model (variable count or
                shapes, optimizer slots); no variable is changed.
        """
        self._watcher = self.preemption_watcher()
        start = 0
        if self.latest is not None:
            info = self.restore()
            start = int(info.client_state.get("step", info.step))
        progress.report(start, resumed=True, rank=self._watcher.rank)  # launch's goodput
        return start

    def after_step(self, step: int, client_state: dict | None = None) -> wr.SaveResult | None:
        """Call after every training step, on every worker, with the number of steps done.

        Saves (``client_state`` plus ``{"step": step}``) when ``step`` is a multiple of
        ``save_every``. Rank 0 reports the step to ``zero-runtime launch``
        (:mod:`zero_runtime.progress`). After a SIGTERM to any worker, every worker saves
        at the step they agree on and exits with status 42 (``SystemExit``;
        :mod:`zero_runtime.preemption`).

        Returns:
            The :class:`~zero_runtime.checkpoint.writer.SaveResult` of a save, else None.

        Raises:
            SystemExit: status 42 after the preemption save.
            TimeoutError: a preemption whose agreement did not complete in its grace period.
        """
        state = {**(client_state or {}), "step": int(step)}
        watcher = self._watcher or self.preemption_watcher()
        self._watcher = watcher
        progress.report(step, rank=watcher.rank)  # zero-runtime launch's goodput
        if watcher.boundary(step):
            saved = self.save(client_state=state)
            watcher.exit(f"saved {saved.path} at step {step}")
        if self.save_every and step % self.save_every == 0:
            return self.save(client_state=state)
        return None

    @property
    def latest(self) -> str | None:
        """The tag ``<directory>/latest`` names, or None when nothing was published there.

        The tag is returned as written, even when it does not name a loadable checkpoint
        (a truncated ``latest``, a deleted ``index.json``): :meth:`restore` then raises
        naming it, so a resuming job stops instead of silently starting from scratch and
        overwriting the older checkpoints.

        Raises:
            CheckpointNotFoundError: there is no ``latest`` pointer but published
                checkpoints exist (the message lists them; ``restore(tag)`` one).
        """
        tag = rd.read_latest(self.directory)
        if tag is None:
            published = rd.published_tags(self.directory)
            if published:
                raise rd.CheckpointNotFoundError(
                    f"{self.directory!r} has published checkpoints {published} but no "
                    "'latest' pointer: restore one by tag, or write its tag into 'latest'"
                )
        return tag

    def checkpoints(self) -> list[str]:
        """Published tags, oldest first."""
        return wr.list_checkpoints(self.directory)
