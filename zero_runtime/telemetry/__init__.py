"""Per-step telemetry: probes (readings), StepStats, the flight recorder, the emitter."""

from zero_runtime.telemetry.probes import Readings, read_probes
from zero_runtime.telemetry.recorder import FlightRecorder
from zero_runtime.telemetry.stats import StepStats, TierStats

__all__ = ["FlightRecorder", "Readings", "StepStats", "TierStats", "read_probes"]
