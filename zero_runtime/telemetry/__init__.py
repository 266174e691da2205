"""Per-step telemetry: probes (readings), StepStats, the flight recorder, the timeline,
sampled profiler traces and collective byte counts.

Two modules are not re-exported here, as they import the TensorBoard writer or take the
runtime's accounting: :mod:`.collector` (``TelemetryCollector``, one StepStats record from
explicit inputs) and :mod:`.summaries` (``RunSummaries``, every tag the runtime writes).
"""

from zero_runtime.telemetry.comm import COLLECTIVE_KINDS, collective_bytes
from zero_runtime.telemetry.emitter import BackgroundEmitter
from zero_runtime.telemetry.probes import Readings, read_probes
from zero_runtime.telemetry.profile import ProfileSampler, parse_xplane
from zero_runtime.telemetry.recorder import FlightRecorder, PageMoveRecorder
from zero_runtime.telemetry.stats import StepStats, TierStats
from zero_runtime.telemetry.timeline import Overlap, Timeline, intersect, overlap, total, union

__all__ = [
    "BackgroundEmitter",
    "COLLECTIVE_KINDS",
    "FlightRecorder",
    "Overlap",
    "PageMoveRecorder",
    "ProfileSampler",
    "Readings",
    "StepStats",
    "TierStats",
    "Timeline",
    "collective_bytes",
    "intersect",
    "overlap",
    "parse_xplane",
    "read_probes",
    "total",
    "union",
]
