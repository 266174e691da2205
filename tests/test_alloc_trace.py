"""zero_runtime.telemetry.alloc_trace: the working set replayed from a profiler trace.

A real trace of a few known tensors (TensorFlow's BFC allocator on the CPU, in a fresh
process so the allocator setting holds), and the errors for a path without one.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
from google.protobuf.message import DecodeError

from zero_runtime.telemetry.alloc_trace import allocation_peaks

MIB = 1 << 20

# Inside a traced tf.function: a and b (4 MiB each) live together; c (4 MiB) is made
# from their reduction, after both are freed: the requested peak is a + b (8 MiB and a
# few bytes), not a + b + c.
JOB = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    sys.path.insert(0, sys.argv[2])
    from zero_runtime.telemetry.alloc_trace import allocation_peaks

    @tf.function
    def f(x):
        a = tf.fill([1 << 20], x)          # 4 MiB
        b = tf.fill([1 << 20], x + 1.0)    # 4 MiB
        s = tf.reduce_sum(a * b)
        c = tf.fill([1 << 20], s)
        return tf.reduce_sum(c)

    f(tf.constant(1.0))  # trace outside the window
    tf.profiler.experimental.start(sys.argv[1])
    f(tf.constant(2.0)).numpy()
    tf.profiler.experimental.stop()
    peaks = allocation_peaks(sys.argv[1])
    print("PEAKS " + json.dumps({n: [p.requested_peak_bytes, p.allocated_peak_bytes,
        p.events, [t.requested_bytes for t in p.live_at_peak]] for n, p in peaks.items()}))
    """
)


def test_a_traced_function_s_peak_is_its_live_tensors(tmp_path):
    root = str(pathlib.Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", JOB, str(tmp_path / "trace"), root],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("PEAKS "))
    peaks = json.loads(line[6:])
    requested, allocated, events, live = max(peaks.values(), key=lambda p: p[0])
    # a and b are live together; c comes after they are freed (a + b + c: 12 MiB).
    assert 2 * 4 * MIB <= requested < 3 * 4 * MIB, requested
    assert allocated >= requested
    assert events >= 6  # three 4 MiB allocations and their frees at least
    assert sorted(live, reverse=True)[:2] == [4 * MIB] * 2


def test_a_directory_without_a_trace_is_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no .xplane.pb written under {tmp_path}"):
        allocation_peaks(str(tmp_path))


def test_a_file_that_is_not_a_trace_is_refused(tmp_path):
    missing = tmp_path / "absent.xplane.pb"
    with pytest.raises(FileNotFoundError):
        allocation_peaks(str(missing))
    bad = tmp_path / "bad.xplane.pb"
    bad.write_bytes(b"\xff\xff\xff not a protobuf")
    with pytest.raises(DecodeError):
        allocation_peaks(str(bad))
