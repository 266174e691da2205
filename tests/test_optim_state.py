"""zero_runtime.optim: host kernels (tiled == whole), host and NVMe state stores."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import psutil
import pytest

from zero_runtime.memory import PageState
from zero_runtime.memory.access import PageAccess
from zero_runtime.optim import fused, kernels
from zero_runtime.optim.host_state import HostOptimizerState
from zero_runtime.optim.layout import FlatLayout
from zero_runtime.optim.nvme_state import (
    WINDOW_SHARE,
    NvmeOptimizerState,
    bounded_subgroup,
    window_bytes,
)

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


def test_nvme_partial_updates_move_each_subgroup_once_per_step(tmp_path):
    """The stage-3 update in backward updates a shard block by block (``count=False``,
    then ``mark_updated``). A sub-group spanning several blocks is read from NVMe once and
    written back once per step, when the step has changed all of it or at its end; it was
    read and written once per block (bench_stage3_nvme: 3x the bytes). The states equal
    one whole-array Adam step's."""
    layout = _layout()  # a shard of 1500 elements: one sub-group, 1 page per slot
    store = NvmeOptimizerState(
        layout, ("m", "v"), str(tmp_path), sub_group_size=1500, page_size_bytes=65536
    )
    rng = np.random.default_rng(1)
    n = layout.shard_size
    param = rng.standard_normal(n, dtype=np.float32)
    ref, m, v = param.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    for step in range(2):
        grad = rng.standard_normal(n, dtype=np.float32)
        for lo in (1000, 500, 0):  # blocks in backward order
            store.update(0, ((lo, lo + 500),), param, grad, _adam_step, count=False, step=step)
        store.mark_updated(0)
        _whole_adam(ref, grad, m, v)
        c = store.step_boundary(step)
        assert c.h2n_pages == 2, c  # m and v written once (was once per block: 6)
        assert c.n2h_pages == (0 if step == 0 else 2), c  # read once (was 6)
        info = [store.pool.describe(store.tensor_id(0, 0, x)) for x in ("m", "v")]
        assert all(p.state is PageState.ON_NVME for i in info for p in i.pages)
    np.testing.assert_array_equal(param, ref)
    np.testing.assert_array_equal(store.read_shard(0, "m"), m)
    assert store.updates(0) == 2
    store.close()


def _on_host(store, j, timeout=10.0):
    """Wait until both slots of sub-group ``j`` (replica 0) are all on the host (read
    from NVMe: clean)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = [store.pool.describe(store.tensor_id(0, j, x)) for x in ("m", "v")]
        on_host = (PageState.ON_HOST, PageState.ON_HOST_CLEAN)
        if all(p.state in on_host for i in info for p in i.pages):
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("noted", [True, False])
def test_a_noted_next_call_has_its_subgroup_read_ahead_during_the_current_one(noted, tmp_path):
    """The stage-3 update in backward notes each block as its gradient is queued
    (``expect``); while a call updates its own sub-groups the store reads the next noted
    call's first sub-group ahead, so that call's read does not wait for the disk. Without
    the note nothing beyond the call's own sub-groups is read. Results equal whole-array
    Adam either way."""
    per = 16384  # one 64 KiB page of float32 per sub-group and slot
    layout = _layout(6 * per)  # a shard of 3 sub-groups per replica
    store = NvmeOptimizerState(
        layout, ("m", "v"), str(tmp_path), sub_group_size=per, page_size_bytes=65536
    )
    rng = np.random.default_rng(3)
    n = layout.shard_size
    param = rng.standard_normal(n, dtype=np.float32)
    ref, m, v = param.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    blocks = [(2 * per, 3 * per), (per, 2 * per), (0, per)]  # backward order
    for step in range(2):
        grad = rng.standard_normal(n, dtype=np.float32)
        if noted:
            for b in blocks:
                store.expect(0, (b,))
        for i, b in enumerate(blocks):
            store.update(0, (b,), param, grad, _adam_step, count=False, step=step)
            if step == 1 and i < 2:
                # The next call's sub-group was on NVMe: this call read it ahead iff the
                # next call was noted.
                assert _on_host(store, 1 - i, timeout=10.0 if noted else 0.5) is noted
        store.mark_updated(0)
        _whole_adam(ref, grad, m, v)
        c = store.step_boundary(step)
        if step == 1:
            assert c.n2h_pages == 6, c  # every state page read once either way
    np.testing.assert_array_equal(param, ref)
    np.testing.assert_array_equal(store.read_shard(0, "m"), m)
    np.testing.assert_array_equal(store.read_shard(0, "v"), v)
    assert not store._record(0).expected  # noqa: SLF001 (the step's notes are dropped)
    store.close()


def test_a_multi_page_subgroup_is_updated_in_its_pages_across_partial_updates(
    tmp_path, monkeypatch
):
    """A sub-group of several pages is updated in its pages' own memory
    (``PagedBufferPool.acquire_pages``): no contiguous copy in (``materialise``), none
    back (``write_back``; copies in and back cost once per step, or once per block).
    Updated block by block (the stage-3 update in backward),
    it stays acquired between the blocks (``NvmeOptimizerState._hold``), pinned; the
    states equal one whole-array Adam step's, and a rollback in the middle of a step
    puts them back bitwise and unpins them."""
    writes = []
    real_back, real_copy = PageAccess.write_back, PageAccess.materialise
    monkeypatch.setattr(PageAccess, "write_back", lambda a, e: (writes.append(1), real_back(a, e)))
    monkeypatch.setattr(
        PageAccess, "materialise", lambda a, e, t, w: (writes.append(2), real_copy(a, e, t, w))[1]
    )
    layout = _layout(n=3 * 20_000)  # a shard of 30 000 elements: 2 pages per slot
    n = layout.shard_size
    store = NvmeOptimizerState(
        layout, ("m", "v"), str(tmp_path), sub_group_size=n, page_size_bytes=65536
    )
    rng = np.random.default_rng(2)
    param = rng.standard_normal(n, dtype=np.float32)
    ref, m, v = param.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    tids = [store.tensor_id(0, 0, x) for x in ("m", "v")]
    for step in range(2):
        grad = rng.standard_normal(n, dtype=np.float32)
        writes.clear()
        for lo in (20_000, 10_000, 0):  # blocks in backward order
            store.update(0, ((lo, lo + 10_000),), param, grad, _adam_step, count=False, step=step)
            if lo:  # held between blocks
                assert all(store.pool.describe(t).pinned for t in tids)
        store.mark_updated(0)
        assert writes == []
        _whole_adam(ref, grad, m, v)
        store.step_boundary(step)
        assert not any(store.pool.describe(t).pinned for t in tids)
    np.testing.assert_array_equal(param, ref)
    np.testing.assert_array_equal(store.read_shard(0, "m"), m)
    np.testing.assert_array_equal(store.read_shard(0, "v"), v)
    store.resolve(0, 2)  # step 1 committed (if not already)
    grad = rng.standard_normal(n, dtype=np.float32)
    store.update(0, ((20_000, n),), param.copy(), grad, _adam_step, count=False, step=2)
    assert store.rollback(0)  # mid-step, the sub-group held
    assert not any(store.pool.describe(t).pinned for t in tids)
    np.testing.assert_array_equal(store.read_shard(0, "m"), m)
    np.testing.assert_array_equal(store.read_shard(0, "v"), v)
    store.close()


def test_host_state_lazy_and_validated():
    store = HostOptimizerState(_layout(), ("m",))
    assert store.state_bytes == 0
    with pytest.raises(ValueError, match="out of range"):
        store.shard(2)
    store.shard(1)
    assert store.usage() == {"host": (4 * 1500, 2 * 4 * store.tile)}


def test_nvme_window_is_bounded_by_the_host_budget_at_any_sub_group_size(tmp_path, caplog):
    """DeepSpeed's default sub_group_size (1e9) over a shard of ~6 pages: the store
    streams whole-page sub-groups whose 3-sub-group window fits the host budget, says so
    once, and updates exactly as whole-array Adam."""
    page = 65536
    layout = _layout(n=3 * 65_000, shards=2)  # shard: 97,500 elements, ~6 pages per slot
    n = layout.shard_size
    budget = window_bytes(2 * page // 4, 2, 2, page)  # room for 2-page sub-groups
    with caplog.at_level("WARNING", logger="zero_runtime.optim.nvme_state"):
        store = NvmeOptimizerState(
            layout,
            ("m", "v"),
            str(tmp_path),
            sub_group_size=1_000_000_000,
            page_size_bytes=page,
            host_budget_bytes=budget,
        )
    assert store.sub_group_size == 2 * page // 4 and store.num_subgroups == 3
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "sub_group_size=1000000000" in said[0]
    assert f"more than the {budget} allowed (host_budget_bytes)" in said[0]
    assert f"sub-groups of {2 * page // 4} elements instead" in said[0]
    rng = np.random.default_rng(3)
    param = rng.standard_normal(n, dtype=np.float32)
    ref = (param.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32))
    peak = 0
    for step in range(2):
        grad = rng.standard_normal(n, dtype=np.float32)
        store.update(0, ((0, n),), param, grad, _adam_step)
        _whole_adam(ref[0], grad, ref[1], ref[2])
        peak = max(peak, store.pool.usage()["host"].peak_bytes)
        store.step_boundary(step)
    np.testing.assert_array_equal(param, ref[0])
    np.testing.assert_array_equal(store.read_shard(0, "v"), ref[2])
    assert 0 < peak <= budget  # the host held at most the window
    assert store.usage()["nvme"][0] == 2 * 3 * 2 * page  # all states on NVMe
    store.close()


def test_bounded_subgroup_keeps_a_fitting_request_and_rounds_down_to_pages():
    page = 65536
    assert bounded_subgroup(300, 2, 2, page, window_bytes(300, 2, 2, page)) == 300
    assert bounded_subgroup(10**9, 2, 2, page, 5 * window_bytes(1, 2, 2, page)) == 5 * page // 4
    assert bounded_subgroup(10**9, 2, 2, page, 1) == page // 4  # never below one page
    assert window_bytes(1, 0, 1, page) == 4 * page  # stateless optimizers: one buffer


def test_a_billion_element_layout_streams_a_window_of_a_quarter_of_free_memory(tmp_path):
    """The production default (no host budget): a 1B-parameter layout, 2 replicas, Adam,
    DeepSpeed's sub_group_size 1e9. Unbounded, the window would be 3 x 2 slots x 2
    replicas x 2 GB = 24 GB; the store takes whole-page sub-groups whose window fits
    WINDOW_SHARE of the available memory instead (its pool reserves that, uncommitted)."""
    layout = _layout(n=999_999_999, shards=2)  # 3 variables of 333,333,333 elements
    page = 4 << 20
    store = NvmeOptimizerState(
        layout, ("m", "v"), str(tmp_path), sub_group_size=1_000_000_000, page_size_bytes=page
    )
    try:
        available = psutil.virtual_memory().available
        window = window_bytes(store.sub_group_size, 2, 2, page)
        assert store.sub_group_size % (page // 4) == 0 and store.sub_group_size < layout.shard_size
        assert window <= WINDOW_SHARE * available * 1.05  # memory moves a little meanwhile
        assert store.pool.usage()["host"].capacity_bytes == window
        assert store.num_subgroups >= 2
    finally:
        store.close()


def test_past_its_host_journal_a_step_writes_a_new_generation_and_rolls_back_bitwise(tmp_path):
    """A host budget of exactly the window leaves the step journal no host room: each
    sub-group the step changes is copied to a new generation (shadow paging) and the
    previous one stays on NVMe, untouched, as the undo record. The step writes each
    state page once (no journal writes: the old copies leave the host clean); a rollback
    frees the new generation and reads back the old values bitwise; a commit frees the
    old generation."""
    page = 65536
    sub = 2 * page // 4
    layout = _layout(n=3 * 65_000, shards=2)
    n = layout.shard_size
    store = NvmeOptimizerState(
        layout,
        ("m", "v"),
        str(tmp_path),
        sub_group_size=sub,
        page_size_bytes=page,
        host_budget_bytes=window_bytes(sub, 2, 2, page),
    )
    assert store.journal_host_limit == 0 and store.num_subgroups == 3
    rng = np.random.default_rng(5)
    param = rng.standard_normal(n, dtype=np.float32)

    def ids() -> set[str]:
        return set(store.pool.tensor_ids())

    gen0 = {store.tensor_id(0, j, s, generation=0) for j in range(3) for s in ("m", "v")}
    gen1 = {store.tensor_id(0, j, s, generation=1) for j in range(3) for s in ("m", "v")}
    assert store.tensor_id(0, 2, "v") == "opt/r0/g2/v" and "opt/r0/g2.1/v" in gen1
    store.update(0, ((0, n),), param, rng.standard_normal(n, dtype=np.float32), _adam_step, step=0)
    assert ids() == gen0  # new sub-groups: nothing to keep, a rollback frees them
    assert store.resolve(0, 1) == "commit"
    before = {slot: store.read_shard(0, slot) for slot in ("m", "v")}
    store.step_boundary(0)
    store.update(0, ((0, n),), param, rng.standard_normal(n, dtype=np.float32), _adam_step, step=1)
    moved = store.step_boundary(1)
    # 3 sub-groups x 2 slots x 2 pages, each read once and written once; the old copies
    # left the host without a write.
    assert (moved.n2h_pages, moved.h2n_pages, moved.h2n_clean_pages) == (12, 12, 12)
    assert ids() == gen0 | gen1
    assert all(p.tier == "nvme" for t in gen0 | gen1 for p in store.pool.describe(t).pages)
    assert store.tensor_id(0, 0, "m") in gen1
    assert not np.array_equal(store.pool.read(store.tensor_id(0, 0, "m")), before["m"][:sub])
    assert store.rollback(0)
    assert ids() == gen0 and store.tensor_id(0, 0, "m") in gen0
    for slot in ("m", "v"):
        np.testing.assert_array_equal(store.read_shard(0, slot), before[slot])
    store.update(0, ((0, n),), param, rng.standard_normal(n, dtype=np.float32), _adam_step, step=1)
    after = {slot: store.read_shard(0, slot) for slot in ("m", "v")}  # resolves: commit
    assert ids() == gen1 and store.uncommitted(0) is None
    store.update(0, ((0, n),), param, rng.standard_normal(n, dtype=np.float32), _adam_step, step=2)
    assert ids() == gen0 | gen1 and store.tensor_id(0, 1, "v") in gen0  # back to generation 0
    assert store.rollback(0)
    for slot in ("m", "v"):
        np.testing.assert_array_equal(store.read_shard(0, slot), after[slot])
    assert store.pool.usage()["host"].peak_bytes <= window_bytes(sub, 2, 2, page)
    store.close()


def test_nvme_store_peak_counts_the_step_journal_freed_by_the_next_commit(tmp_path):
    """With room for the journal on the host, a step's undo journal (the old
    m and v of every sub-group it changed) is held in numpy until the step commits;
    ``nbytes`` read after the commit no longer sees it, ``peak_nbytes`` does."""
    page = 65536
    sub = 2 * page // 4
    layout = _layout(n=3 * 65_000, shards=2)
    n = layout.shard_size
    window = window_bytes(sub, 2, 2, page)
    budget = window + 2 * (2 * 4 * n)  # the window + a whole journal per replica
    store = NvmeOptimizerState(
        layout,
        ("m", "v"),
        str(tmp_path),
        sub_group_size=sub,
        page_size_bytes=page,
        host_budget_bytes=budget,
    )
    assert store.journal_host_limit == 2 * 4 * n
    rng = np.random.default_rng(7)
    param = rng.standard_normal(n, dtype=np.float32)
    grad = rng.standard_normal(n, dtype=np.float32)
    store.update(0, ((0, n),), param, grad, _adam_step, step=0)  # new sub-groups: no journal
    assert store.journal_host_bytes == 0 and store.resolve(0, 1) == "commit"
    store.reset_peak()
    store.update(0, ((0, n),), param, grad, _adam_step, step=1)
    assert store.journal_host_bytes == 2 * 4 * n  # old m and v of the whole shard
    store.resolve(0, 2)  # step 1 committed (if not already)
    assert store.journal_host_bytes == 0
    scratch = 2 * 4 * store.tile
    assert store.nbytes <= scratch + window  # the states went back to NVMe
    # The step held its whole journal plus at least one sub-group's m and v (2 pages each).
    assert store.peak_nbytes >= 2 * 4 * n + 2 * 2 * page + scratch
    assert store.peak_nbytes <= budget + scratch
    store.close()


def test_step_journals_count_the_parameter_journal_held_on_the_host_and_its_peak():
    """StepJournals.host_bytes is the float32 old shard values journalled now (every
    replica), 0 once the step commits; peak_host_bytes keeps the most held at once."""
    from zero_runtime.optim.transaction import StepJournals

    outcomes = {0: "commit", 1: "commit"}
    store = SimpleNamespace(resolve=lambda replica, step: outcomes[replica])
    journals = StepJournals(SimpleNamespace(zero_state=SimpleNamespace(store=store)))
    assert (journals.host_bytes, journals.peak_host_bytes) == (0, 0)
    journals.record_params(0, (), np.zeros(1000, np.float32))
    journals.record_params(1, (), np.zeros(250, np.float32))
    journals.record_params(0, (), np.zeros(10, np.float32))
    assert journals.host_bytes == 4 * (1000 + 250 + 10)
    assert journals.pending(0) and journals.pending(1)
    assert journals.resolve(0, 1) == "commit"
    assert journals.host_bytes == 4 * 250  # replica 1's step is still open
    assert journals.peak_host_bytes == 4 * 1260
    journals.resolve(1, 1)
    journals.record_params(0, (), np.zeros(5, np.float32))  # the next step, smaller
    assert journals.host_bytes == 20
    assert journals.peak_host_bytes == 4 * 1260


def test_step_journals_copy_the_values_into_buffers_the_next_step_reuses():
    """record_params copies the values (the update then changes the caller's buffer in
    place); a rollback writes back the copies; after a commit the next step's copies
    reuse the blocks the commit released, with no new allocation."""
    from zero_runtime.optim.transaction import StepJournals

    outcomes = {0: "commit"}
    written = []
    store = SimpleNamespace(
        resolve=lambda replica, step: outcomes[replica], rollback=lambda replica: None
    )
    optimizer = SimpleNamespace(
        zero_state=SimpleNamespace(store=store),
        _zero3_write_shards=lambda variables, replica, old: written.append(old.copy()),
    )
    journals = StepJournals(optimizer)
    n = 300_000  # 1.2 MB: past the staging pool's 1 MiB quantum, so recycled
    values = np.arange(n, dtype=np.float32)
    journals.record_params(0, (), values)
    values += 1.0  # the update in place, after the journal took its copy
    assert journals.resolve(0, 1) == "commit"
    assert journals.buffers.allocated == 1 and journals.buffers.idle_bytes >= 4 * n
    journals.record_params(0, (), values)  # the next step
    assert (journals.buffers.allocated, journals.buffers.reused) == (1, 1)
    values -= 5.0
    journals.rollback(0)
    assert len(written) == 1
    np.testing.assert_array_equal(written[0], np.arange(n, dtype=np.float32) + 1.0)
    assert journals.host_bytes == 0


# -- the fused (numba) kernels ----------------------------------------------------------
# Each case: (slot buffers, scalars, the kernel called on (param, grad, slots, scratch)).
# Data: normals over several magnitudes, with exact zeros (negative ones too) in the
# gradient, so that sign(0), max(0, |g|) and 0-steps are covered; 5 steps per case.
_F = np.float32
FUSED_CASES = {
    "adam": (2, lambda p, g, s, t: kernels.adam_update(p, g, *s, ALPHA, B1, B2, EPS, *t)),
    "sgd": (0, lambda p, g, s, t: kernels.sgd_update(p, g, _F(0.05), t[0])),
    "sgd_momentum": (
        1,
        lambda p, g, s, t: kernels.sgd_momentum_update(p, g, *s, _F(0.05), _F(0.9), False, *t),
    ),
    "sgd_nesterov": (
        1,
        lambda p, g, s, t: kernels.sgd_momentum_update(p, g, *s, _F(0.05), _F(0.9), True, *t),
    ),
    "rmsprop": (
        1,
        lambda p, g, s, t: kernels.rmsprop_update(
            p, g, s[0], None, None, _F(0.01), _F(0.9), _F(1 - 0.9), _F(0), EPS, *t
        ),
    ),
    "rmsprop_centered_momentum": (
        3,
        lambda p, g, s, t: kernels.rmsprop_update(
            p, g, *s, _F(0.01), _F(0.8), _F(1 - 0.8), _F(0.6), EPS, *t
        ),
    ),
    "adagrad": (1, lambda p, g, s, t: kernels.adagrad_update(p, g, *s, _F(0.05), EPS, *t)),
    "adamax": (
        2,
        lambda p, g, s, t: kernels.adamax_update(
            p, g, *s, _F(0.02), B1, _F(0.999), _F(0.19), EPS, *t
        ),
    ),
    "nadam": (
        2,
        lambda p, g, s, t: kernels.nadam_update(
            p, g, *s, _F(0.01), B1, B2, _F(0.9), _F(0.1), _F(0.07), _F(0.13), _F(0.002), EPS, *t
        ),
    ),
    "lion": (
        1,
        lambda p, g, s, t: kernels.lion_update(
            p, g, *s, _F(0.001), _F(0.9), _F(1) - _F(0.9), _F(0.99), _F(1) - _F(0.99), *t
        ),
    ),
    "ema": (1, lambda p, g, s, t: kernels.ema_update(s[0], p, _F(0.99), _F(0.01), False, *t)),
    "ema_overwrite": (
        1,
        lambda p, g, s, t: kernels.ema_update(s[0], p, _F(0.99), _F(0.01), True, *t),
    ),
}


@pytest.fixture
def restore_backend():
    """Put the process's host-kernel backend back as it was after the test."""
    before = fused.backend_info()
    yield
    fused.use(before["backend"], before.get("threads"))


@np.errstate(invalid="ignore")  # centered RMSprop: sqrt of a negative d is NaN in both
def _run_kernel(backend: str, case: str, threads: int = 1) -> list[np.ndarray]:
    """5 steps of ``case`` on the ``backend``'s kernels; every buffer at the end."""
    fused.use(backend, threads if backend == "numba" else None)
    nslots, kernel = FUSED_CASES[case]
    rng = np.random.default_rng(11)
    n = 10_007  # not a multiple of any vector width
    scale = np.float32(10.0) ** rng.integers(-6, 3, n).astype(np.float32)
    param = rng.standard_normal(n, dtype=np.float32) * scale
    slots = [np.abs(rng.standard_normal(n, dtype=np.float32)) * _F(1e-3) for _ in range(nslots)]
    scratch = (np.empty(n, np.float32), np.empty(n, np.float32))
    for _ in range(5):
        grad = rng.standard_normal(n, dtype=np.float32) * scale
        grad[::7] = 0.0
        grad[3::7] = -0.0
        kernel(param, grad, slots, scratch)
    return [param, *slots]


@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_fused_kernels_are_bitwise_the_numpy_kernels(case, restore_backend):
    """Each numba kernel is the NumPy kernel's operations in its order, in one pass:
    every output bit equal (signed zeros included), with 1 and 2 threads."""
    want = _run_kernel("numpy", case)
    for threads in (1, 2):
        got = _run_kernel("numba", case, threads)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))


def test_weight_decay_kernel_is_kerass_decay_in_a_tf_function():
    """Keras's ``variable.assign_sub(variable * wd * lr)`` runs inside the step's
    ``tf.function``, where Grappler computes ``variable * (wd * lr)``: the host kernel is
    bitwise that (the eager order ``(v * wd) * lr`` is not, on these values)."""
    import tensorflow as tf

    init = np.random.RandomState(0).normal(size=4096).astype(np.float32)
    var, lr = tf.Variable(init), tf.Variable(0.01)

    @tf.function
    def decay():  # keras/src/backend/tensorflow/optimizer.py, _apply_weight_decay
        var.assign_sub(var * tf.cast(0.1, tf.float32) * tf.cast(lr, tf.float32))

    decay()
    param = init.copy()
    kernels.weight_decay(param, _F(0.1), _F(lr.numpy()))
    np.testing.assert_array_equal(param.view(np.uint32), var.numpy().view(np.uint32))
    eager = init - init * _F(0.1) * _F(lr.numpy())
    assert np.any(eager != param)


@pytest.mark.parametrize("case", ["adam", "adamw", "adamw_ema"])
def test_fused_adam_is_bitwise_keras(case, restore_backend):
    """The fused host Adam against Keras's own ``Adam``/``AdamW`` on one variable, 6
    steps: AdamW's decoupled weight decay applied before the kernel as Keras applies it
    (``variable -= variable * wd * lr`` in TensorFlow), ``alpha`` computed in TensorFlow
    as Keras's ``update_step`` does, and, with ``use_ema``, the average by
    :func:`kernels.ema_update` with :func:`zero_runtime.optim.ema.ema_scalars` (overwrite
    every 4 steps): parameters, moments and average bitwise equal."""
    import keras
    import tensorflow as tf

    from zero_runtime.optim.ema import ema_scalars

    assert fused.use("numba")["backend"] in ("numba", "numpy")
    kw = {"learning_rate": 0.01, "beta_1": 0.8, "beta_2": 0.95, "epsilon": 1e-6}
    if case != "adam":
        kw["weight_decay"] = 0.05
    if case == "adamw_ema":
        kw.update(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=4)
    ref = (keras.optimizers.Adam if case == "adam" else keras.optimizers.AdamW)(**kw)
    rng = np.random.default_rng(5)
    n = 4099
    var = keras.Variable(rng.standard_normal(n, dtype=np.float32))
    ref.build([var])
    param = var.numpy().copy()
    m, v, average = (np.zeros(n, np.float32) for _ in range(3))
    scratch = (np.empty(n, np.float32), np.empty(n, np.float32))
    lr = tf.constant(kw["learning_rate"], tf.float32)
    for step in range(6):
        grad = rng.standard_normal(n, dtype=np.float32)
        grad[::5] = 0.0
        ref.apply([tf.constant(grad)], [var])
        if "weight_decay" in kw:
            decayed = tf.constant(param)
            param = (decayed - decayed * tf.constant(kw["weight_decay"], tf.float32) * lr).numpy()
        t = tf.constant(step + 1, tf.float32)
        b1_power, b2_power = tf.pow(_F(kw["beta_1"]), t), tf.pow(_F(kw["beta_2"]), t)
        alpha = (lr * tf.sqrt(1 - b2_power) / (1 - b1_power)).numpy()
        kernels.adam_update(
            param,
            grad,
            m,
            v,
            _F(alpha),
            _F(1 - kw["beta_1"]),
            _F(1 - kw["beta_2"]),
            _F(kw["epsilon"]),
            *scratch,
        )
        if case == "adamw_ema":
            momentum, rest, overwrite = (
                s.numpy() for s in ema_scalars(tf.constant(step, tf.int64), 0.9, 4)
            )
            kernels.ema_update(average, param, momentum, rest, bool(overwrite), *scratch)
        np.testing.assert_array_equal(param.view(np.uint32), var.numpy().view(np.uint32))
    np.testing.assert_array_equal(m, ref._momentums[0].numpy())  # noqa: SLF001
    np.testing.assert_array_equal(v, ref._velocities[0].numpy())  # noqa: SLF001
    if case == "adamw_ema":
        keras_average = ref._model_variables_moving_average[0].numpy()  # noqa: SLF001
        np.testing.assert_array_equal(average, keras_average)


def test_the_backend_is_reported_and_numpy_is_chosen_only_without_numba(monkeypatch, caplog):
    """``backend_info`` names the backend (the run record's ``host_optimizer``); with numba
    not importable the NumPy kernels run and a warning names the cause and the fix;
    ``ZERO_RUNTIME_HOST_OPTIMIZER=numba`` then raises instead."""
    import sys

    import numba

    monkeypatch.setattr(fused, "_info", None)
    monkeypatch.setattr(fused, "_module", None)
    monkeypatch.setitem(sys.modules, "numba", None)  # ``import numba`` raises ImportError
    with caplog.at_level("WARNING", logger="zero_runtime.optim.fused"):
        info = fused.backend_info()
    assert info["backend"] == "numpy" and "pip install numba" in info["reason"]
    assert fused.active() is None
    assert any("pip install numba" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(fused, "_info", None)
    monkeypatch.setenv(fused.BACKEND_ENV, "numba")
    with pytest.raises(RuntimeError, match="pip install numba"):
        fused.active()
    monkeypatch.setitem(sys.modules, "numba", numba)
    monkeypatch.setattr(fused, "_info", None)
    monkeypatch.delenv(fused.BACKEND_ENV)
    info = fused.backend_info()
    assert info["backend"] == "numba" and info["threading_layer"] in fused.THREADSAFE_LAYERS
