"""The device working set from a TensorFlow profiler trace: the allocator's own events.

TensorFlow's BFC allocator reports, in its in-use figure
(``tf.config.experimental.get_memory_info(...)["peak"]``), the bytes of the *chunks* it
handed out. A chunk is split only when it is at least twice the rounded request (BFC's
``SplitChunk`` rule; ``tensorflow/core/common_runtime/bfc_allocator.cc``), so a 1 MiB
tensor may hold a 1.5 MiB chunk: the in-use peak adds internal fragmentation to what the
program holds. Under ``tf.profiler.experimental`` the same allocator records every
allocation and deallocation as ``MemoryAllocation`` / ``MemoryDeallocation`` events in
the trace (``plugins/profile/<run>/<host>.xplane.pb``), each with ``requested_bytes``,
``allocation_bytes`` (the chunk), ``addr`` and the ``tf_op`` that allocated it. Replaying
them gives the peak of the bytes the tensors asked for (the working set) next to the peak
of the chunks, and what was live at that moment.

The XSpace proto module ships with TensorFlow (``tensorflow.tsl.profiler.protobuf``), as
in :mod:`zero_runtime.telemetry.profile`.
"""

from __future__ import annotations

import dataclasses
import os

from zero_runtime.telemetry.profile import newest_xplane, read_xspace

_ALLOC, _FREE = "MemoryAllocation", "MemoryDeallocation"


@dataclasses.dataclass(frozen=True)
class LiveTensor:
    """One allocation live at the peak.

    Attributes:
        op: the TF op that allocated it (``tf_op``; ``""`` when the trace has none).
        requested_bytes: bytes the tensor asked for.
        allocation_bytes: bytes of the allocator's chunk (>= requested).
        shape: the tensor's shape as the trace prints it (``"[2,131072]"``), or ``""``.
    """

    op: str
    requested_bytes: int
    allocation_bytes: int
    shape: str


@dataclasses.dataclass(frozen=True)
class AllocationPeak:
    """Peaks of one allocator over a traced window, replayed from its events.

    Both peaks count only allocations made inside the window (bytes already in use when
    the profiler started are not in the trace), so they are bytes *above* the window's
    start; a deallocation of an earlier allocation is ignored, which can only make the
    figures larger (conservative).

    Attributes:
        allocator: the allocator's name as the trace records it (e.g.
            ``"bfc_cpu_allocator_for_gpu"``: the BFC allocator serving the CPU devices
            when ``TF_CPU_ALLOCATOR_USE_BFC`` is set).
        requested_peak_bytes: peak of the sum of live tensors' requested bytes.
        allocated_peak_bytes: peak of the sum of live chunks' bytes (what the in-use
            figure counts, fragmentation included).
        live_at_peak: the allocations live when ``requested_peak_bytes`` was reached,
            largest first.
        events: allocation and deallocation events replayed.
    """

    allocator: str
    requested_peak_bytes: int
    allocated_peak_bytes: int
    live_at_peak: tuple[LiveTensor, ...]
    events: int


def _stat_value(stat, names: dict) -> object:
    kind = stat.WhichOneof("value")
    if kind == "ref_value":
        return names.get(stat.ref_value, "")
    return getattr(stat, kind) if kind else None


def _events(path: str) -> list[tuple[int, bool, dict]]:
    """``(time ps, is_allocation, stats)`` of every allocator event in the trace, sorted."""
    space = read_xspace(path)
    out = []
    for plane in space.planes:
        stat_names = {k: m.name for k, m in plane.stat_metadata.items()}
        event_names = {k: m.name for k, m in plane.event_metadata.items()}
        for line in plane.lines:
            for ev in line.events:
                name = event_names.get(ev.metadata_id, "")
                if name not in (_ALLOC, _FREE):
                    continue
                stats = {
                    stat_names.get(s.metadata_id, ""): _stat_value(s, stat_names) for s in ev.stats
                }
                out.append((line.timestamp_ns * 1000 + ev.offset_ps, name == _ALLOC, stats))
    out.sort(key=lambda e: e[0])
    return out


def allocation_peaks(path: str) -> dict[str, AllocationPeak]:
    """Replay the allocator events of one XSpace file.

    Args:
        path: a ``.xplane.pb`` written by ``tf.profiler.experimental.stop()``, or a
            directory searched recursively for the newest one
            (:func:`~zero_runtime.telemetry.profile.newest_xplane`).

    Returns:
        allocator name -> :class:`AllocationPeak` (empty when the trace has no allocator
        events, e.g. a window with no step in it).

    Raises:
        FileNotFoundError: ``path`` is a directory with no ``.xplane.pb`` under it, or a
            file that does not exist.
        google.protobuf.message.DecodeError: the file is not an XSpace proto.
    """
    if os.path.isdir(path):
        path = newest_xplane(path)
    state: dict[str, dict] = {}
    for _, is_alloc, st in _events(path):
        name = str(st.get("allocator_name", ""))
        s = state.setdefault(
            name, {"live": {}, "req": 0, "alloc": 0, "peak": 0, "apeak": 0, "at": {}, "n": 0}
        )
        s["n"] += 1
        addr = st.get("addr")
        if is_alloc:
            s["live"][addr] = st
            s["req"] += int(st.get("requested_bytes", 0))
            s["alloc"] += int(st.get("allocation_bytes", 0))
            s["apeak"] = max(s["apeak"], s["alloc"])
            if s["req"] > s["peak"]:
                s["peak"], s["at"] = s["req"], dict(s["live"])
        else:
            old = s["live"].pop(addr, None)
            if old is not None:
                s["req"] -= int(old.get("requested_bytes", 0))
                s["alloc"] -= int(old.get("allocation_bytes", 0))
    peaks = {}
    for name, s in state.items():
        live = sorted(
            (
                LiveTensor(
                    str(t.get("tf_op") or ""),
                    int(t.get("requested_bytes", 0)),
                    int(t.get("allocation_bytes", 0)),
                    str(t.get("shape") or ""),
                )
                for t in s["at"].values()
            ),
            key=lambda t: -t.requested_bytes,
        )
        peaks[name] = AllocationPeak(name, s["peak"], s["apeak"], tuple(live), s["n"])
    return peaks
