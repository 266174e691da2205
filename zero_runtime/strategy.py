"""ZeroInfinityStrategy: a ``tf.distribute`` strategy with ZeRO partitioning and offload.

User code stays Keras code::

    import zero_runtime
    strategy = zero_runtime.ZeroInfinityStrategy(logdir="logs/run1")
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(dataset, epochs=1)

Inside ``scope()``, the Keras optimizer identifiers ``"adam"``, ``"adamw"`` and ``"sgd"``
resolve to the partitioned optimizers of :mod:`zero_runtime.optim` (through Keras's own
custom-object scope, not by patching Keras), whose states live only as per-replica shards
(ZeRO stage 1, and stage 2 with reduce-scattered gradients; Rajbhandari et al., SC20,
sections 5.1-5.2) on the tier ``offload_optimizer`` names: the device, host memory
(ZeRO-Offload, Ren et al., ATC 2021) or NVMe (ZeRO-Infinity, Rajbhandari et al., SC21).
Custom training loops use ``strategy.run`` as with any ``tf.distribute`` strategy, with an
optimizer from ``zero_runtime.optim`` or ``keras.optimizers.get("adam")`` created inside
the scope.

Stage 0, or a model whose states are smaller than ``mirrored_fallback_bytes``, runs as
plain ``MirroredStrategy`` data parallelism (stock Keras optimizers), and the telemetry
says so.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Mapping
from typing import Any

import keras
import tensorflow as tf

from zero_runtime import comm, strategy_variants
from zero_runtime.capabilities import IMPLEMENTED, IMPLEMENTED_STAGE3_PARAM, check_implemented
from zero_runtime.checkpoint.data_resume import DataResume, resumable
from zero_runtime.comm import REDUCE_SCATTER_IMPLS
from zero_runtime.config import ZeroConfig
from zero_runtime.config.paths import check_logdir, check_nvme_path
from zero_runtime.devices import DeviceInfo, local_devices
from zero_runtime.lifecycle import ClosePhase, Resources
from zero_runtime.memory.host_malloc import tune_host_malloc
from zero_runtime.optim import adopt
from zero_runtime.optim.partitioned import PARTITIONED_BY_NAME
from zero_runtime.runtime import ZeroRuntime, headroom

# Re-exported: the implemented combinations live in zero_runtime.capabilities (read by the
# strategy and by the OOM advice, which must not import each other).
__all__ = ["IMPLEMENTED", "IMPLEMENTED_STAGE3_PARAM", "ZeroInfinityStrategy"]

# Each strategy instance gets its own range of collective group keys, so that several
# strategies in one process (a notebook, a parity test against MirroredStrategy) never
# share a collective instance. MirroredExtended reads ``_collective_key_base`` from its
# container strategy (tensorflow/python/distribute/mirrored_strategy.py).
_COLLECTIVE_KEY_BASES = itertools.count(start=100_000, step=100_000)


class ZeroInfinityStrategy(tf.distribute.MirroredStrategy):
    """Data parallelism over the local replicas with ZeRO partitioning and offload.

    Args:
        config: a :class:`ZeroConfig`, a mapping of its keys, or None for the defaults
            (stage 1, optimizer states offloaded to the host).
        logdir: the run's TensorBoard log directory for Memory Hierarchy summaries
            (created if missing), or None to write none.
        num_cpu_replicas: on a host without GPUs, the number of logical CPU devices to
            replicate over (default 2). Ignored when GPUs are visible.
        reduce_scatter_impl: how stage 2 reduce-scatters gradients: 'nccl' (GPUs),
            'all_to_all' (CPU), 'all_reduce' (all-reduce then slice), or None (default) to
            choose by device type (``zero_runtime.comm.CollectiveGroup.create``).

    Attributes:
        config: the active :class:`ZeroConfig`.
        device_info: the replica devices and whether the device tier is a CPU stand-in.
        runtime: the :class:`ZeroRuntime` (step clock, accounting, telemetry).
        resources: the :class:`zero_runtime.lifecycle.Resources` recording what the
            strategy created (stage-3 engines and pools, optimizer stores, update threads,
            the runtime) and its lifecycle state; :meth:`close` releases them.
        time_strategy_collectives: class-wide switch, default False. True: the
            strategy's own collectives (stage 0-2's gradient all-reduce and shard
            all-gather, Keras's loss reductions) run under the collective watchdog's two
            host callbacks (``comm.guard_strategy_collectives``), whose timestamps time
            them on every step. Off by default: it costs ~29 % of a stage-1 step on 2 CPU
            cores (bench/bench_timing_callbacks.py, bench/results/timing_callbacks.json),
            far over the 2 % telemetry budget, so those steps are timed only on the
            profiler's sampled steps. Set it before creating the strategy.

    Raises:
        zero_runtime.config.ZeroConfigError: an invalid config value, or an NVMe offload
            whose ``nvme_path`` is missing, a file or not writable
            (:func:`zero_runtime.config.paths.check_nvme_path`).
        ValueError: an unknown ``reduce_scatter_impl``; a ``logdir`` that is a file or
            cannot be created or written.
        NotImplementedError: a (stage, offload) combination this version does not
            implement yet; the message lists the implemented ones.
        RuntimeError: TensorFlow was initialised before the logical CPU devices could be
            configured (create the strategy before running any TensorFlow op).
    """

    time_strategy_collectives: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> ZeroInfinityStrategy:
        """Pick the concrete strategy: multi-worker when ``TF_CONFIG`` names a cluster.

        ``ZeroInfinityStrategy(...)`` returns a
        :class:`zero_runtime.multiworker.MultiWorkerZeroInfinityStrategy` (a subclass, over
        ``MultiWorkerMirroredStrategy``) when ``TF_CONFIG`` lists more than one
        chief/worker task, else an instance of this class (``MirroredStrategy`` over the
        local replicas). See docs/multiworker/index.md. The subclass registers itself in
        :mod:`zero_runtime.strategy_variants` when its module is imported (this module
        cannot import it: it imports this one); ``zero_runtime.ZeroInfinityStrategy``
        imports it first.

        Raises:
            RuntimeError: ``TF_CONFIG`` is set but no multi-worker variant is registered
                (this class was imported from ``zero_runtime.strategy`` directly, without
                ``zero_runtime.multiworker``): building a single-process strategy there
                would silently train each worker alone.
        """
        if cls is ZeroInfinityStrategy:
            if os.environ.get("TF_CONFIG", "").strip() and not strategy_variants.registered(cls):
                raise RuntimeError(
                    "TF_CONFIG is set but no multi-worker strategy is registered: create "
                    "the strategy as zero_runtime.ZeroInfinityStrategy, or import "
                    "zero_runtime.multiworker before zero_runtime.strategy.ZeroInfinityStrategy"
                )
            cls = strategy_variants.select(cls)
        return super().__new__(cls)

    def _init_distribute_base(self, config: ZeroConfig, num_cpu_replicas: int) -> DeviceInfo:
        """Initialise the ``tf.distribute`` base over the local replicas; return them."""
        del config
        info = local_devices(num_cpu_replicas)
        tf.distribute.MirroredStrategy.__init__(self, devices=list(info.devices))
        return info

    def _runtime_logdir(self, logdir: str | None) -> str | None:
        """The runtime's summary directory for the run directory ``logdir``."""
        return logdir

    def __init__(
        self,
        config: ZeroConfig | Mapping[str, Any] | None = None,
        logdir: str | None = None,
        num_cpu_replicas: int = 2,
        reduce_scatter_impl: str | None = None,
    ) -> None:
        if config is None:
            config = ZeroConfig()
        elif isinstance(config, Mapping):
            config = ZeroConfig.from_dict(config)
        elif not isinstance(config, ZeroConfig):
            raise TypeError(
                f"config must be a ZeroConfig, a mapping or None, got {type(config).__name__}"
            )
        check_implemented(config)
        # The paths a run writes to, checked now: one line, not a traceback at step 1.
        if "nvme" in (config.offload_param, config.offload_optimizer):
            check_nvme_path(config.nvme_path)
        if logdir is not None:
            check_logdir(logdir)
        if reduce_scatter_impl is not None and reduce_scatter_impl not in REDUCE_SCATTER_IMPLS:
            raise ValueError(
                f"reduce_scatter_impl must be one of {REDUCE_SCATTER_IMPLS} or None, "
                f"got {reduce_scatter_impl!r}"
            )
        if config.offload_param != "none" or config.offload_optimizer != "none":
            tune_host_malloc()  # a host or NVMe tier: keep its staging buffers mapped
        self._initial_config = config
        self.reduce_scatter_impl = reduce_scatter_impl
        self._collective_key_base = next(_COLLECTIVE_KEY_BASES)
        self.resources = Resources(f"{type(self).__name__}(stage={config.stage})")
        #: Where ``fit``'s next training iterator starts after ``ZeroBackupAndRestore``
        #: restored a mid-epoch backup (zero_runtime/checkpoint/data_resume.py).
        self.data_resume = DataResume()
        self.device_info: DeviceInfo = self._init_distribute_base(config, num_cpu_replicas)
        # device_budget_bytes='auto': the starting budget from the device's capacity, and
        # the controller that holds the headroom from then on (runtime/headroom.py).
        config, headroom_controller = headroom.resolve_auto(config, self.device_info)
        self._initial_config = config
        self.runtime = ZeroRuntime(
            config,
            self.device_info,
            self.num_replicas_in_sync,
            self._runtime_logdir(logdir),
            fallback_mirrored=config.stage == 0,
            headroom=headroom_controller,
        )
        self.resources.adopt(self.runtime, ClosePhase.TELEMETRY, "runtime")
        if self.time_strategy_collectives and config.collective_timeout_seconds > 0:
            # The strategy's own collectives (stage 0-2's gradient all-reduce and shard
            # all-gather, Keras's loss reductions) under the watchdog's host callbacks:
            # their arm -> disarm times are the step's comm intervals (docs/events.md).
            # Cross-device ops without collective launchers (NCCL on GPUs, one device):
            # left bare, timed on profiler-sampled steps only.
            with contextlib.suppress(RuntimeError):
                comm.guard_strategy_collectives(
                    self, lambda: self.config.collective_timeout_seconds
                )

    @property
    def config(self) -> ZeroConfig:
        """The active configuration: as started, or as changed by live tuning since."""
        runtime = getattr(self, "runtime", None)
        return runtime.config if runtime is not None else self._initial_config

    @property
    def partitioned(self) -> bool:
        """True when optimizer states are partitioned (stage >= 1).

        A model below ``mirrored_fallback_bytes`` still resolves to the partitioned
        optimizer classes, which then run the stock Keras update and set
        ``runtime.fallback_mirrored``.
        """
        return self.config.stage >= 1

    @property
    def local_replica_ids(self) -> tuple[int, ...]:
        """Replica ids (in the sync group) that run in this process, in local device order.

        One process: ``0 .. local - 1``. Multi-worker (TensorFlow's numbering,
        ``CollectiveAllReduceExtended``): ``rank * local + i``.
        """
        return tuple(range(len(self.extended.worker_devices)))

    def scope(self) -> contextlib.AbstractContextManager:
        """The strategy's scope; inside it, Keras optimizer names resolve to partitioned ones.

        Returns:
            A context manager entering ``MirroredStrategy.scope()``, a
            ``keras.saving.CustomObjectScope`` that maps the optimizer names (``"adam"``,
            ``"sgd"``, ...: ``PARTITIONED_BY_NAME``) to :mod:`zero_runtime.optim`, and a
            variable creator that makes a Keras optimizer instance built inside
            partitioned (:mod:`zero_runtime.optim.adopt`; at stage 0 they run the stock
            update, recorded by the runtime like any other stage's).
        """
        stack = contextlib.ExitStack()
        stack.enter_context(super().scope())
        # Stage 0 too: the partitioned classes run the stock update there (plain data
        # parallelism) and the runtime records its steps (zero_runtime/optim/mirrored.py).
        stack.enter_context(keras.saving.CustomObjectScope(PARTITIONED_BY_NAME))
        # A Keras optimizer instance built here becomes its partitioned class
        # (zero_runtime/optim/adopt.py): keras.optimizers.Adam(...) is partitioned too.
        stack.enter_context(tf.variable_creator_scope(adopt.creator))
        return stack

    def write_postmortem(self, exc: BaseException) -> str | None:
        """Write the OOM post-mortem for an error caught by the caller (docs/oom.md).

        For a ``tf.errors.ResourceExhaustedError`` raised by TensorFlow's own ops (the
        runtime's own OOM errors already wrote theirs; this returns that path).

        Returns:
            The path of ``<run_dir>/memory_hierarchy_oom.json``, or None without a logdir.
        """
        return self.runtime.write_postmortem(exc)

    def zero_init(self) -> contextlib.AbstractContextManager:
        """Stage 3: build a model without materialising it (partitioned construction,
        DeepSpeed's ``zero.Init``). At stages 0-2: ``scope()``.

        Variables created inside are deferred (no value, nothing on any device);
        :meth:`shard_model` then creates each one directly as its shards in the pool on
        the ``offload_param`` tier, one variable at a time. Same seeds give the same
        weights as a replicated build. See :mod:`zero_runtime.stage3.construction`.

        Returns:
            A :class:`zero_runtime.stage3.construction.PartitionedConstruction` (also
            enters ``scope()``).
        """
        from zero_runtime.stage3.construction import PartitionedConstruction

        return PartitionedConstruction(self)

    def shard_model(self, model: keras.Model) -> keras.Model:
        """Stage 3: wrap a built model for block-by-block training with sharded parameters.

        The explicit form: at stage 3 a model created and compiled inside ``scope()`` is
        sharded by its first ``fit``/``train_on_batch``/``evaluate`` anyway
        (:meth:`autoshard_stage3`). Either way the model's own object trains at stage 3
        afterwards (``model.fit``, ``strategy.run(model.train_step, ...)``).

        The model may be built inside ``scope()`` (replicated, then sharded and the
        originals freed) or inside :meth:`zero_init` (each deferred variable initialized
        straight into its shards); this may be called inside either.

        Returns:
            A :class:`zero_runtime.stage3.ShardedModel` (a ``keras.Model``; compile and
            ``fit`` it). The model's trainable weights become ShardedVariables in place.

        Raises:
            ValueError: the strategy is not at stage 3 (see ``ShardedModel``).
        """
        from zero_runtime.stage3 import ShardedModel
        from zero_runtime.stage3.construction import suspended

        with self.scope(), suspended():
            return ShardedModel(model, self)

    def autoshard_stage3(self, optimizer: Any, variables: list) -> list:
        """Stage 3 without ``shard_model``: shard the model whose optimizer is being built.

        Called by the partitioned optimizer's ``build`` when the config says stage 3 and
        the variables are not sharded yet: Keras's ``fit``/``train_on_batch``/``evaluate``
        build the optimizer of a model created in ``scope()`` before their first trace
        (``Trainer._symbolic_build``). That model is sharded in place
        (:meth:`shard_model`); its own ``fit`` then runs the stage-3 step. See
        :mod:`zero_runtime.stage3.autoshard` and docs/stages/stage3.md.

        Args:
            optimizer: the partitioned optimizer being built.
            variables: the unsharded variables it was given (``model.trainable_variables``).

        Returns:
            The model's trainable variables after sharding (ShardedVariables).

        Raises:
            ValueError: no model to shard (a custom loop, or a model created outside
                ``scope()``), or a non-float32 weight; nothing is changed.
            NotImplementedError: a layer stage 3 cannot run yet (one that owns weights
                and draws random numbers in its own call), naming it; nothing is changed.
        """
        from zero_runtime.stage3 import autoshard

        model = autoshard.trainer_to_shard(optimizer, variables)
        self.shard_model(model)
        return list(model.trainable_variables)

    def save_checkpoint(
        self,
        directory: str,
        model: keras.Model,
        tag: str | None = None,
        client_state: dict | None = None,
        max_to_keep: int | None = 3,
    ) -> Any:
        """Save a sharded checkpoint of ``model`` and its optimizer (DeepSpeed's name).

        Every worker calls it at the same step; each writes its replicas' shards, the chief
        the index, and ``<directory>/latest`` moves only once the checkpoint is complete.
        See :class:`zero_runtime.checkpoint.CheckpointManager` and docs/checkpoint.md.

        Returns:
            A :class:`zero_runtime.checkpoint.SaveResult` (path, tag, step, bytes, seconds).
        """
        from zero_runtime.checkpoint import CheckpointManager

        manager = CheckpointManager(directory, model, self, max_to_keep=max_to_keep)
        return manager.save(tag=tag, client_state=client_state)

    def load_checkpoint(self, directory: str, model: keras.Model, tag: str | None = None) -> Any:
        """Restore a sharded checkpoint (``latest`` by default) onto ``model``, on any
        number of replicas (re-partitioned from the index; DeepSpeed's name).

        Returns:
            A :class:`zero_runtime.checkpoint.RestoreResult` (step, client_state, ...).

        Raises:
            zero_runtime.checkpoint.CheckpointError: a missing, corrupt or incompatible
                checkpoint (see :meth:`zero_runtime.checkpoint.CheckpointManager.restore`).
        """
        from zero_runtime.checkpoint import CheckpointManager

        return CheckpointManager(directory, model, self).restore(tag)

    def run(self, fn, args=(), kwargs=None, options=None):
        """``tf.distribute.Strategy.run``.

        At stage 3 it refuses, before the step is traced, Keras's own ``train_step`` of a
        model that is not sharded (a model compiled with a stock Keras optimizer
        instance, e.g. ``keras.optimizers.Adam()``, which would train replicated while
        the config and telemetry say stage 3).

        Raises:
            zero_runtime.lifecycle.StrategyClosedError: after :meth:`close`.
            ValueError: that stage-3 case, naming the model, its optimizer and what to pass;
                at stage 3, a gradient shard combined with a whole-shaped tensor in the
                step (:func:`zero_runtime.stage3.shard_norm.explain_shape_error`).
        """
        self.resources.check_open("run a step")
        if self.config.stage == 3:
            _refuse_unsharded_keras_step(fn)
        with self.resources.tracing():  # gradient registrations, released by close()
            try:
                return super().run(fn, args=args, kwargs=kwargs, options=options)
            except ValueError as exc:
                if self.config.stage == 3:
                    from zero_runtime.stage3.shard_norm import explain_shape_error

                    clear = explain_shape_error(exc)
                    if clear is not None:
                        raise clear from exc
                raise

    def experimental_distribute_dataset(self, dataset, options=None):
        """As ``tf.distribute.Strategy``'s (Keras's fit/evaluate/predict call it first).

        The result is TensorFlow's ``DistributedDataset`` whose ``iter()`` starts later
        in the stream when :attr:`data_resume` says so (``ZeroBackupAndRestore`` resuming
        mid-epoch; zero_runtime/checkpoint/data_resume.py); otherwise it iterates
        exactly as TensorFlow's.

        Raises:
            zero_runtime.lifecycle.StrategyClosedError: after :meth:`close`.
        """
        self.resources.check_open("distribute a dataset (fit, evaluate or predict)")
        base = super()

        def distribute(ds):
            return base.experimental_distribute_dataset(ds, options=options)

        return resumable(distribute(dataset), self.data_resume, dataset, distribute)

    def close(self) -> None:
        """Release everything the strategy created; idempotent (a second call is a no-op).

        In this order (:class:`zero_runtime.lifecycle.ClosePhase`): stage 3's update
        threads (after their queued block updates), stage-3 engines (their pools: prefetch
        and I/O threads, pages, NVMe slab files and descriptors), optimizer-state stores
        (write-behind thread, NVMe pool), then the telemetry (flushed and closed last).
        Afterwards :meth:`run`, ``fit``/``evaluate``/``predict``, :meth:`shard_model`
        and the host calls of steps traced before raise
        :class:`zero_runtime.lifecycle.StrategyClosedError`. Stage 0-2 models keep their
        weights (Keras variables, readable in :meth:`scope`); stage-3 weights (their
        shards) are gone.
        """
        self.resources.close()


def _refuse_unsharded_keras_step(fn: Any) -> None:
    """Raise when ``fn`` is Keras's own ``train_step`` of an unsharded model (stage 3)."""
    while hasattr(fn, "__wrapped__"):  # Keras wraps the step (functools.wraps)
        fn = fn.__wrapped__
    model = getattr(fn, "__self__", None)
    if (
        isinstance(model, keras.Model)
        and getattr(fn, "__name__", "") == "train_step"
        and not getattr(model, "_zero_stage3_sharded", False)
    ):
        raise ValueError(
            f"stage 3: model {model.name!r} would train with Keras's own train_step, its "
            f"parameters replicated: its optimizer {type(model.optimizer).__name__} is not "
            "a partitioned one. Compile it inside strategy.scope() with optimizer='adam', "
            "'adamw' or 'sgd' (or zero_runtime.optim.Adam(...)), or call "
            "strategy.shard_model(model) first"
        )
