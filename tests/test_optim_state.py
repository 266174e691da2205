"""zero_runtime.optim: host kernels (tiled == whole), host and NVMe state stores."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from zero_runtime.memory import PageState
from zero_runtime.optim import kernels
from zero_runtime.optim.host_state import HostOptimizerState
from zero_runtime.optim.layout import FlatLayout
from zero_runtime.optim.nvme_state import NvmeOptimizerState

B1, B2, EPS, ALPHA = np.float32(0.1), np.float32(0.001), np.float32(1e-7), np.float32(0.01)


def _adam_step(slots, scratch, param, grad):
    kernels.adam_update(
        param, grad, slots["m"], slots["v"], ALPHA, B1, B2, EPS, scratch[0], scratch[1]
    )


def _layout(n=3000, shards=2, bucket=None):
    return FlatLayout.from_variables(
        [SimpleNamespace(shape=(n // 3,), path=f"v{i}") for i in range(3)], shards, bucket
    )


def _whole_adam(param, grad, m, v):
    s1, s2 = np.empty_like(param), np.empty_like(param)
    kernels.adam_update(param, grad, m, v, ALPHA, B1, B2, EPS, s1, s2)


def test_tiles_cover_the_range():
    assert list(kernels.tiles(10, 4)) == [(0, 4), (4, 8), (8, 10)]
    with pytest.raises(ValueError):
        list(kernels.tiles(3, 0))


@pytest.mark.parametrize("store_kind", ["host", "nvme"])
def test_store_update_equals_whole_array_adam(store_kind, tmp_path):
    layout = _layout(bucket=1000)
    if store_kind == "host":
        store = HostOptimizerState(layout, ("m", "v"), tile=64)
    else:
        store = NvmeOptimizerState(
            layout, ("m", "v"), str(tmp_path), sub_group_size=300, page_size_bytes=65536, tile=64
        )
    rng = np.random.default_rng(0)
    n = layout.shard_size
    ref = {
        r: (
            rng.standard_normal(n, dtype=np.float32),
            np.zeros(n, np.float32),
            np.zeros(n, np.float32),
        )
        for r in range(2)
    }
    params = {r: ref[r][0].copy() for r in range(2)}
    active = (True, False, True)
    for _ in range(3):
        for r in range(2):
            grad = rng.standard_normal(n, dtype=np.float32)
            ranges = layout.active_ranges(r, active)
            store.update(r, ranges, params[r], grad, _adam_step)
            p, m, v = ref[r]
            for s, e in ranges:
                _whole_adam(p[s:e], grad[s:e], m[s:e], v[s:e])
    for r in range(2):
        np.testing.assert_array_equal(params[r], ref[r][0])
    m_flat = layout.unshard([ref[r][1] for r in range(2)])
    np.testing.assert_array_equal(store.slot_values("m"), m_flat)
    assert store.updates(0) == 3
    if store_kind == "nvme":
        assert store.num_subgroups == 5  # shard of 1500 in sub-groups of 300
    store.close()


def test_nvme_store_streams_subgroups_and_leaves_states_on_nvme(tmp_path):
    layout = _layout()
    store = NvmeOptimizerState(
        layout, ("m", "v"), str(tmp_path), sub_group_size=300, page_size_bytes=65536
    )
    assert store.num_subgroups == 5 and store.subgroup_range(4) == (1200, 1500)
    param = np.zeros(layout.shard_size, np.float32)
    grad = np.ones(layout.shard_size, np.float32)
    store.update(0, ((0, layout.shard_size),), param, grad, _adam_step)
    for j in range(store.num_subgroups):
        info = store.pool.describe(store.tensor_id(0, j, "m"))
        states = [p.state for p in info.pages]
        assert all(st is PageState.ON_NVME for st in states), (j, states)
    counters = store.step_boundary(0)
    assert counters.h2n_pages == 2 * 5  # every slot of every sub-group written behind
    host, nvme = store.usage()["host"], store.usage()["nvme"]
    assert nvme[0] == 2 * 5 * 65536 and host[0] == 0
    assert store.state_bytes == 2 * 4 * layout.shard_size
    store.close()


def test_host_state_lazy_and_validated():
    store = HostOptimizerState(_layout(), ("m",))
    assert store.state_bytes == 0
    with pytest.raises(ValueError, match="out of range"):
        store.shard(2)
    store.shard(1)
    assert store.usage() == {"host": (4 * 1500, 2 * 4 * store.tile)}
