"""ZeroConfig: every knob of the runtime in one frozen dataclass, validated on
construction (each value against its spec, then the rules across keys), and its
conversions (dict, JSON, DeepSpeed config)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from typing import Any

import psutil

from zero_runtime.config.deepspeed import from_deepspeed_config
from zero_runtime.config.errors import ZeroConfigError
from zero_runtime.config.json_input import load_json_object
from zero_runtime.config.specs import GIB, MIB, SPECS, check_value, unknown_key_error


@functools.cache
def physical_memory_bytes() -> int:
    """This machine's physical memory, bytes (``psutil.virtual_memory().total``): the
    largest accepted ``host_budget_bytes``. Read once per process (it does not change
    while the process runs; reading /proc/meminfo costs ~0.1 ms, which the per-step
    host-tier capacity paid on the training step)."""
    return int(psutil.virtual_memory().total)


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """Every knob of the ZeRO-Infinity runtime; immutable and validated on construction.

    Units: *bytes* are byte counts; *elements* are counts of scalar parameter values
    (independent of dtype), as in DeepSpeed's ``zero_optimization`` section.

    Attributes:
        stage: ZeRO stage, int in [0, 3]. Default 1. 0 = plain data parallelism;
            1 = partition optimizer states; 2 = also gradients; 3 = also parameters
            (ZeRO paper, SC20, section 5.1).
        offload_optimizer: where each replica's optimizer-state shard lives and is updated:
            'none' (device), 'cpu' (host memory) or 'nvme' (files under ``nvme_path``).
            Default 'cpu'.
        offload_param: where each replica's parameter shard lives between uses: 'none',
            'cpu' or 'nvme'. Default 'none'. 'cpu' and 'nvme' require ``stage == 3``.
        nvme_path: directory for the NVMe tier's files, str or None. Default None. Required
            when either offload is 'nvme'.
        page_size_bytes: size of one page of the paged buffer pool, bytes. Default 4 MiB
            (4194304). Must be a power of two in [64 KiB, 1 GiB] ([65536, 1073741824]).
        device_budget_bytes: bytes the runtime may place on the device tier, int >= 1, or
            None (default) meaning the tier's physical size. Must be >= ``page_size_bytes``.
            Or ``'auto'``: the runtime holds its own headroom, adjusting the budget (and,
            near an OOM, prefetch and reuse distance) to keep the measured in-step peak
            ``headroom_fraction`` below the device's real capacity
            (zero_runtime/runtime/headroom.py); the strategy resolves it to an int at start.
        host_budget_bytes: bytes the runtime may place in host memory, int >= 1, or None
            (default) meaning physical memory. Must be >= ``page_size_bytes`` and at most
            this machine's physical memory (:func:`physical_memory_bytes`), at every stage.
        nvme_budget_bytes: bytes the runtime may write under ``nvme_path``, int >= 1, or None
            (default) meaning unbounded (the file system's free space).
            Must be >= ``page_size_bytes``.
        persistence_threshold: parameters with fewer elements than this *may* stay
            gathered between uses (DeepSpeed's ``stage3_param_persistence_threshold``,
            default 1e5), elements, int >= 0. A permission, not a bound: the stage-3
            engine keeps none gathered (a unit's small parameters move in its one
            all-gather, per use), so a run is the same for every value; only the
            estimator reads it, counting weights below it as replicated on the device as
            DeepSpeed places them. Default 100_000.
        prefetch_bucket_size: elements of parameters fetched ahead of use, int >= 0; 0
            disables prefetch. Default 50_000_000 (DeepSpeed's 5e7).
        max_live_parameters: upper bound on gathered (unsharded) parameter elements resident
            per replica at once, int >= 1. Default 1_000_000_000 (DeepSpeed's 1e9). At
            stage 3 two units may be gathered at once, so a ``Dense`` / ``EinsumDense`` /
            ``Embedding`` kernel above half of it runs as column tiles, and a unit that
            cannot tile below it is refused (``zero_runtime/stage3/device_plan.py``).
        max_reuse_distance: a parameter *may* stay gathered if it will be reused within
            this many elements of other parameters' use (DeepSpeed's
            ``stage3_max_reuse_distance``), int >= 0. A permission, not a bound: stage 3
            gathers each unit per use. Default 1_000_000_000.
        reduce_bucket_size: elements per gradient reduce(-scatter) bucket, int >= 1.
            Default 500_000_000 (DeepSpeed's 5e8).
        allgather_bucket_size: elements per parameter all-gather bucket, int >= 1.
            Default 500_000_000 (DeepSpeed's 5e8).
        overlap_comm: overlap gradient reduction with the backward pass, bool. Default True.
        gradient_accumulation_steps: micro-steps accumulated locally before one reduction
            and optimizer step, int >= 1. Default 1.
        sub_group_size: elements per optimizer-step tile (the unit the offloaded optimizer
            updates and swaps at once), int >= 1. Default 1_000_000_000 (DeepSpeed's 1e9).
        pin_memory: page-lock host buffers of offloaded states, bool. Default False.
        telemetry_every_n_steps: write a StepStats summary every N steps, int >= 1.
            Default 1.
        mirrored_fallback_bytes: when the model states' total bytes are below this, the
            strategy runs as plain mirrored data parallelism, bytes, int >= 0. Default 0
            (fallback disabled).
        collective_timeout_seconds: a collective that does not finish within this many
            seconds fails, float > 0 (finite). Default 60.0. Ints are accepted and stored
            as float. A stage-3 model run by units under ``fit`` has one deadline per
            train-function call instead (zero_runtime/stage3/step_clock.py).
        embedding_row_paging_threshold: at stage 3, a ``keras.layers.Embedding`` whose
            table has at least this many elements is row-paged (only the rows a step looks
            up move; hot rows stay on the device tier, cold ones on the offload tier; lazy
            sparse updates, see zero_runtime/stage3/embedding.py), elements, int >= 1.
            Default 10_000_000 (a 40 MB float32 table; smaller tables are gathered whole).
        offload_optimizer_ratio: fraction of each replica's optimizer-state shard kept and
            updated on the host when ``offload_optimizer='cpu'``, float in (0, 1]; the rest
            stays on the device and is updated there concurrently (partial offload,
            DeepSpeed's ``offload_optimizer.ratio``, ZeRO-Offload++ "Twin-Flow";
            zero_runtime/optim/split_state.py). Default 1.0 (all on the host). Below 1.0
            it requires ``offload_optimizer='cpu'`` and stage 1 or 2.
        headroom_fraction: with ``device_budget_bytes='auto'``, the fraction of the
            device's real capacity the runtime keeps free below its measured in-step
            peak, float in (0, 0.9]. Default 0.1. Ignored otherwise.
        tile_size: memory-centric tiling at stage 3 (ZeRO-Infinity, SC21, section 5.1.3):
            a ``Dense``/``EinsumDense``/``Embedding`` unit whose kernel has more than this
            many elements runs as column tiles of at most this many kernel elements each,
            gathered, computed and released one at a time, forward and backward
            (zero_runtime/stage3/tiling.py), elements, int >= 1, None or ``'auto'``.
            Default None: no tiling (a tile pays off on a layer wide relative to the
            model; each tile adds a host read and a collective, and the traced step grows
            with the tiles; see docs/stages/tiling.md). ``'auto'``: from an int
            ``device_budget_bytes`` (a tile's working set, about 8 float32 copies of the
            tile, in a quarter of the budget: ``device_budget_bytes // 128``; no tiling
            without one). DeepSpeed has no config
            key for it: its ``TiledLinear(in_splits, out_splits)`` replaces a module by
            hand.
        activation_checkpointing: stage 3, units path: every outermost block of the model
            (a layer, not a model, that holds layers owning weights: a transformer
            block, a ``MultiHeadAttention``) keeps only its inputs from the forward and
            recomputes its call in backward (zero_runtime/stage3/checkpointing.py;
            Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"; ZeRO-R,
            Rajbhandari et al., SC20, section 6.1). Activations held then grow with the
            number of blocks times their inputs, not with every intermediate; each unit
            inside is gathered three times per step instead of two. bool. Default False.
            DeepSpeed: ``activation_checkpointing`` configures
            ``deepspeed.checkpointing.checkpoint``, which the model code calls per block.
        optimizer_host_budget_bytes: with ``offload_optimizer='nvme'``, the host bytes the
            NVMe optimizer-state store may hold: its streamed window (4 sub-groups of
            every state buffer of every local replica; ``sub_group_size`` is reduced to
            fit) and the step journal's host copies (the rest journalled through NVMe).
            Apart from ``host_budget_bytes`` (the parameter pool's host tier at stage 3).
            int >= page_size_bytes, or None (default): a quarter of the host's available
            memory when the optimizer is built. DeepSpeed bounds the same window by
            ``offload_optimizer.buffer_count`` and ``sub_group_size``.

    Raises:
        ZeroConfigError: on construction, for a value of the wrong type (bool is never an
            int and an int never a bool), out of range, not one of the choices, or a
            violated cross-field rule (offload_param needs stage 3; 'nvme' needs nvme_path;
            budgets at least one page; host_budget_bytes at most physical memory).
    """

    stage: int = 1
    offload_optimizer: str = "cpu"
    offload_param: str = "none"
    nvme_path: str | None = None
    page_size_bytes: int = 4 * MIB
    device_budget_bytes: int | str | None = None
    host_budget_bytes: int | None = None
    nvme_budget_bytes: int | None = None
    persistence_threshold: int = 100_000
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    gradient_accumulation_steps: int = 1
    sub_group_size: int = 1_000_000_000
    pin_memory: bool = False
    telemetry_every_n_steps: int = 1
    mirrored_fallback_bytes: int = 0
    collective_timeout_seconds: float = 60.0
    embedding_row_paging_threshold: int = 10_000_000
    offload_optimizer_ratio: float = 1.0
    headroom_fraction: float = 0.1
    tile_size: int | None = None
    activation_checkpointing: bool = False
    optimizer_host_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = check_value(f.name, getattr(self, f.name), SPECS[f.name])
            object.__setattr__(self, f.name, value)
        self._check_cross_fields()

    def _check_cross_fields(self) -> None:
        if self.offload_param != "none" and self.stage != 3:
            raise ZeroConfigError(
                f"offload_param={self.offload_param!r} is invalid with stage={self.stage}: "
                "parameter offload requires stage 3 (set stage=3 or offload_param='none')",
                key="offload_param",
                value=self.offload_param,
                accepted="'none' unless stage == 3",
            )
        if self.offload_optimizer_ratio < 1.0 and (
            self.offload_optimizer != "cpu" or self.stage not in (1, 2)
        ):
            raise ZeroConfigError(
                f"offload_optimizer_ratio={self.offload_optimizer_ratio!r} is invalid with "
                f"offload_optimizer={self.offload_optimizer!r} and stage={self.stage}: partial "
                "optimizer offload splits the states between the device and the host, so it "
                "needs offload_optimizer='cpu' at stage 1 or 2 (or ratio 1.0)",
                key="offload_optimizer_ratio",
                value=self.offload_optimizer_ratio,
                accepted="1.0, or a float in (0, 1) with offload_optimizer='cpu' and stage 1 or 2",
            )
        for key in ("offload_optimizer", "offload_param"):
            if getattr(self, key) == "nvme" and self.nvme_path is None:
                raise ZeroConfigError(
                    f"{key}='nvme' requires nvme_path (a directory for the NVMe tier's "
                    "files); got nvme_path=None",
                    key="nvme_path",
                    value=None,
                    accepted="a non-empty string path when an offload is 'nvme'",
                )
        for key in (
            "device_budget_bytes",
            "host_budget_bytes",
            "nvme_budget_bytes",
            "optimizer_host_budget_bytes",
        ):
            budget = getattr(self, key)
            if budget is not None and budget != "auto" and budget < self.page_size_bytes:
                raise ZeroConfigError(
                    f"{key}={budget!r} is invalid: expected None or an int >= "
                    f"page_size_bytes ({self.page_size_bytes}) bytes; a tier must hold at "
                    "least one page",
                    key=key,
                    value=budget,
                    accepted=f"None or an int >= {self.page_size_bytes} (bytes)",
                )
        physical = physical_memory_bytes()
        if self.host_budget_bytes is not None and self.host_budget_bytes > physical:
            accepted = f"None or an int in [{self.page_size_bytes}, {physical}] (bytes)"
            raise ZeroConfigError(
                f"host_budget_bytes={self.host_budget_bytes!r} is invalid: expected "
                f"{accepted}; it exceeds this machine's physical memory, {physical} bytes "
                f"({physical / GIB:.1f} GiB)",
                key="host_budget_bytes",
                value=self.host_budget_bytes,
                accepted=accepted,
            )

    # -- conversions ---------------------------------------------------------------

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """All key names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every key (JSON-serialisable: int, float, str, bool, None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ZeroConfig:
        """Build a validated config from a mapping; missing keys take their defaults.

        Raises:
            ZeroConfigError: ``d`` is not a mapping; an unknown key (the message suggests
                the nearest known key, e.g. "unknown key 'offload_optimiser'; did you mean
                'offload_optimizer'?"); any invalid value.
        """
        if not isinstance(d, Mapping):
            raise ZeroConfigError(
                f"config must be a mapping of key -> value, got {type(d).__name__}"
            )
        known = cls.keys()
        for key in d:
            if key not in known:
                raise unknown_key_error(key, known)
        return cls(**d)

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text of ``to_dict()``; ``from_json(to_json())`` equals ``self``."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, path_or_str: str | os.PathLike[str]) -> ZeroConfig:
        """Load from JSON text (a string starting with ``{``) or from a JSON file path.

        Raises:
            ZeroConfigError: invalid JSON, not an object (e.g. ``"[1, 2]"``), unknown keys,
                invalid values.
            ZeroConfigFileNotFoundError: a path where no file exists (also a
                ``FileNotFoundError``); the message names the path and what is accepted.
            OSError: an existing file cannot be read.
        """
        return cls.from_dict(load_json_object(path_or_str))

    def replace(self, **changes: Any) -> ZeroConfig:
        """A validated copy with ``changes`` applied.

        Raises:
            ZeroConfigError: unknown key (with a suggestion) or invalid resulting config.
        """
        return type(self).from_dict({**self.to_dict(), **changes})

    @classmethod
    def from_deepspeed(
        cls,
        ds_config: Mapping[str, Any] | str | os.PathLike[str],
        *,
        hidden_size: int | None = None,
    ) -> ZeroConfig:
        """Build from a DeepSpeed config (dict, JSON text or JSON file path).

        See ``zero_runtime.config.deepspeed.from_deepspeed_config`` and docs/config.md for
        the key mapping. Keys with no counterpart are ignored with one
        ``DeepSpeedKeyIgnoredWarning`` each; keys DeepSpeed itself rejects (and misspelt
        sections) raise.

        Args:
            ds_config: the DeepSpeed config.
            hidden_size: the model's hidden size (elements, int >= 1) to resolve the
                ``"auto"`` bucket sizes as the Hugging Face Trainer does; None (default)
                resolves them to our defaults with a warning.

        Raises:
            ZeroConfigError: invalid values, an ``"auto"`` value that has no sensible
                default here, JSON text that is not an object (e.g. ``"[1, 2]"``), or an
                argument of another type.
            ZeroConfigFileNotFoundError: a path where no file exists (also a
                ``FileNotFoundError``); the message names it and what is accepted.
        """
        return from_deepspeed_config(cls, ds_config, hidden_size)
