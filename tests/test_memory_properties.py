"""Property-based tests of the paged buffer pool (hypothesis stateful testing).

Random sequences of allocate, write, prefetch, evict, acquire/release, read and free
over small capacities (64 KiB pages; device 2, host 3, NVMe 10 pages) with a real slab
file in a temporary directory. After every step, once the pool is idle:

- every read returns the bytes last written (zeros after allocate);
- no tier's use or peak ever exceeds its capacity, and per-kind bytes sum to the use;
- the counters add up to the moves made: for each tier, the pages (and payload bytes) on
  it equal those allocated there, minus those freed from it, plus moves in, minus moves
  out as counted by ``step_boundary`` (a clean eviction, ``h2n_clean``, is a move with no
  write); the NVMe tier's slots also hold the copies of the clean pages on the host;
- prefetch hits plus misses equal the pages acquired.
"""

from __future__ import annotations

import collections
import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zero_runtime.memory import PagedBufferPool, PoolOutOfMemoryError
from zero_runtime.memory.page_table import PageState

PS = 64 << 10
CAPACITY_PAGES = {"device": 2, "host": 3, "nvme": 10}
DTYPES = (np.uint8, np.int16, np.float32, np.float64)
TIERS = ("device", "host", "nvme")
MOVES_IN = {"device": ("h2d",), "host": ("d2h", "n2h"), "nvme": ("h2n", "h2n_clean")}
MOVES_OUT = {"device": ("d2h",), "host": ("h2d", "h2n", "h2n_clean"), "nvme": ("n2h",)}


def payloads(nbytes: int) -> list[int]:
    return [min(PS, nbytes - i * PS) for i in range(-(-nbytes // PS))]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="zr-mem-prop-")
        self.pool = PagedBufferPool(
            page_size_bytes=PS,
            device_budget_bytes=CAPACITY_PAGES["device"] * PS,
            host_budget_bytes=CAPACITY_PAGES["host"] * PS,
            nvme_path=self.dir,
            nvme_budget_bytes=CAPACITY_PAGES["nvme"] * PS,
            io_threads=2,
            queue_depth=3,
        )
        self.model: dict[str, np.ndarray] = {}  # what each tensor must read back as
        self.next_id = 0
        self.ledger_pages = collections.Counter()  # tier -> allocated - freed pages
        self.ledger_bytes = collections.Counter()  # tier -> allocated - freed payload
        self.totals = collections.Counter()  # cumulative PageCounters
        self.pages_acquired = 0
        self.step = 0

    def teardown(self) -> None:
        self.pool.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _by_tier(self, tid: str) -> list[tuple[str, int]]:
        info = self.pool.describe(tid)
        return [(p.tier, p.payload) for p in info.pages]

    # --- rules ------------------------------------------------------------------------
    @rule(
        nbytes=st.integers(1, 3 * PS),
        dtype=st.sampled_from(DTYPES),
        tier=st.sampled_from(TIERS),
        kind=st.sampled_from(("param", "grad", "optimizer", "activation", "other")),
    )
    def allocate(self, nbytes, dtype, tier, kind):
        itemsize = np.dtype(dtype).itemsize
        shape = (max(1, nbytes // itemsize),)
        tid = f"t{self.next_id}"
        self.next_id += 1
        try:
            self.pool.allocate(tid, shape, dtype, kind=kind, tier=tier)
        except PoolOutOfMemoryError as exc:
            assert exc.snapshot.request_tensor_id == tid and exc.snapshot.request_tier == tier
            assert tid not in self.pool.tensor_ids()
            return
        self.model[tid] = np.zeros(shape, dtype)
        for p in payloads(self.model[tid].nbytes):
            self.ledger_pages[tier] += 1
            self.ledger_bytes[tier] += p

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def write(self, data, seed):
        tid = data.draw(st.sampled_from(sorted(self.model)))
        ref = self.model[tid]
        raw = np.random.default_rng(seed).integers(0, 256, ref.nbytes, dtype=np.uint8)
        new = raw.view(ref.dtype).reshape(ref.shape)
        if new.dtype.kind == "f":
            new = np.nan_to_num(new)  # NaN != NaN would defeat array_equal
        self.pool.write(tid, new)
        self.model[tid] = new.copy()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def read(self, data):
        tid = data.draw(st.sampled_from(sorted(self.model)))
        assert np.array_equal(self.pool.read(tid), self.model[tid])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=st.sampled_from(("host", "device")))
    def prefetch(self, data, tier):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3))
        self.pool.prefetch(ids, tier=tier)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), to_tier=st.sampled_from(("host", "nvme")))
    def evict(self, data, to_tier):
        tid = data.draw(st.sampled_from(sorted(self.model)))
        try:
            self.pool.evict(tid, to_tier)
        except PoolOutOfMemoryError as exc:
            assert exc.snapshot.request_tier == to_tier
            return
        assert all(p.tier in TIERS[TIERS.index(to_tier) :] for p in self.pool.describe(tid).pages)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=st.sampled_from(("host", "device")), modify=st.booleans())
    def acquire_release(self, data, tier, modify):
        tid = data.draw(st.sampled_from(sorted(self.model)))
        try:
            got = self.pool.acquire(tid, tier=tier, writable=modify and tier == "host")
        except PoolOutOfMemoryError as exc:
            assert exc.snapshot.request_tier == tier
            return
        self.pages_acquired += len(self.pool.describe(tid).pages)
        assert all(p.tier == tier for p in self.pool.describe(tid).pages)
        values = got if tier == "host" else got.numpy()
        assert np.array_equal(values, self.model[tid])
        if modify and tier == "host":
            got.reshape(-1).view(np.uint8)[0] ^= 0xFF
            self.model[tid].reshape(-1).view(np.uint8)[0] ^= 0xFF
        self.pool.release(tid)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        tid = data.draw(st.sampled_from(sorted(self.model)))
        self.pool.synchronize()  # so describe() shows settled tiers
        for tier, payload in self._by_tier(tid):
            self.ledger_pages[tier] -= 1
            self.ledger_bytes[tier] -= payload
        self.pool.free(tid)
        del self.model[tid]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def set_access_order(self, data):
        ids = sorted(self.model)
        self.pool.set_access_order(data.draw(st.permutations(ids)))

    # --- invariants -------------------------------------------------------------------
    @invariant()
    def tiers_within_capacity_and_counters_add_up(self):
        self.pool.synchronize()
        counters = self.pool.step_boundary(self.step)
        self.step += 1
        for name, value in vars(counters).items():
            assert value >= 0, name
            self.totals[name] += value
        self.pool._p.table.audit()  # noqa: SLF001 - the kept figures equal a scan
        usage = self.pool.usage()
        resident_bytes = collections.Counter()
        clean_copies = 0  # NVMe slots of pages on the host whose NVMe copy is current
        for tid in self.model:
            for tier, payload in self._by_tier(tid):
                resident_bytes[tier] += payload
            clean_copies += sum(
                p.state is PageState.ON_HOST_CLEAN for p in self.pool.describe(tid).pages
            )
        for tier in TIERS:
            u = usage[tier]
            cap = CAPACITY_PAGES[tier] * PS
            assert u.capacity_bytes == cap
            assert u.used_bytes <= cap and u.peak_bytes <= cap, (tier, u)
            assert sum(u.bytes_by_kind.values()) == u.used_bytes
            moved_in = sum(self.totals[f"{d}_pages"] for d in MOVES_IN[tier])
            moved_out = sum(self.totals[f"{d}_pages"] for d in MOVES_OUT[tier])
            copies = clean_copies if tier == "nvme" else 0
            assert u.pages == self.ledger_pages[tier] + moved_in - moved_out + copies, tier
            bytes_in = sum(self.totals[f"{d}_bytes"] for d in MOVES_IN[tier])
            bytes_out = sum(self.totals[f"{d}_bytes"] for d in MOVES_OUT[tier])
            assert resident_bytes[tier] == self.ledger_bytes[tier] + bytes_in - bytes_out, tier
        downward = (
            self.totals["d2h_pages"] + self.totals["h2n_pages"] + self.totals["h2n_clean_pages"]
        )
        assert self.totals["evictions"] <= downward
        assert self.totals["prefetch_hits"] + self.totals["prefetch_misses"] == self.pages_acquired
        if self.totals["h2n_pages"] or self.totals["n2h_pages"]:
            assert self.totals["io_seconds"] > 0


PoolMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolProperties = PoolMachine.TestCase
