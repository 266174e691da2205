"""Default tier budgets of the stage-3 engine's paged pool.

:func:`size_pool` sizes the pool before any shard exists, from the units' weight shapes.
The pool holds the parameter shards (on the tier ``offload_param`` selects; on host/NVMe
packed in the flat space, :mod:`zero_runtime.memory.flat_store`), the row-paged tables'
row pages and row optimizer states (:func:`~zero_runtime.stage3.embedding.row_paging_budget`);
the gathered units are TensorFlow tensors outside it
(:mod:`zero_runtime.stage3.device_plan`). Defaults: the device tier holds the device-tier
shards, the row caches and device row states + slack; the host tier the host shards (or,
with device shards, the row pages a smaller device tier moves down) + slack, or with
NVMe a window of the four largest units. A given ``device_budget_bytes``
less what the step holds outside the pool becomes its device capacity; a given
``host_budget_bytes`` is used as it is.
"""

from __future__ import annotations

import math

from zero_runtime.config import ZeroConfig
from zero_runtime.memory import PagedBufferPool
from zero_runtime.memory.flat_store import SPACE_TIERS
from zero_runtime.sharded_variable import least_padding_dim
from zero_runtime.stage3.embedding import STATE_TIER, row_paging_applies, row_paging_budget

SLACK_PAGES = 8  # pages added to default tier budgets (rounding, transient placement)


def size_pool(
    layers: list,
    config: ZeroConfig,
    tier: str,
    num_shards: int,
    local: int,
    outside_bytes: int,
) -> tuple[PagedBufferPool, int]:
    """The stage-3 pool for the units' ``layers`` and its device-tier capacity.

    Args:
        layers: the units' layers.
        config: the ZeRO config (page size, budgets, ``offload_param`` /
            ``offload_optimizer``, NVMe path and budget).
        tier: the parameter shards' tier, ``'device'``, ``'host'`` or ``'nvme'``.
        num_shards: replicas the parameters are sharded over.
        local: replicas whose shards this process's pool holds.
        outside_bytes: device-tier bytes the step holds outside the pool (gathered
            units, frozen weights: :attr:`DevicePlan.outside_pool`), subtracted from an
            int ``device_budget_bytes``.

    Returns:
        ``(pool, device_bytes)``: the :class:`PagedBufferPool` and its device-tier
        capacity in bytes (at least one page).
    """
    page = config.page_size_bytes
    n = num_shards

    def pages(elements: int) -> int:
        return max(1, -(-4 * elements // page))

    window_pages = []  # per unit, what an NVMe-tier step holds on the host at once
    state_tier = STATE_TIER[config.offload_optimizer]
    state_tier = "host" if state_tier == "nvme" and tier != "nvme" else state_tier
    row_states = dict.fromkeys(("device", "host", "nvme"), 0)  # row optimizer pages
    row_shard_pages = row_cache_pages = 0  # the row-paged tables' row pages, caches
    packed_elements = 0  # shard elements of one replica in the flat space (host/NVMe)
    own_pages = 0  # shards stored one pool tensor per variable (the device tier)
    for layer in layers:
        if row_paging_applies(layer, config):
            # Never gathered whole: its row pages on their tier, a row cache on the
            # device, its row states (embedding.row_paging_budget).
            b = row_paging_budget(tuple(layer.embeddings.shape), page, n, local)
            row_shard_pages += b.shard_pages
            row_cache_pages += b.cache_pages
            window_pages.append(b.cache_pages)
            row_states[state_tier] += b.state_pages
            continue
        elements = 0
        for v in layer.trainable_variables:
            shape = tuple(v.shape) or (1,)
            d = least_padding_dim(shape, n)  # the axis shard_variable splits
            rows = -(-shape[d] // n)
            shard = rows * math.prod(shape[:d] + shape[d + 1 :])
            own_pages += local * pages(shard)
            elements += shard
        packed_elements += elements
        # Packed in the flat space: the unit's range, + one chunk it may straddle.
        window_pages.append(local * (pages(elements) + 1) if elements else 0)
    shards = own_pages + row_shard_pages
    if tier in SPACE_TIERS:  # the flat space: whole chunks, one partial per replica
        shards = row_shard_pages + local * pages(packed_elements)
    device = config.device_budget_bytes
    if device is None:
        device_pages = (shards if tier == "device" else row_cache_pages) + SLACK_PAGES
        device = (device_pages + row_states["device"]) * page
    else:
        device = max(page, (device - outside_bytes) // page * page)
    host = config.host_budget_bytes
    if host is None:
        if tier == "nvme":
            # A window: the four largest units' shards (the unit read, the previous one
            # until its update in backward, and room for the prefetch of the next ones,
            # stage3/schedule.py: half of what the two leave) + slack.
            # prefetch_bucket_size is not added: a deeper prefetch competes for this
            # window (the pool evicts LRU host pages to NVMe) instead of growing the
            # default host reservation.
            window = sorted(window_pages)[-4:]
            host = (sum(window) + SLACK_PAGES + row_states["host"]) * page
        else:
            # The host shards; with device shards, room for the row pages a smaller
            # device tier moves down (least recently used first).
            base = shards if tier == "host" else row_shard_pages
            host = (base + SLACK_PAGES + row_states["host"]) * page
    pool = PagedBufferPool(
        host_budget_bytes=host,
        page_size_bytes=page,
        device_budget_bytes=device,
        nvme_path=str(config.nvme_path) if tier == "nvme" else None,
        nvme_budget_bytes=config.nvme_budget_bytes if tier == "nvme" else None,
    )
    return pool, device
