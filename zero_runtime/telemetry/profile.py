"""Sampled TensorFlow profiler traces: comm and compute intervals of ops inside tf.function.

Collectives that run inside Keras's compiled train step cannot be timed from Python. On
sampled steps the runtime starts TensorFlow's profiler at one step boundary and stops it
at the next (``tf.profiler.experimental.start/stop``); TensorFlow writes the trace as an
XSpace protobuf (``plugins/profile/<time>/<host>.xplane.pb``). The TensorBoard profile
plugin is not installed here, but the proto's Python module ships with TensorFlow
(``tensorflow.tsl.profiler.protobuf.xplane_pb2``), so the trace is parsed directly:

- every plane whose name starts with ``/host:`` or ``/device:`` is read; an event whose
  metadata name has the TF op form ``"node_name:OpType"`` is an op execution;
- ops whose type starts with ``Collective`` or ``Nccl`` are ``comm`` (all-reduce,
  all-gather, all-to-all reduce-scatter, ...); every other op is ``compute``;
- times are ``line.timestamp_ns + offset_ps / 1000`` ns, converted to seconds.

The sampled window runs from the end of step ``s`` to the end of step ``s + 1``; its
figures are reported for step ``s + 1`` (a ``profiled`` flag says so). Every other step's
timing comes from the runtime's own intervals (``zero_runtime.telemetry.collector``); the
profiler only adds op-level detail on the sampled ones.

TensorFlow's profiler session logs five INFO lines per start/stop from C++
(``profiler_session.cc``, ``save_profile.cc``) unless ``TF_CPP_MIN_LOG_LEVEL`` >= 1: the
sampler silences the process's stderr (file descriptor 2) for the duration of those two
calls only (:func:`quiet_native_info`); its own errors go through Python logging after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import shutil
import tempfile

from zero_runtime.telemetry.timeline import Interval

log = logging.getLogger(__name__)

#: Default sampling period, steps (0 disables): one profiled step in 50 costs the
#: profiler's start/stop/serialise time (about 0.3-2 s on 2 CPU cores) once per period.
DEFAULT_PROFILE_EVERY_N_STEPS = 50

#: Environment variable overriding the sampling period (an int >= 0; 0 disables).
PROFILE_ENV = "ZERO_RUNTIME_PROFILE_EVERY"

_COMM_PREFIXES = ("Collective", "Nccl")


@contextlib.contextmanager
def quiet_native_info():
    """Send file descriptor 2 (native stderr) to ``/dev/null`` inside the block when
    TensorFlow's C++ INFO lines are on (``TF_CPP_MIN_LOG_LEVEL`` unset or ``0``); a no-op
    otherwise, or when fd 2 cannot be duplicated. Other threads' stderr writes during the
    block (milliseconds around a profiler start/stop) are lost too."""
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") not in ("", "0"):
        yield
        return
    try:
        saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@dataclasses.dataclass(frozen=True)
class TraceIntervals:
    """Op intervals parsed from one trace, seconds on the profiler's clock.

    Attributes:
        comm: intervals of collective ops.
        compute: intervals of all other ops.
        comm_ops: collective op type -> executions seen.
        path: the parsed ``.xplane.pb`` (removed afterwards).
    """

    comm: list[Interval]
    compute: list[Interval]
    comm_ops: dict[str, int]
    path: str


def newest_xplane(directory: str) -> str:
    """The newest ``.xplane.pb`` under ``directory`` (searched recursively; the profiler
    names each run's directory by its start time, so the last in sorted order).

    Raises:
        FileNotFoundError: none was written there.
    """
    files = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no .xplane.pb written under {directory}")
    return files[-1]


def read_xspace(path: str):
    """The ``XSpace`` proto of one ``.xplane.pb`` file.

    Raises:
        OSError: the file cannot be read.
        google.protobuf.message.DecodeError: not an XSpace proto.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def parse_xplane(path: str) -> TraceIntervals:
    """Parse an XSpace ``.xplane.pb`` file into comm and compute op intervals.

    Raises:
        as :func:`read_xspace`.
    """
    space = read_xspace(path)
    comm: list[Interval] = []
    compute: list[Interval] = []
    comm_ops: dict[str, int] = {}
    for plane in space.planes:
        if not plane.name.startswith(("/host:", "/device:")):
            continue
        names = {k: m.name for k, m in plane.event_metadata.items()}
        for line in plane.lines:
            base_ns = line.timestamp_ns
            for ev in line.events:
                name = names.get(ev.metadata_id, "")
                node, sep, op_type = name.rpartition(":")
                if not sep or not node or not op_type or " " in op_type:
                    continue
                start = (base_ns + ev.offset_ps / 1000.0) * 1e-9
                end = start + ev.duration_ps * 1e-12
                if op_type.startswith(_COMM_PREFIXES):
                    comm.append((start, end))
                    comm_ops[op_type] = comm_ops.get(op_type, 0) + 1
                else:
                    compute.append((start, end))
    return TraceIntervals(comm, compute, comm_ops, path)


class ProfileSampler:
    """Start/stop TensorFlow's profiler around sampled steps and parse the trace.

    Args:
        every_n_steps: profile the step after each step ``s`` with ``(s + 1) % n == 0``;
            0 disables. Default: ``$ZERO_RUNTIME_PROFILE_EVERY`` or
            :data:`DEFAULT_PROFILE_EVERY_N_STEPS`.

    Attributes:
        sampled_steps: the steps whose figures came from a trace, in order.
        failures: profiler errors seen (sampling stops after 3).
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is None:
            every_n_steps = int(os.environ.get(PROFILE_ENV, DEFAULT_PROFILE_EVERY_N_STEPS))
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.sampled_steps: list[int] = []
        self.failures = 0
        self._dir: str | None = None
        self._step: int | None = None

    @property
    def active(self) -> bool:
        """True while a trace is being recorded."""
        return self._dir is not None

    def maybe_start(self, ended_step: int) -> bool:
        """At the end of ``ended_step``: start a trace of the next step when it is sampled.

        Returns:
            True when tracing started.
        """
        n = self.every_n_steps
        if n <= 0 or self.active or self.failures >= 3 or (ended_step + 1) % n:
            return False
        import tensorflow as tf

        self._dir = tempfile.mkdtemp(prefix="zr-profile-")
        try:
            with quiet_native_info():
                tf.profiler.experimental.start(self._dir)
        except Exception as exc:  # noqa: BLE001 - a profiler already running, etc.
            log.warning("telemetry: cannot start the TensorFlow profiler: %s", exc)
            self.failures += 1
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
            return False
        self._step = ended_step + 1
        return True

    def stop(self) -> TraceIntervals | None:
        """Stop the trace (if any) and parse it; None when nothing was traced or parsed."""
        if self._dir is None:
            return None
        import tensorflow as tf

        directory, step = self._dir, self._step
        self._dir = self._step = None
        try:
            with quiet_native_info():
                tf.profiler.experimental.stop()
            trace = parse_xplane(newest_xplane(directory))
        except Exception as exc:  # noqa: BLE001 - telemetry must not break training
            log.warning("telemetry: cannot read the profiler trace: %s", exc)
            self.failures += 1
            return None
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        self.sampled_steps.append(int(step))
        return trace
