"""Bulk decoding of a time series read from TensorBoard's Rust data server.

With ``--load_fast=true`` TensorBoard's data provider is a ``GrpcDataProvider``. Its
``read_tensors`` turns every point into a numpy array with ``tensor_util.make_ndarray``,
one Python call per step: 100,000 steps of the 3 x 7 tier matrix take about 4.5 s, of
which the RPC itself is about 0.6 s. This module issues the same ``ReadTensors`` RPC to
the same data server and decodes the answer in bulk (the float64 ``tensor_content`` of
every point joined into one buffer, about 0.25 s for those 100,000 steps).

It needs the provider's gRPC stub, a private attribute (``_stub``) of TensorBoard's
``GrpcDataProvider``; :func:`read_series` returns None whenever that is not available
(another provider, another TensorBoard version) or a point is not a float64 tensor of
the expected shape, and the caller then uses the public ``read_tensors``. The answers are
the same either way (``tests/test_plugin.py`` checks the decoding against
``tensor_util.make_ndarray``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tensorboard.compat.proto import types_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RawSeries:
    """Every point of one time series, decoded."""

    steps: np.ndarray  # [N] int64
    wall_times: np.ndarray  # [N] float64, seconds since the epoch
    cells: np.ndarray  # [N, prod(shape)] float64
    skipped: int = 0  # points before these (step <= after_step), not decoded


def decode_points(
    steps: Sequence[int],
    wall_times: Sequence[float],
    tensors: Sequence[Any],
    shape: tuple[int, ...],
) -> RawSeries | None:
    """Decode TensorProtos of float64 tensors of one shape into one array.

    Args:
        steps: the points' steps.
        wall_times: the points' wall times (seconds).
        tensors: the points' ``TensorProto`` messages.
        shape: the shape every tensor must have.

    Returns:
        The decoded series, or None when a tensor is not float64 with this shape in
        ``tensor_content`` (the caller then decodes point by point).
    """
    width = int(np.prod(shape)) if shape else 1
    dims = list(shape)
    parts = []
    for tensor in tensors:
        if (
            tensor.dtype != types_pb2.DT_DOUBLE
            or [d.size for d in tensor.tensor_shape.dim] != dims
            or len(tensor.tensor_content) != 8 * width
        ):
            return None
        parts.append(tensor.tensor_content)
    cells = np.frombuffer(b"".join(parts), dtype="<f8").reshape(len(parts), width)
    return RawSeries(
        np.asarray(steps, dtype=np.int64),
        np.asarray(wall_times, dtype=np.float64),
        cells.astype(np.float64, copy=True),  # writable, native byte order
    )


def read_series(
    data_provider: Any,
    experiment: str,
    plugin_name: str,
    run: str,
    tag: str,
    downsample: int,
    shape: tuple[int, ...],
    after_step: int = -1,
) -> RawSeries | None:
    """Read one float64 time series straight from a ``GrpcDataProvider``'s data server.

    The server answers every stored point; only those with a step after ``after_step``
    are decoded (the others are counted in ``skipped``), so a reader that already holds
    the earlier steps decodes only the new ones.

    Args:
        data_provider: TensorBoard's data provider.
        experiment: the experiment id.
        plugin_name: the plugin whose summaries to read.
        run: the run name.
        tag: the tag.
        downsample: the most points to return (as ``read_tensors``'s ``downsample``).
        shape: the tensor shape of every point.
        after_step: decode only the points with a larger step (default: all).

    Returns:
        The series, or None when the fast path does not apply (see the module docstring).
    """
    stub = getattr(data_provider, "_stub", None)
    if stub is None or not hasattr(stub, "ReadTensors"):
        return None
    try:
        from tensorboard.data.proto import data_provider_pb2

        req = data_provider_pb2.ReadTensorsRequest()
        req.experiment_id = experiment
        req.plugin_filter.plugin_name = plugin_name
        req.run_tag_filter.runs.names.append(run)
        req.run_tag_filter.tags.names.append(tag)
        req.downsample.num_points = downsample
        res = stub.ReadTensors(req)
    except Exception as exc:  # noqa: BLE001 - any failure: use the public path
        logger.debug("fast read of %r/%r failed, using read_tensors: %s", run, tag, exc)
        return None
    for run_entry in res.runs:
        if run_entry.run_name != run:
            continue
        for tag_entry in run_entry.tags:
            if tag_entry.tag_name == tag:
                d = tag_entry.data
                steps = np.asarray(d.step, dtype=np.int64)
                skip = int(np.searchsorted(steps, after_step, side="right"))
                raw = decode_points(steps[skip:], d.wall_time[skip:], d.value[skip:], shape)
                return None if raw is None else dataclasses.replace(raw, skipped=skip)
    return RawSeries(np.zeros(0, np.int64), np.zeros(0), np.zeros((0, int(np.prod(shape)))))
