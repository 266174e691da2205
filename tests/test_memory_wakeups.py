"""PoolCondition: a finished NVMe job wakes the waiters it concerns, not every waiter
(the thundering herd measured on the 1B stage-3 step), and the pool still serves
concurrent callers through NVMe with every byte intact."""

from __future__ import annotations

import threading
import time

import numpy as np

from tests.test_memory_pool import F32_PER_PAGE, make_pool, tiers_of, values
from zero_runtime.memory.wakeups import PoolCondition

LONG = 30.0  # seconds: a wait this long only ends by a wake-up within a test


class Waiting:
    """A thread that takes the lock, then waits on ``cond`` (targeted unless ``plain``);
    ``done`` is set when the wait returns, ``result`` is its return value."""

    def __init__(self, cond: PoolCondition, pages=(), plain: bool = False, **wants: bool):
        self.done = threading.Event()
        self.result: bool | None = None
        entered = threading.Event()

        def run() -> None:
            with cond:
                entered.set()
                if plain:
                    self.result = cond.wait(LONG)
                else:
                    self.result = cond.wait_io(list(pages), LONG, **wants)
            self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert entered.wait(5)
        with cond:  # taken only once the waiter has released the lock inside its wait
            pass


def still_waiting(w: Waiting) -> bool:
    time.sleep(0.2)
    return not w.done.is_set()


def test_a_finished_job_wakes_only_the_waiters_of_its_page():
    cond = PoolCondition()
    a, b = object(), object()
    wa, wb = Waiting(cond, [a]), Waiting(cond, [b])
    with cond:
        cond.notify_io(a, freed=False, idle=False)
    assert wa.done.wait(5) and wa.result is True
    assert still_waiting(wb)
    assert cond.targeted_wakeups == 1
    with cond:
        cond.notify_all()  # anything else that changes the pool wakes everybody
    assert wb.done.wait(5) and wb.result is True
    with cond:
        cond.notify_io(a, freed=True, idle=False)  # nobody waits any more
    assert cond.targeted_wakeups == 1


def test_a_write_wakes_room_waiters_and_a_read_only_those_short_of_victims():
    cond = PoolCondition()
    other = object()
    room = Waiting(cond, room=True)
    short = Waiting(cond, room=True, victims=True)
    with cond:
        cond.notify_io(other, freed=False, idle=False)  # a read: a possible victim
    assert short.done.wait(5) and short.result is True
    assert still_waiting(room)
    with cond:
        cond.notify_io(other, freed=True, idle=False)  # a write: a host slot freed
    assert room.done.wait(5) and room.result is True
    assert cond.targeted_wakeups == 2


def test_a_release_wakes_only_the_waiters_short_of_victims():
    cond = PoolCondition()
    room = Waiting(cond, room=True)
    plain = Waiting(cond, plain=True)
    short = Waiting(cond, room=True, victims=True)
    with cond:
        cond.notify_victims()  # a release/unpin: pages became movable
    assert short.done.wait(5) and short.result is True
    assert still_waiting(room) and not plain.done.is_set()
    with cond:
        cond.notify_all()
    assert room.done.wait(5) and plain.done.wait(5)
    assert cond.targeted_wakeups == 1


def test_a_prefetch_request_wakes_only_the_plain_waiters():
    cond = PoolCondition()
    placing = Waiting(cond, [object()], room=True, victims=True)
    prefetcher = Waiting(cond, plain=True)
    with cond:
        cond.notify_plain()
    assert prefetcher.done.wait(5) and prefetcher.result is True
    assert still_waiting(placing)
    with cond:
        cond.notify_all()
    assert placing.done.wait(5) and cond.targeted_wakeups == 0


def test_plain_waiters_wake_when_the_io_goes_idle_and_waits_still_time_out():
    cond = PoolCondition()
    plain = Waiting(cond, plain=True)
    with cond:
        cond.notify_io(object(), freed=True, idle=False)
    assert still_waiting(plain)
    with cond:
        cond.notify_io(object(), freed=True, idle=True)  # synchronize/shutdown wait for this
    assert plain.done.wait(5) and plain.result is True
    with cond:
        start = time.monotonic()
        assert cond.wait_io([object()], 0.05) is False  # a missed wake-up costs latency only
        assert time.monotonic() - start >= 0.05


def test_concurrent_acquires_through_nvme_keep_every_byte(tmp_path):
    """Three threads update six 2-page tensors through a 6-page host tier over NVMe, so
    their acquires wait on each other's page-ins and evictions; every update lands."""
    n = 2 * F32_PER_PAGE
    rounds = 12
    with make_pool(tmp_path, host=6, nvme=24, io_threads=2) as pool:
        for t in range(6):
            pool.allocate(f"t{t}", (n,), np.float32)
            pool.write(f"t{t}", values(n, t))
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                for r in range(rounds):
                    tid = f"t{i + 3 * (r % 2)}"
                    arr = pool.acquire(tid, writable=True)
                    arr += 1.0
                    pool.release(tid)
            except BaseException as exc:  # noqa: BLE001 - reported by the assert below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not errors, errors
        for t in range(6):
            expected = values(n, t)
            for _ in range(rounds // 2):
                expected = expected + np.float32(1.0)  # float32 sums, as the updates
            np.testing.assert_array_equal(pool.read(f"t{t}"), expected)
        on_nvme = sum(tier == "nvme" for t in range(6) for tier in tiers_of(pool, f"t{t}"))
        assert on_nvme >= 6  # 12 pages, 6 host slots: the rest paged out
        cond = pool._p.cond
        assert isinstance(cond, PoolCondition)
        assert cond.targeted_wakeups > 0  # the completions went through notify_io
