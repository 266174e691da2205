"""What the runtime reports for its callers, a mixin of
:class:`~zero_runtime.runtime.coordinator.ZeroRuntime`: checkpoint records, the
:class:`~zero_runtime.runtime.accounting.Accounting` figures the strategy exposes, and
the OOM post-mortem of a failed step.

The coordinator provides ``accounting``, ``config``, ``config_version``, ``collector``,
``recorder``, ``control``, ``summaries``, ``postmortem``, ``fallback_mirrored`` and
``_accepting()`` (its lifecycle is OPEN).
"""

from __future__ import annotations

import time
from typing import Any

from zero_runtime import oom
from zero_runtime.runtime.postmortem import FailureContext, as_oom_error, model_facts


class RuntimeReports:
    """Checkpoint records, accounting figures and OOM post-mortems of one runtime."""

    accounting: Any
    config: Any
    config_version: int
    collector: Any
    recorder: Any
    control: Any
    summaries: Any
    postmortem: Any
    fallback_mirrored: bool

    def _accepting(self) -> bool:  # the coordinator's lifecycle
        raise NotImplementedError

    # -- checkpoints ---------------------------------------------------------------------
    def record_checkpoint(self, record: dict[str, Any]) -> None:
        """Write one checkpoint save or restore as a json summary (fields and units:
        docs/events.md), at step ``record["step"]`` (the optimizer step saved or restored,
        int >= 0), and flush it. The tag follows ``record["op"]``
        (:data:`tb_plugin.metadata.CHECKPOINT_OP_TAGS`): a save under
        ``memory_hierarchy/checkpoint``, a restore under ``memory_hierarchy/checkpoint_restore``,
        so a resume at the step its checkpoint was saved keeps both under TensorBoard's
        ``--load_fast`` (one value per run, tag and step). No-op without a log directory or
        after :meth:`close`. Called by ``zero_runtime.checkpoint.CheckpointManager``.

        Raises:
            ValueError: ``record["op"]`` is neither ``"save"`` nor ``"restore"``.
            TypeError: ``record`` is not JSON-serialisable.
        """
        if self.summaries is None or not self._accepting():
            return
        self.summaries.checkpoint(record)

    # -- accounting (Accounting's figures, for the strategy's callers) --------------------
    def model_param_bytes(self) -> int:
        """Bytes of one replica's trainable variables tracked by the optimizers."""
        return self.accounting.model_param_bytes()

    def host_state_bytes(self) -> tuple[int, int]:
        """(optimizer-state bytes, scratch bytes) held on the host by all optimizers."""
        return self.accounting.state_bytes_on("host")

    def grad_bytes(self) -> int:
        """Device bytes of gradients the local replicas keep
        (:meth:`Accounting.grad_bytes`)."""
        return self.accounting.grad_bytes()

    def device_used_bytes(self) -> float:
        """Device-tier bytes in use (:meth:`Accounting.device_used_bytes`)."""
        return self.accounting.device_used_bytes()

    def placement(self) -> dict[str, Any]:
        """Where every trainable variable's parameter, gradient and optimizer state live
        (:meth:`Accounting.placement` under the active ``offload_optimizer``)."""
        return self.accounting.placement(self.config.offload_optimizer)

    def _shared_placement(self) -> dict[str, Any]:
        """:meth:`placement` with the cached rows shared, not copied (read-only: the
        summary writer compares it with the placement it wrote last, every record)."""
        return self.accounting.placement(self.config.offload_optimizer, copy=False)

    # -- out of memory ------------------------------------------------------------------
    def write_postmortem(self, exc: BaseException, step: int | None = None) -> str | None:
        """Write the OOM post-mortem for ``exc`` (e.g. a TensorFlow
        ``ResourceExhaustedError`` the caller caught); returns the JSON file's path.

        Idempotent: an error whose post-mortem this runtime already wrote (ours, or
        TensorFlow's re-raise of ours, whose message names the file) returns that path.
        The failed tier is the error's own (runtime errors, pool snapshots), else
        'device' (TensorFlow's allocator serves the device tier).
        """
        known = self.postmortem.written_for(exc)
        if known is not None:
            return known
        err = as_oom_error(exc)
        self._fail(err, self._next_step() if step is None else step, cause=exc)
        return err.postmortem_path

    def _fail(
        self, err: oom.OutOfMemoryError, step: int, cause: BaseException | None = None
    ) -> oom.OutOfMemoryError:
        """Write the post-mortem of ``err``; return it for the caller to raise."""
        return self.postmortem.fail(err, step, cause or err, lambda: self._failure_context(step))

    def _failure_context(self, step: int) -> FailureContext:
        """The post-mortem's inputs; the snapshot consumes the failed step's counters."""
        snapshot = self.collector.collect(
            step,
            time.time(),
            0.0,
            config=self.config,
            config_version=self.config_version,
            fallback_mirrored=self.fallback_mirrored,
        )
        return FailureContext(
            snapshot=snapshot,
            recent=self.recorder.last(),
            config=self.config,
            config_version=self.config_version,
            config_history=[o.to_dict() for o in self.control.history] if self.control else [],
            facts=self._model_facts(),
        )

    def _model_facts(self):
        """The advice's model figures (``postmortem.model_facts``); None if they cannot be
        read (never hides the OOM)."""
        try:
            return model_facts(self.accounting, self.config)
        except Exception:  # noqa: BLE001 - the report must still be written
            return None

    def _publish_oom(self, step: int, report: dict[str, Any]) -> None:
        if self.summaries is not None and self._accepting():
            self.summaries.oom(step, report)

    def _next_step(self) -> int:
        """The step after the last recorded one (0 before any record)."""
        return self.recorder.last(1)[0].step + 1 if len(self.recorder) else 0
