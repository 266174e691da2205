"""Stage 3 on the units path: a training step's device peak is bounded by a few units'
working set, not by the model: the device peak per step, measured by the allocator, <=
two wrapping units' gathered parameters + activations + persistent parameters.

Measured by TensorFlow's BFC allocator in a fresh process per model
(tests/helpers/units_peak_job.py): the in-use bytes above the step's start over one
training step (both replicas), parameter shards and Adam states on the host (the
ZeRO-Infinity configuration: the update during backward, no gradient shard waits on the
device). Models: a chain of ``Dense(512)`` and the same layers with a residual around
each (a DAG), 8 and 24 hidden layers (units of 1.05 MB float32 each; the units path has
no persistent parameters: every original is sharded).

What a unit's use holds on the CPU stand-in, per replica: in a gather, the all-gather
output and the views cut from it (column slices, copies); in a backward, the views and
their gradient, then the gradient and its flat copy laid out for the one collective. A
backward's gather waits for the previous use's reduce-scatter
(``UnitRunner._backward_dep``) and the reduce-scatter for the input gradients, so these
pairs do not overlap: **2 units** of tensors, the issue's bound. Measured two ways in the
same step:

- the working set: the peak of the live tensors' *requested* bytes, replayed from the
  allocator's own events in a profiler trace (``zero_runtime/telemetry/alloc_trace.py``);
  2.07-2.2 units per replica with activations (2.5-2.6 before the ordering);
- the allocator's in-use peak (``get_memory_info``), which counts BFC's chunks: a chunk
  is split only when it is at least twice the request, so a 1 MiB tensor may hold up to
  2 MiB. Measured 2.6-2.9 units; bounded here by twice the working-set bound.

Shown here:

- the peak does not grow with depth beyond the activations: 24 layers peak within the
  8-layer peak plus the 16 extra layers' activation bytes and one unit;
- the working set is at most ``N x 2 units + activations``, about a tenth of all 25
  units gathered on both replicas (the bound is a real limit);
- the trace's replay agrees with the allocator's own in-use peak.

Activations, bounded per layer by three tensors of its output's size (the input a use
keeps for its backward, the recompute's output, its gradient): ``3 x B x 512 x 4`` bytes
per layer over the global batch ``B``.
"""

from __future__ import annotations

import os

import pytest
from helpers.jobs import run_json_jobs

JOB = os.path.join(os.path.dirname(__file__), "helpers", "units_peak_job.py")
N = 2  # replicas (conftest.TEST_REPLICAS; the job configures its own two)
WIDTH, BATCH = 512, 8  # units_peak_job.WIDTH, BATCH
UNITS_PER_STEP = 2  # the bound: gathered + views, views + gradient, gradient + flat
CHUNK_SLACK = 2  # BFC hands out chunks up to twice the request (module docstring)


def _peaks(tmp_path, kind: str, depths: tuple[int, ...]) -> list[dict]:
    """Each depth's record, the jobs run side by side in fresh processes."""
    return run_json_jobs(
        [
            (
                [JOB, str(tmp_path / f"{kind}{d}.json"), kind, str(d), "cpu"],
                tmp_path / f"{kind}{d}.json",
            )
            for d in depths
        ]
    )


def _activations(depth: int) -> int:
    """Bytes: three tensors of each layer's output (hidden layers and head) per sample."""
    return 3 * BATCH * WIDTH * 4 * (depth + 1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chain", "residual"])
def test_a_units_step_peaks_at_a_few_units_whatever_the_depth(kind, tmp_path):
    shallow, deep = _peaks(tmp_path, kind, (8, 24))
    unit = deep["unit_bytes"]
    for name, rec in (("8", shallow), ("24", deep)):
        print(
            f"{kind} {name} layers: working set {rec['requested_peak']} B "
            f"({rec['requested_peak'] / (N * unit):.2f} units per replica), allocator in-use "
            f"{rec['peak']} B ({rec['peak'] / (N * unit):.2f}); live at the peak: "
            + ", ".join(
                f"{t['op'].split('/')[-1]} {t['requested_bytes']}" for t in rec["live_at_peak"][:4]
            )
        )
    assert deep["units"] == 25 and shallow["units"] == 9
    for rec in (shallow, deep):
        # The replay of the allocator's events finds the allocator's own peak.
        assert abs(rec["traced_allocated_peak"] - rec["peak"]) <= 0.01 * rec["peak"]
        assert rec["requested_peak"] <= rec["peak"]
    # Not the model: 16 more layers add their activations (and scheduling noise within
    # one unit), not their parameters (33.6 MB gathered on both replicas).
    grown = _activations(24) - _activations(8) + N * unit
    assert deep["requested_peak"] - shallow["requested_peak"] <= grown
    assert deep["peak"] - shallow["peak"] <= grown
    bound = N * UNITS_PER_STEP * unit + _activations(24)
    assert 0 < deep["requested_peak"] <= bound
    assert shallow["requested_peak"] <= N * UNITS_PER_STEP * unit + _activations(8)
    assert deep["peak"] <= CHUNK_SLACK * bound
    assert bound < 0.125 * N * deep["units"] * unit  # a real limit: all units gathered
