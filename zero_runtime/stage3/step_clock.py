"""The step boundary of a stage-3 step with no host call: kept in Python, around the call.

A stage-3 step of a model run by units (:mod:`zero_runtime.stage3.gather`) with its
parameter shards and optimizer states on the device (``offload_param='none'``,
``offload_optimizer='none'``) needs no host callback for its data: the shards are
per-replica variables (``ShardedVariable.device_shard``), gathered and updated by
TensorFlow ops. What is left are the step's bookkeeping callbacks: the runtime's step
clock (``on_shard_updated``: telemetry, budgets, live tuning), the pool's step boundary
(``Stage3Engine.end_step``) and the collective watchdog's two callbacks per collective
(:func:`zero_runtime.comm.watchdog.guard`). Each costs a host round trip inside the step
(on a GPU: a synchronisation), so under Keras ``fit``/``train_on_batch`` they move out of
the graph: :meth:`OutsideStepClock.wrap` wraps the trainer's ``train_function`` so that

- while it runs (and traces), :attr:`OutsideStepClock.active` tells the train step to
  build no bookkeeping callback, and the watchdog builds the collectives unguarded
  (:meth:`~zero_runtime.comm.watchdog.CollectiveWatchdog.step_deadline`: one deadline
  over the call, enforced while it executes);
- after it returns, every optimizer step it ran (``iterations`` before and after, so
  also ``steps_per_execution > 1``) is reported for every local replica, in order, as the
  in-graph callbacks would have: ``on_shard_updated`` then ``end_step``.

With shards on the host or NVMe (or gradient accumulation) the step keeps its runtime
clock and pool boundary in the graph (its shards are read and written by host calls
anyway), but the wrapper still replaces the watchdog's per-collective callbacks by the
call's one deadline. A custom loop (``strategy.run(model.train_step)`` in the user's
``tf.function``) has no wrapper: its step keeps every in-graph callback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from zero_runtime.comm import WATCHDOG
from zero_runtime.optim.device_state import DeviceOptimizerState


class OutsideStepClock:
    """The Python-side step boundary of one stage-3 engine's device-tier steps.

    Args:
        engine: the :class:`~zero_runtime.stage3.engine.Stage3Engine`.

    Attributes:
        active: number of wrapped ``train_function`` calls running (trace time reads
            it: > 0 means the step being traced is run through :meth:`wrap`).
        traced_outside: True once a step was traced without its bookkeeping callbacks
            (only then does the wrapper report steps).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.active = 0
        self.traced_outside = False

    @functools.cached_property
    def eligible(self) -> bool:
        """True when the engine's steps can run without host calls: a model run by units,
        every shard a device variable, optimizer states on the device
        (``offload_optimizer='none'``), no gradient accumulation. Fixed for the engine's
        life (none of these is tuned live)."""
        engine = self.engine
        config = engine.config
        return (
            engine.runner is not None
            and config.offload_optimizer == "none"
            and config.gradient_accumulation_steps == 1
            and all(v.device_shard(engine.local_replicas[0]) is not None for v in engine.variables)
        )

    def applies(self, optimizer) -> bool:
        """Trace time: True when the step being traced builds no bookkeeping host call and
        leaves it to the wrapper (traced inside :meth:`wrap`, :attr:`eligible`, the
        optimizer's states on the device). Records :attr:`traced_outside` when True."""
        zs = getattr(optimizer, "_zero", None)
        ok = (
            self.active > 0
            and self.eligible
            and zs is not None
            and isinstance(zs.store, DeviceOptimizerState)
        )
        if ok:
            self.traced_outside = True
        return ok

    def wrap(self, train_function: Callable, trainer) -> Callable:
        """``train_function`` (Keras's, of ``trainer``) run under this clock; idempotent.

        Args:
            train_function: the trainer's ``train_function`` (``iterator -> logs``).
            trainer: the Keras model whose ``fit`` calls it (its ``optimizer`` and
                ``steps_per_execution`` are read per call).

        Returns:
            A callable with the same signature and result.
        """
        if train_function is None or getattr(train_function, "_zero_outside_clock", False):
            return train_function

        @functools.wraps(train_function)
        def stepped(*args, **kwargs):
            opt = getattr(trainer.optimizer, "inner_optimizer", trainer.optimizer)  # LSO
            before = int(opt.iterations.numpy()) if opt.built and self.eligible else None
            seconds = self.engine.config.collective_timeout_seconds
            seconds *= max(1, int(getattr(trainer, "steps_per_execution", 1) or 1))
            self.active += 1
            try:
                with WATCHDOG.step_deadline(seconds, f"of a stage-3 step of {trainer.name!r}"):
                    logs = train_function(*args, **kwargs)
            finally:
                self.active -= 1
            if self.traced_outside:  # device tier: the step's boundary, from here
                start = 0 if before is None else before
                self.steps_ended(opt, range(start, int(opt.iterations.numpy())))
            return logs

        stepped._zero_outside_clock = True
        return stepped

    def steps_ended(self, optimizer, steps: range) -> None:
        """Report ``steps`` (0-based optimizer steps) as ended on every local replica:
        the runtime's step clock, then the pool's step boundary (the order of the
        in-graph callbacks).

        Raises:
            zero_runtime.oom.OutOfMemoryError: a tier over its limit at a step boundary
                (the runtime wrote the post-mortem).
        """
        runtime = getattr(optimizer._zero, "runtime", None)  # noqa: SLF001
        for step in steps:
            for replica in self.engine.local_replicas:
                if runtime is not None:
                    runtime.on_shard_updated(optimizer, replica, step, 0.0)
                self.engine.end_step(replica, step)
