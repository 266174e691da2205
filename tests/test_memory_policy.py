"""Tests of zero_runtime.memory.policy: LRU and reuse-distance ranking of victims."""

from __future__ import annotations

import math

from zero_runtime.memory.page_table import PageRecord
from zero_runtime.memory.policy import EvictionPolicy


def page(tid: str, tick: int) -> PageRecord:
    return PageRecord(tid, 0, 1, last_use_tick=tick)


def test_without_an_order_the_least_recently_used_go_first():
    policy = EvictionPolicy()
    pages = [page("a", 5), page("b", 2), page("c", 9), page("d", 1)]
    assert [p.tensor_id for p in policy.choose(pages, 3)] == ["d", "b", "a"]
    assert policy.distance("a") == math.inf and not policy.ordered


def test_distance_follows_the_cursor_and_wraps_into_the_next_step():
    policy = EvictionPolicy()
    policy.set_order(["a", "b", "c", "b"])
    assert [policy.distance(t) for t in "abcx"] == [0, 1, 2, math.inf]
    policy.advance("a")
    policy.advance("b")  # cursor after the first b
    assert [policy.distance(t) for t in "abc"] == [2, 1, 0]  # a: 2 left + index 0
    policy.advance("c")
    policy.advance("b")
    assert policy.distance("b") == 1  # next step: a, then b
    policy.restart()
    assert policy.distance("c") == 2


def test_reuse_distance_ranks_absent_then_furthest_then_lru_and_honours_limit():
    policy = EvictionPolicy()
    policy.set_order(["a", "b", "c"])
    pages = [page("a", 1), page("c", 8), page("b", 3), page("z", 9), page("c", 2)]
    chosen = policy.choose(pages, 4)
    assert [(p.tensor_id, p.last_use_tick) for p in chosen] == [
        ("z", 9),
        ("c", 2),
        ("c", 8),
        ("b", 3),
    ]
    assert [p.tensor_id for p in policy.choose(pages, 5, limit=1)] == ["z", "c", "c"]
