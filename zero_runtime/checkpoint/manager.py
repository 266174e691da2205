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

    Attributes:
        last_save: the last :class:`~zero_runtime.checkpoint.writer.SaveResult` (bytes
            written, seconds), or None.
        last_restore: the last :class:`~zero_runtime.checkpoint.reader.RestoreResult`.

    Raises:
        ValueError: ``max_to_keep`` < 1.
    """

    def __init__(
        self,
        directory: str,
        model: Any,
        strategy: Any = None,
        optimizer: Any = None,
        max_to_keep: int | None = 3,
        timeout_seconds: float | None = None,
    ) -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be an int >= 1 or None, got {max_to_keep!r}")
        self.directory = os.path.abspath(directory)
        self.model = model
        self.strategy = strategy if strategy is not None else tf.distribute.get_strategy()
        self._optimizer = optimizer
        self.max_to_keep = max_to_keep
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
