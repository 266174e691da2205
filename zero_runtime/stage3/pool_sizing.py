"""Default tier budgets of the stage-3 engine's paged pool.

:func:`size_pool` sizes the pool before any shard exists, from the layers' weight shapes:
the device tier holds every gathered buffer + slack (+ the shards when
``offload_param='none'``), the host tier the shards (packed in the flat space on
host/NVMe, :mod:`zero_runtime.memory.flat_store`) or, with NVMe, a window of the two
largest blocks (the four largest units on the units path); a row-paged table counts its
row cache and row states (:func:`~zero_runtime.stage3.embedding.row_paging_budget`). Given budgets
(``device_budget_bytes``, ``host_budget_bytes``) are used as they are.
"""

from __future__ import annotations

import math

import psutil

from zero_runtime.config import ZeroConfig
from zero_runtime.memory import PagedBufferPool
from zero_runtime.memory.flat_store import SPACE_TIERS
from zero_runtime.sharded_variable import least_padding_dim
from zero_runtime.stage3.embedding import STATE_TIER, row_paging_applies, row_paging_budget

SLACK_PAGES = 8  # pages added to default tier budgets (rounding, transient placement)


def gathered_pages(shape: tuple[int, ...], num_shards: int, local: int, page: int) -> int:
    """Pages of one float32 variable's gathered buffers over ``local`` replicas: its
    ``num_shards`` shards of ``ceil(shape[d] / num_shards)`` rows each along the axis
    ``d`` that ``Stage3Engine.shard_variable`` splits (:func:`least_padding_dim`),
    rounded up to ``page`` bytes per replica."""
    shape = tuple(shape) or (1,)
    d = least_padding_dim(shape, num_shards)
    rows = -(-shape[d] // num_shards)
    rest = math.prod(shape[:d] + shape[d + 1 :])
    return local * max(1, -(-4 * num_shards * rows * rest // page))


def size_pool(
    layers: list,
    config: ZeroConfig,
    tier: str,
    num_shards: int,
    local: int,
    units: bool,
) -> tuple[PagedBufferPool, int]:
    """The stage-3 pool for ``layers`` and the device budget it was given.

    Args:
        layers: the blocks' layers (a chain) or the units' layers (units path).
        config: the ZeRO config (page size, budgets, ``offload_param`` /
            ``offload_optimizer``, NVMe path and budget).
        tier: the parameter shards' tier, ``'device'``, ``'host'`` or ``'nvme'``.
        num_shards: replicas the parameters are sharded over.
        local: replicas whose shards and buffers this process's pool holds.
        units: True on the units path (its NVMe host window: four units), False on the
            block engine (two blocks).

    Returns:
        ``(pool, device_budget_bytes)``: the :class:`PagedBufferPool` and its device-tier
        capacity in bytes (the engine's ``default_device_budget`` when
        ``device_budget_bytes`` is None).
    """
    page = config.page_size_bytes
    n = num_shards
    local = local  # replicas whose shards and buffers this pool holds

    def pages(elements: int) -> int:
        return max(1, -(-4 * elements // page))

    per_block_shard_pages, per_block_gathered_pages = [], []
    window_pages = []  # per block, what an NVMe-tier step holds on the host at once
    state_tier = STATE_TIER[config.offload_optimizer]
    state_tier = "host" if state_tier == "nvme" and tier != "nvme" else state_tier
    row_states = dict.fromkeys(("device", "host", "nvme"), 0)  # row optimizer pages
    row_shard_pages = []  # per row-paged table, its row pages
    packed_elements = 0  # shard elements of one replica in the flat space (host/NVMe)
    for layer in layers:
        if row_paging_applies(layer, config):
            # A row-paged table is never gathered whole: its row pages on their tier,
            # a row cache on the device, its row states (embedding.row_paging_budget).
            b = row_paging_budget(tuple(layer.embeddings.shape), page, n, local)
            row_shard_pages.append(b.shard_pages)
            per_block_shard_pages.append(b.shard_pages)
            per_block_gathered_pages.append(b.cache_pages)
            window_pages.append(b.cache_pages)
            row_states[state_tier] += b.state_pages
            continue
        shard_pages = gathered = elements = 0
        for v in layer.trainable_variables:
            shape = tuple(v.shape) or (1,)
            d = 0  # the axis shard_variable splits (see shard_variable)
            rows = -(-shape[d] // n)
            rest = math.prod(shape[:d] + shape[d + 1 :])
            shard_pages += local * pages(rows * rest)
            gathered += gathered_pages(shape, n, local, page)
            elements += rows * rest
        packed_elements += elements
        if tier in SPACE_TIERS:
            # Packed in the flat space: the block's range, + one chunk it may straddle.
            shard_pages = local * (pages(elements) + 1) if elements else 0
        per_block_shard_pages.append(shard_pages)
        per_block_gathered_pages.append(gathered)
        window_pages.append(shard_pages)
    all_shards = sum(per_block_shard_pages)
    if tier in SPACE_TIERS:  # the flat space: whole chunks, one partial per replica
        all_shards = sum(row_shard_pages) + local * pages(packed_elements)
    all_gathered = sum(per_block_gathered_pages)
    device = config.device_budget_bytes
    if device is None:
        device_pages = all_gathered + SLACK_PAGES + (all_shards if tier == "device" else 0)
        device = (device_pages + row_states["device"]) * page
    host = config.host_budget_bytes
    if host is None:
        if tier == "nvme":
            # A window: the two largest blocks' shards (the block in use and the one
            # prefetched next) + slack. prefetch_bucket_size is not added: a deeper
            # prefetch competes for this window (the pool evicts LRU host pages to
            # NVMe) instead of growing the default host reservation.
            # On the units path the four largest units': the unit read, the previous
            # one until its update in backward, and room for the prefetch of the next
            # ones (stage3/schedule.py: half of what the two leave).
            window = sorted(window_pages)[-4 if units else -2 :]
            host = (sum(window) + SLACK_PAGES + row_states["host"]) * page
        else:
            # The shards + room for gathered buffers the pool moves down under device
            # pressure (a device budget below them, given or lowered live), capped so
            # the reservation stays within half of the memory available now.
            base = all_shards + SLACK_PAGES + row_states["host"]
            room = psutil.virtual_memory().available // 2 // page - base
            host = (base + max(0, min(all_gathered, room))) * page
    pool = PagedBufferPool(
        host_budget_bytes=host,
        page_size_bytes=page,
        device_budget_bytes=device,
        nvme_path=str(config.nvme_path) if tier == "nvme" else None,
        nvme_budget_bytes=config.nvme_budget_bytes if tier == "nvme" else None,
    )
    return pool, device
