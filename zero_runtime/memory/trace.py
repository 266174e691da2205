"""The access trace: a bounded record of what a pool was asked to do, step by step.

Every public operation of a :class:`~zero_runtime.memory.PagedBufferPool` that can move
or use a page is appended, once it has succeeded, to the open step's list of *events*
(under the pool's lock: the order is the order the pool served them). At each
``step_boundary`` the open step is closed with the pool's measured figures (the step's
:class:`~zero_runtime.memory.counters.PageCounters`, each tier's peak and used bytes) and
a *snapshot* of the page table is taken: where every page is, its last-use tick, the pins,
and the eviction policy's access order and position. The snapshot is the state at the
start of the next step, so any recorded step can be replayed from it
(:mod:`zero_runtime.memory.simulate`).

Bounds (fixed, documented in ``docs/tuning.md``): the last :data:`TRACE_STEPS` closed
steps are kept (a ring); a step keeps at most :data:`MAX_EVENTS_PER_STEP` events (beyond
that it is marked ``truncated`` and is not replayed). Cost: one tuple append per
operation, and at a step boundary one pass over the pages (the snapshot).

Events (``code, args...``; ``tid`` a tensor id, ``ids`` a tuple of them, tiers by name):

====  ==========================================  =================================
code  operation                                    arguments
====  ==========================================  =================================
A     ``allocate``                                 tid, nbytes, itemsize, kind, tier
F     ``free``                                     tid
K     ``fork`` (when it returned True)             source tid, new tid
Q     ``acquire`` (pins until release)             tid, tier
R     ``release``                                  tid
W     ``write`` (a use, no move)                   tid
D     ``read`` (a use, no move)                    tid
P     ``prefetch`` request queued                  ids, tier
X     the prefetch thread starts placing one       ids, tier
E     ``evict``                                    ids, tier
N     ``pin``                                      tid
U     ``unpin``                                    tid
O     ``set_access_order``                         ids (empty: none)
B     ``set_device_budget``                        device page slots
====  ==========================================  =================================

On disk (written by the runtime, one JSON file per step, ``<run dir>/`` +
:data:`TRACE_DIR` ``/step_<step>.json``, the last :data:`TRACE_STEPS` kept) a step is
:meth:`StepTrace.to_json`: tensor ids are replaced by indices into ``names``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import queue
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from zero_runtime.atomic_file import write_json_atomic
from zero_runtime.memory.page_table import PageState, PageTable
from zero_runtime.memory.policy import EvictionPolicy
from zero_runtime.memory.tiers import SlotTier

logger = logging.getLogger(__name__)

TRACE_STEPS = 8  # closed steps kept in memory and on disk
MAX_EVENTS_PER_STEP = 200_000  # events kept per step; beyond: the step is truncated
TRACE_DIR = "memory_hierarchy_trace"  # directory of the step files in a run's log dir
FORMAT_VERSION = 1
_STEP_FILE = re.compile(r"^step_(\d+)\.json$")

#: Per-page tier letters of a snapshot. A page in flight is recorded where it is going
#: (its I/O completes on its own): IN_FLIGHT_OUT as 'n', IN_FLIGHT_IN as 'c' (a page read
#: in is clean). 'c': on the host with a current NVMe copy (ON_HOST_CLEAN).
TIER_LETTER = {
    PageState.UNPLACED: "u",
    PageState.ON_DEVICE: "d",
    PageState.ON_HOST: "h",
    PageState.ON_HOST_CLEAN: "c",
    PageState.ON_NVME: "n",
    PageState.IN_FLIGHT_OUT: "n",
    PageState.IN_FLIGHT_IN: "c",
}
LETTER_TIER = {"d": "device", "h": "host", "c": "host", "n": "nvme", "u": None}
# Event codes whose arguments start with one tensor id / a tuple of ids.
_ONE_ID = frozenset("AFQRWDNU")
_IDS = frozenset("PXEO")
_TWO_IDS = frozenset("K")


def capture(
    table: PageTable, policy: EvictionPolicy, tiers: Mapping[str, SlotTier]
) -> dict[str, Any]:
    """The page table's state now (call under the pool's lock).

    Returns:
        ``{"tensors": [[tid, nbytes, itemsize, kind, letters, ticks, pin_count,
        acquire_count, acquired_tier]], "tick": int, "order": [tid], "cursor": int,
        "slots": {"device"|"host"|"nvme": int | None}}``: ``letters`` one
        :data:`TIER_LETTER` per page, ``ticks`` each page's last-use tick, ``tick`` the
        table's tick counter, ``order``/``cursor`` the eviction policy's access order and
        position, ``slots`` each tier's capacity in pages (None: unbounded).
    """
    tensors = []
    for e in table.entries():
        tensors.append(
            [
                e.tensor_id,
                e.nbytes,
                e.dtype.itemsize,
                e.kind,
                "".join(TIER_LETTER.get(p.state, "u") for p in e.pages),
                [p.last_use_tick for p in e.pages],
                e.pin_count,
                e.acquire_count,
                e.acquired_tier,
            ]
        )
    return {
        "tensors": tensors,
        "tick": table.tick,
        "order": list(policy.order),
        "cursor": policy.cursor,
        "slots": {name: tier.n_slots for name, tier in tiers.items()},
    }


@dataclasses.dataclass
class StepTrace:
    """One closed step of a pool's trace.

    Attributes:
        step: the step (0-based, as given to ``step_boundary``).
        page_size: bytes per page.
        has_nvme: whether the pool has an NVMe tier.
        start: :func:`capture` at the step's start.
        events: the step's events (see the module doc), in the order served.
        measured: the pool's figures for the step: the ``PageCounters`` fields, plus
            ``peak_bytes`` and ``used_bytes`` (``{"device"|"host"|"nvme": bytes}``) at
            its end.
        truncated: more than :data:`MAX_EVENTS_PER_STEP` events (the rest dropped).
    """

    step: int
    page_size: int
    has_nvme: bool
    start: dict[str, Any]
    events: list[tuple]
    measured: dict[str, Any]
    truncated: bool = False

    def to_json(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The step as JSON-ready data, tensor ids replaced by indices into ``names``.

        Args:
            extra: more top-level fields (the runtime adds ``config`` and
                ``config_version``).
        """
        names: dict[str, int] = {}

        def ix(tid: str) -> int:
            return names.setdefault(tid, len(names))

        start = dict(self.start)
        start["tensors"] = [[ix(t[0]), *t[1:]] for t in self.start["tensors"]]
        start["order"] = [ix(t) for t in self.start["order"]]
        events = []
        for code, *args in self.events:
            if code in _ONE_ID:
                args[0] = ix(args[0])
            elif code in _TWO_IDS:
                args[0], args[1] = ix(args[0]), ix(args[1])
            elif code in _IDS:
                args[0] = [ix(t) for t in args[0]]
            events.append([code, *args])
        out = {
            "format": FORMAT_VERSION,
            "step": self.step,
            "page_size": self.page_size,
            "has_nvme": self.has_nvme,
            "truncated": self.truncated,
            "names": list(names),
            "start": start,
            "events": events,
            "measured": self.measured,
        }
        out.update(extra or {})
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepTrace:
        """Inverse of :meth:`to_json` (extra fields are ignored).

        Raises:
            ValueError: another format version, or a malformed record (naming the field).
        """
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"access trace format {data.get('format')!r} is not {FORMAT_VERSION}")
        try:
            names = list(data["names"])
            start = dict(data["start"])
            start["tensors"] = [[names[t[0]], *t[1:]] for t in start["tensors"]]
            start["order"] = [names[i] for i in start["order"]]
            events: list[tuple] = []
            for code, *args in data["events"]:
                if code in _ONE_ID:
                    args[0] = names[args[0]]
                elif code in _TWO_IDS:
                    args[0], args[1] = names[args[0]], names[args[1]]
                elif code in _IDS:
                    args[0] = tuple(names[i] for i in args[0])
                events.append((code, *args))
            return cls(
                int(data["step"]),
                int(data["page_size"]),
                bool(data["has_nvme"]),
                start,
                events,
                dict(data["measured"]),
                bool(data.get("truncated", False)),
            )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed access trace step: {exc!r}") from exc


class AccessTrace:
    """The ring of a pool's last closed steps and the open step's events.

    Not thread-safe: the pool calls it under its lock.

    Args:
        page_size: bytes per page.
        has_nvme: whether the pool has an NVMe tier.
        steps: closed steps kept (default :data:`TRACE_STEPS`).
        max_events: events kept per step (default :data:`MAX_EVENTS_PER_STEP`).

    Attributes:
        closed: the last ``steps`` closed steps, oldest first.
        enabled: recording (default True); off, nothing is added or closed (the
            benchmark of its cost, ``bench/bench_whatif.py``, turns it off and on).
    """

    def __init__(
        self,
        page_size: int,
        has_nvme: bool,
        steps: int = TRACE_STEPS,
        max_events: int = MAX_EVENTS_PER_STEP,
    ) -> None:
        self.page_size = int(page_size)
        self.has_nvme = bool(has_nvme)
        self.max_events = int(max_events)
        self.closed: collections.deque[StepTrace] = collections.deque(maxlen=int(steps))
        self._unwritten: collections.deque[StepTrace] = collections.deque(maxlen=int(steps))
        self._events: list[tuple] = []
        self._truncated = False
        self._start: dict[str, Any] | None = None
        self.enabled = True

    def begin(self, start: dict[str, Any]) -> None:
        """Open a step whose state at its start is ``start`` (:func:`capture`)."""
        self._start = start
        self._events = []
        self._truncated = False

    def add(self, *event: Any) -> None:
        """Append one event ``(code, args...)`` to the open step."""
        if not self.enabled:
            return
        if len(self._events) < self.max_events:
            self._events.append(event)
        else:
            self._truncated = True

    def close(self, step: int, measured: dict[str, Any], next_start: dict[str, Any]) -> StepTrace:
        """Close the open step as ``step`` with its ``measured`` figures; open the next one
        at ``next_start``. Returns the closed step."""
        record = StepTrace(
            int(step),
            self.page_size,
            self.has_nvme,
            self._start or {"tensors": [], "tick": 0, "order": [], "cursor": 0, "slots": {}},
            self._events,
            measured,
            self._truncated,
        )
        self.closed.append(record)
        self._unwritten.append(record)
        self.begin(next_start)
        return record

    def take_unwritten(self) -> list[StepTrace]:
        """The closed steps not yet taken (at most ``steps``), oldest first; forgets them."""
        out = list(self._unwritten)
        self._unwritten.clear()
        return out


def write_steps(
    directory: str,
    steps: Iterable[StepTrace],
    extra: Mapping[str, Any] | None = None,
    keep: int = TRACE_STEPS,
) -> list[str]:
    """Write steps as ``directory/step_<step>.json`` (atomically: a temporary file, then
    ``os.replace``) and remove all but the ``keep`` newest step files.

    Args:
        directory: created if missing.
        steps: the steps to write.
        extra: fields added to each file (:meth:`StepTrace.to_json`).
        keep: step files kept (default :data:`TRACE_STEPS`).

    Returns:
        The paths written.

    Raises:
        OSError: the directory cannot be created or written.
    """
    os.makedirs(directory, exist_ok=True)
    written = []
    for record in steps:
        path = os.path.join(directory, f"step_{record.step:09d}.json")
        write_json_atomic(  # no fsync: a lost step file costs one prediction
            path, record.to_json(extra), fsync=False, separators=(",", ":")
        )
        written.append(path)
    files = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(directory)
        if (m := _STEP_FILE.match(name)) is not None
    )
    for _, name in files[: max(0, len(files) - keep)]:
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass
    return written


def step_numbers(directory: str) -> list[int]:
    """The steps whose files ``directory`` holds, ascending, by file name only (nothing is
    read); ``[]`` when the directory does not exist."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(m.group(1)) for name in names if (m := _STEP_FILE.match(name)) is not None)


def read_steps(directory: str, since: int = 0) -> list[dict[str, Any]]:
    """The step files of ``directory`` as decoded JSON, oldest step first; files that
    cannot be read or decoded (e.g. being replaced) are skipped. ``[]`` when the
    directory does not exist. ``since``: only steps >= it (by file name, unread
    otherwise)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    files = sorted(
        (int(m.group(1)), name)
        for name in names
        if (m := _STEP_FILE.match(name)) is not None and int(m.group(1)) >= since
    )
    out = []
    for _, name in files:
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out.append(data)
    return out


class TraceWriter:
    """Writes closed steps into a directory on a background thread (:func:`write_steps`),
    so a step boundary only hands them over. Steps are immutable once closed, so they are
    serialized there. A write error is logged, never raised.

    Args:
        directory: where the step files go (created at the first write).
        keep: step files kept (default :data:`TRACE_STEPS`).
    """

    def __init__(self, directory: str, keep: int = TRACE_STEPS) -> None:
        self.directory = directory
        self.keep = keep
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, steps: list[StepTrace], extra: Mapping[str, Any]) -> None:
        """Queue ``steps`` (with ``extra`` fields) for writing; starts the thread once."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="zr-trace", daemon=True)
                self._thread.start()
        self._queue.put((steps, dict(extra)))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                write_steps(self.directory, item[0], item[1], self.keep)
            except (OSError, TypeError, ValueError) as exc:
                logger.warning("access trace not written: %s", exc)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until everything queued is written."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread. Idempotent."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
