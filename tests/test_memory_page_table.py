"""Tests of zero_runtime.memory.page_table: the transition owner and its slot bookkeeping."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tb_plugin.metadata import PAGE_COLUMNS
from zero_runtime.memory.counters import CounterAccumulator, PageCounters
from zero_runtime.memory.errors import PageStateError
from zero_runtime.memory.page_table import HOLDS, PageRecord, PageState, PageTable, TensorEntry
from zero_runtime.memory.tiers import SlotTier

S = PageState
PS = 64 << 10


def make_table() -> tuple[PageTable, dict[str, SlotTier], CounterAccumulator]:
    tiers = {name: SlotTier(name, PS, 4) for name in ("device", "host", "nvme")}
    counters = CounterAccumulator()
    return PageTable(tiers, counters), tiers, counters


def make_entry(table: PageTable, tid: str = "t", payloads: tuple[int, ...] = (PS, 100)):
    pages = [PageRecord(tid, i, n) for i, n in enumerate(payloads)]
    entry = TensorEntry(tid, (sum(payloads),), np.dtype(np.uint8), "param", sum(payloads), pages)
    table.add(entry)
    return entry


def test_page_counter_fields_are_the_plugin_page_columns():
    assert tuple(f.name for f in dataclasses.fields(PageCounters)) == PAGE_COLUMNS


def test_full_cycle_moves_slots_and_counts_each_direction_once():
    table, tiers, counters = make_table()
    page = make_entry(table).pages[1]  # payload 100 bytes
    table.transition(page, S.ON_DEVICE, tiers["device"].take())
    table.transition(page, S.ON_HOST, tiers["host"].take())  # d2h
    assert tiers["device"].used == 0 and tiers["host"].used == 1
    table.transition(page, S.IN_FLIGHT_OUT, tiers["nvme"].take())
    assert (tiers["host"].used, tiers["nvme"].used) == (1, 1)  # counts toward both
    table.transition(page, S.ON_NVME)  # h2n
    assert (tiers["host"].used, tiers["nvme"].used) == (0, 1)
    table.transition(page, S.IN_FLIGHT_IN, tiers["host"].take())
    table.transition(page, S.ON_HOST)  # n2h
    table.transition(page, S.ON_DEVICE, tiers["device"].take())  # h2d
    table.transition(page, S.FREED)
    assert [t.used for t in tiers.values()] == [0, 0, 0]
    c = counters.snapshot()
    assert (c.d2h_pages, c.h2n_pages, c.n2h_pages, c.h2d_pages) == (1, 1, 1, 1)
    assert (c.d2h_bytes, c.h2n_bytes, c.n2h_bytes, c.h2d_bytes) == (100, 100, 100, 100)
    assert table.count(S.FREED) == 1 and table.count(S.UNPLACED) == 1


def test_failed_write_returns_the_nvme_slot_and_keeps_the_host_slot():
    table, tiers, counters = make_table()
    page = make_entry(table).pages[0]
    host_slot = tiers["host"].take()
    table.transition(page, S.ON_HOST, host_slot)
    table.transition(page, S.IN_FLIGHT_OUT, tiers["nvme"].take())
    table.transition(page, S.ON_HOST)
    assert page.slots == {"host": host_slot}
    assert tiers["nvme"].used == 0
    assert counters.snapshot().h2n_pages == 0


@pytest.mark.parametrize(
    "path, bad",
    [
        ((S.ON_HOST,), S.ON_NVME),  # skipping IN_FLIGHT_OUT
        ((S.ON_NVME,), S.ON_DEVICE),  # NVMe never goes straight to device
        ((S.ON_HOST, S.FREED), S.ON_HOST),  # FREED is terminal
        ((S.ON_HOST, S.IN_FLIGHT_OUT), S.FREED),  # cannot free in flight
    ],
)
def test_illegal_transition_raises_and_changes_nothing(path, bad):
    table, tiers, _ = make_table()
    page = make_entry(table).pages[0]
    for state in path:
        gained = HOLDS[state] - HOLDS[page.state]
        table.transition(page, state, tiers[next(iter(gained))].take() if gained else None)
    before = (page.state, dict(page.slots), [t.used for t in tiers.values()])
    with pytest.raises(PageStateError, match=f"illegal page transition {path[-1].name} -> "):
        table.transition(page, bad, 0)
    assert (page.state, page.slots, [t.used for t in tiers.values()]) == before


def test_transition_requires_exactly_the_new_slot():
    table, tiers, _ = make_table()
    page = make_entry(table).pages[0]
    with pytest.raises(PageStateError, match="needs a new slot in \\['host'\\]"):
        table.transition(page, S.ON_HOST)
    table.transition(page, S.ON_HOST, tiers["host"].take())
    with pytest.raises(PageStateError, match="needs a new slot in no tier"):
        table.transition(page, S.FREED, 3)
    assert page.state is S.ON_HOST


def test_one_entry_per_tensor_and_remove_needs_freed_pages():
    table, tiers, _ = make_table()
    entry = make_entry(table, "w")
    with pytest.raises(ValueError, match="'w' is already allocated"):
        make_entry(table, "w")
    table.transition(entry.pages[0], S.ON_HOST, tiers["host"].take())
    with pytest.raises(PageStateError, match="live pages \\[0, 1\\]"):
        table.remove("w")
    for page in entry.pages:
        table.transition(page, S.FREED)
    table.remove("w")
    with pytest.raises(KeyError, match="'w' is not allocated"):
        table.get("w")
    assert tiers["host"].used == 0
