"""The device tier of a stage-3 step, planned before anything is sharded.

A stage-3 step holds on each replica's device (the device tier; on a host without a GPU
the budgeted CPU stand-in):

- *shards*: the replica's parameter shards when ``offload_param='none'`` (TensorFlow
  variables on its device; the pool reserves their pages, pinned);
- *frozen*: the frozen (non-trainable) weights, replicated as under MirroredStrategy;
- *gathered*: the gathered parameters of the units in use, TensorFlow tensors outside
  the pool: a use waits for the previous use's reduce-scatter, so at most
  :data:`UNITS_LIVE` units are gathered at once (:mod:`zero_runtime.stage3.gather`;
  ``tests/test_stage3_device_peak.py`` measures 2.07-2.2 units). A unit counts its
  all-gather's output, ``4 * N * shard_elements`` bytes (float32 views; a 16-bit gather
  under a mixed policy is widened to float32 views of the same size); a tiled unit
  (:mod:`zero_runtime.stage3.tiling`) its widest tile and its other variables whole;
- *row cache*: a row-paged table's row pages acquired on the device: at least
  ``ROW_CACHE_MIN_PAGES`` per local replica (:mod:`zero_runtime.stage3.embedding`); the
  pool moves the least recently used down to the host when the device tier is full,
  whichever tier ``offload_param`` starts them on.

:func:`plan_device` sums these over the process's local replicas (a
:class:`DevicePlan`); :func:`check_budget` refuses a config whose int
``device_budget_bytes`` is below the sum, naming the figures and the fixes. The pool's
device tier gets the budget minus what lies outside it (gathered and frozen), so row
pages cached on the device never push the step above the budget. Not counted: the
activations and the reduced gradient shards TensorFlow holds (the latter are in the
tiers record: :mod:`zero_runtime.stage3.telemetry`).

:func:`tile_budget` is the tile size the units path uses: ``tile_size`` resolved against
the budget, and at most ``max_live_parameters // UNITS_LIVE`` elements, so that no unit
gathers more than ``max_live_parameters`` elements with the other unit live;
:func:`check_max_live` refuses a unit that cannot be tiled below it.
"""

from __future__ import annotations

import dataclasses
import math

import keras

from zero_runtime.config import ZeroConfig
from zero_runtime.oom_report import fmt_bytes
from zero_runtime.sharded_variable import least_padding_dim
from zero_runtime.stage3 import tiling
from zero_runtime.stage3.embedding import ROW_CACHE_MIN_PAGES, row_paging_applies, row_paging_budget

#: Gathered units a replica holds at once, at most: the unit in use and the next one (its
#: gather may start while the previous unit's views are still read; in backward a use's
#: gather waits for the previous use's reduce-scatter).
UNITS_LIVE = 2


@dataclasses.dataclass(frozen=True)
class UnitGather:
    """What one unit gathers per use on one replica.

    Attributes:
        name: the unit's layer name (``'mlp (1 of 4 tiles)'`` when tiled).
        elements: logical parameter elements gathered at once (a tiled unit: the widest
            tile's kernel columns and its other variables whole).
        nbytes: bytes of the all-gather output, float32, padding included.
    """

    name: str
    elements: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Device-tier bytes of one step over this process's local replicas (see the module
    docstring; all bytes).

    Attributes:
        shards: device-tier parameter shards (pages, ``offload_param='none'``), else 0.
        frozen: frozen weights, replicated on each local replica.
        gathered: ``UNITS_LIVE`` x the largest unit's gathered bytes x local replicas.
        row_cache: ``ROW_CACHE_MIN_PAGES`` row pages per local replica per row-paged
            table (pages).
        largest: the largest unit's :class:`UnitGather` (None without dense units).
        local: local replicas.
    """

    shards: int
    frozen: int
    gathered: int
    row_cache: int
    largest: UnitGather | None
    local: int

    @property
    def total(self) -> int:
        """Bytes the step needs on the device tier: the sum of the four parts."""
        return self.shards + self.frozen + self.gathered + self.row_cache

    @property
    def outside_pool(self) -> int:
        """Bytes held by TensorFlow outside the pool: gathered and frozen."""
        return self.gathered + self.frozen

    def describe(self) -> str:
        """The figures as text (binary units), for errors and logs."""
        unit = "no unit gathered"
        if self.largest is not None:
            unit = (
                f"{UNITS_LIVE} gathered units x {self.local} replicas of the largest, "
                f"{self.largest.name!r} ({self.largest.elements} elements, "
                f"{fmt_bytes(self.largest.nbytes)} gathered)"
            )
        return (
            f"{fmt_bytes(self.total)}: device-tier shards {fmt_bytes(self.shards)}, frozen "
            f"weights {fmt_bytes(self.frozen)}, {unit}: {fmt_bytes(self.gathered)}, row "
            f"caches {fmt_bytes(self.row_cache)}"
        )


def tile_budget(config: ZeroConfig) -> int | None:
    """The units path's tile size in elements, or None (no tiling).

    ``tile_size`` resolved against ``device_budget_bytes``
    (:func:`~zero_runtime.stage3.tiling.resolve_tile_size`), capped at
    ``max_live_parameters // UNITS_LIVE`` (at least 1): a wider ``Dense`` /
    ``EinsumDense`` / ``Embedding`` kernel runs as column tiles, so that ``UNITS_LIVE``
    gathered units stay within ``max_live_parameters`` elements.
    """
    size = tiling.resolve_tile_size(config.tile_size, config.device_budget_bytes)
    cap = max(1, config.max_live_parameters // UNITS_LIVE)
    return cap if size is None else min(size, cap)


def unit_gather(layer: keras.layers.Layer, originals: tuple, config: ZeroConfig, n: int):
    """The :class:`UnitGather` of a unit (its layer and its trainable originals, Keras or
    sharded variables) over ``n`` replicas under ``config``'s tile budget."""
    tile = tile_budget(config)
    plan = tiling.plan_tiles(layer, tuple(originals), tile)
    if plan is None:
        dims = [0 if tile is not None and math.prod(v.shape) > tile else None for v in originals]
        nbytes = sum(_gathered_bytes(tuple(v.shape), n, d) for v, d in zip(originals, dims))
        elements = sum(math.prod(v.shape) for v in originals)
        return UnitGather(layer.name, elements, nbytes)
    kernel = tuple(plan.kernel.shape)
    width = max(size for _, size in plan.bounds)
    per_col = math.prod(kernel) // kernel[plan.kernel_axis]
    tile_shape = list(kernel)
    tile_shape[plan.kernel_axis] = width
    others = [tuple(v.shape) for v, _ in plan.others]
    nbytes = _gathered_bytes(tuple(tile_shape), n, 0) + sum(_gathered_bytes(s, n) for s in others)
    elements = per_col * width + sum(math.prod(s) for s in others)
    name = f"{layer.name} (1 of {len(plan.bounds)} tiles)"
    return UnitGather(name, elements, nbytes)


def plan_device(
    specs, config: ZeroConfig, num_shards: int, local: int, frozen_bytes: int
) -> DevicePlan:
    """The :class:`DevicePlan` of the units ``specs``
    (:func:`~zero_runtime.stage3.units.plan_units`).

    Args:
        specs: the model's unit specs (before sharding).
        config: the stage-3 config (``offload_param``, page size, tile budget, threshold).
        num_shards: N, replicas.
        local: replicas of this process.
        frozen_bytes: bytes of the frozen weights of one replica.
    """
    page = config.page_size_bytes
    device = config.offload_param == "none"
    shards = row_cache = 0
    gathers = []
    for spec in specs:
        if row_paging_applies(spec.layer, config):
            b = row_paging_budget(tuple(spec.layer.embeddings.shape), page, num_shards, local)
            row_cache += local * min(ROW_CACHE_MIN_PAGES, b.pages_per_shard) * page
            continue
        gathers.append(unit_gather(spec.layer, spec.originals, config, num_shards))
        if device:
            for v in spec.originals:
                elements = _gathered_bytes(tuple(v.shape), num_shards) // 4 // num_shards
                shards += local * max(1, -(-4 * elements // page)) * page
    largest = max(gathers, key=lambda g: g.nbytes, default=None)
    gathered = 0 if largest is None else UNITS_LIVE * largest.nbytes * local
    return DevicePlan(shards, frozen_bytes * local, gathered, row_cache, largest, local)


def check_budget(plan: DevicePlan, config: ZeroConfig, model_name: str) -> None:
    """Refuse an int ``device_budget_bytes`` below ``plan.total``.

    Raises:
        ValueError: naming the budget, the figures of the plan and the fixes
            (``tile_size``, ``offload_param``, a larger budget).
    """
    budget = config.device_budget_bytes
    if not isinstance(budget, int) or budget >= plan.total:
        return
    fixes = []
    if config.tile_size is None:
        fixes.append(
            "tile_size='auto' (or an int) to gather wide Dense / EinsumDense / Embedding "
            "kernels in column tiles"
        )
    else:
        fixes.append("a smaller tile_size")
    if config.offload_param == "none" and plan.shards:
        fixes.append("offload_param='cpu' or 'nvme' to keep the shards off the device")
    fixes.append(f"device_budget_bytes >= {plan.total}")
    raise ValueError(
        f"stage 3: a training step of model {model_name!r} needs {plan.describe()} on the "
        f"device tier of this process, above device_budget_bytes={budget} "
        f"({fmt_bytes(budget)}). Set " + ", or ".join(fixes)
    )


def check_max_live(specs, config: ZeroConfig, num_shards: int) -> None:
    """Refuse a unit whose gathered elements, with ``UNITS_LIVE - 1`` more like it, exceed
    ``max_live_parameters`` after tiling (:func:`tile_budget`): a layer that does not
    tile (a ``Conv2D``, a subclass of ``Dense``, a non-elementwise activation) or whose
    single output column is already too large.

    Raises:
        ValueError: naming the unit, its elements and the fixes.
    """
    bound = config.max_live_parameters
    for spec in specs:
        if row_paging_applies(spec.layer, config):
            continue
        g = unit_gather(spec.layer, spec.originals, config, num_shards)
        if UNITS_LIVE * g.elements > bound:
            raise ValueError(
                f"stage 3: unit {g.name!r} gathers {g.elements} parameter elements per "
                f"use, and {UNITS_LIVE} units may be gathered at once: above "
                f"max_live_parameters={bound}. It does not tile below that (only an exact "
                "Dense, EinsumDense or Embedding with an elementwise activation tiles, by "
                f"output columns). Raise max_live_parameters to >= {UNITS_LIVE * g.elements}"
                ", or split the layer"
            )


def _gathered_bytes(shape: tuple[int, ...], n: int, dim: int | None = None) -> int:
    """Bytes of one variable's all-gather output, float32: ``N`` shards of
    ``ceil(shape[d] / N)`` rows along ``d`` (:func:`least_padding_dim` unless ``dim``)."""
    shape = tuple(shape) or (1,)
    d = least_padding_dim(shape, n) if dim is None else dim
    rows = -(-shape[d] // n)
    return 4 * n * rows * math.prod(shape[:d] + shape[d + 1 :])
