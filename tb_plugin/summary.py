"""Write side of the Memory Hierarchy summaries (no server code here).

The runtime calls these functions from Python (outside TensorFlow graphs, from any
thread), so the writer is :class:`tb_plugin.event_file.EventFileWriter` (TensorBoard's
event file format, record checksums in C) and TensorBoard's protos, not ``tf.summary``:
writing a record costs no TensorFlow op and no graph trace.
Layouts and tag names are defined in :mod:`tb_plugin.metadata`.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tensorboard.compat.proto import (
    event_pb2,
    summary_pb2,
    tensor_pb2,
    tensor_shape_pb2,
    types_pb2,
)
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.util import tensor_util

from tb_plugin import metadata
from tb_plugin.event_file import EventFileWriter


class SummaryWriter:
    """Append Memory Hierarchy summaries to one run's event file.

    Args:
        logdir: the run's directory (created if missing). One writer per run.
        flush_secs: the background writer flushes at least this often (seconds,
            default 2.0, so a live run shows up in TensorBoard within seconds).
        filename_suffix: appended to the event file name (default ``".memory_hierarchy"``).

    The writer is thread-safe. Lifecycle: open after construction; :meth:`close` flushes
    and makes further writes raise ``RuntimeError``.
    """

    def __init__(
        self, logdir: str, flush_secs: float = 2.0, filename_suffix: str = ".memory_hierarchy"
    ) -> None:
        self.logdir = str(logdir)
        self._writer = EventFileWriter(
            self.logdir, max_queue_size=1024, flush_secs=flush_secs, filename_suffix=filename_suffix
        )
        self._lock = threading.Lock()
        self._closed = False
        self._tags_written: set[str] = set()  # tags whose metadata is in the file already

    # -- low level -----------------------------------------------------------------------
    def _write(self, tag: str, step: int, tensor: np.ndarray, wall_time: float | None) -> None:
        self._write_values([self._value(tag, tensor)], step, wall_time)

    def _value(self, tag: str, tensor: np.ndarray) -> summary_pb2.Summary.Value:
        value = summary_pb2.Summary.Value(tag=tag, tensor=_tensor_proto(tensor))
        self._with_metadata(value, _metadata)
        return value

    def _with_metadata(self, value: summary_pb2.Summary.Value, make) -> None:  # noqa: ANN001
        """Metadata on a tag's first value in this file only, as ``tf.summary`` writes it:
        TensorBoard's readers (the Rust data server, the Python multiplexer through
        ``dataclass_compat``) take a time series' metadata from its first value, and half
        of a record's bytes are metadata."""
        if value.tag not in self._tags_written:  # marked written by _write_values
            value.metadata.CopyFrom(make(value.tag))

    def _write_values(
        self, values: list[summary_pb2.Summary.Value], step: int, wall_time: float | None
    ) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        event = event_pb2.Event(
            wall_time=time.time() if wall_time is None else wall_time,
            step=int(step),
            summary=summary_pb2.Summary(value=values),
        )
        with self._lock:
            if self._closed:
                raise RuntimeError(f"SummaryWriter for {self.logdir!r} is closed")
            self._writer.add_event(event)
            self._tags_written.update(v.tag for v in values if v.HasField("metadata"))

    def vector(
        self, tag: str, step: int, values: Mapping[str, float], wall_time: float | None = None
    ) -> None:
        """Write a ``vector`` tag: one float64 per documented column.

        Args:
            tag: a tag whose layout kind is ``vector`` (for example ``TAG_PAGES``).
            step: the training step (int >= 0).
            values: column name -> value in the column's unit; a missing column is
                written as NaN (not measured).
            wall_time: seconds since the epoch (default: now).

        Raises:
            ValueError: unknown column names, or the tag is not a vector tag.
        """
        self._write_values([self._vector_value(tag, values)], step, wall_time)

    def _vector_value(self, tag: str, values: Mapping[str, float]) -> summary_pb2.Summary.Value:
        kind, _rows, columns, _units = metadata.LAYOUTS[tag]
        if kind != metadata.KIND_VECTOR:
            raise ValueError(f"tag {tag!r} is a {kind} tag, not a vector tag")
        unknown = set(values) - set(columns)
        if unknown:
            raise ValueError(f"unknown columns {sorted(unknown)} for {tag!r}; known: {columns}")
        arr = np.array([_num(values.get(c)) for c in columns], dtype=np.float64)
        return self._value(tag, arr)

    def matrix(
        self,
        tag: str,
        step: int,
        rows: Mapping[str, Mapping[str, float]],
        wall_time: float | None = None,
    ) -> None:
        """Write a ``matrix`` tag, float64 ``[len(rows), len(columns)]``.

        Args:
            tag: a tag whose layout kind is ``matrix`` (``TAG_TIERS``).
            step: the training step.
            rows: row name -> (column name -> value); missing cells are NaN.
            wall_time: seconds since the epoch (default: now).

        Raises:
            ValueError: unknown row or column names, or the tag is not a matrix tag.
        """
        self._write_values([self._matrix_value(tag, rows)], step, wall_time)

    def _matrix_value(
        self, tag: str, rows: Mapping[str, Mapping[str, float]]
    ) -> summary_pb2.Summary.Value:
        kind, row_names, columns, _units = metadata.LAYOUTS[tag]
        if kind != metadata.KIND_MATRIX:
            raise ValueError(f"tag {tag!r} is a {kind} tag, not a matrix tag")
        unknown_rows = set(rows) - set(row_names)
        if unknown_rows:
            raise ValueError(f"unknown rows {sorted(unknown_rows)} for {tag!r}; known: {row_names}")
        arr = np.full((len(row_names), len(columns)), np.nan, dtype=np.float64)
        for i, r in enumerate(row_names):
            cells = rows.get(r, {})
            unknown = set(cells) - set(columns)
            if unknown:
                raise ValueError(f"unknown columns {sorted(unknown)} for {tag!r}; known: {columns}")
            for j, c in enumerate(columns):
                arr[i, j] = _num(cells.get(c))
        return self._value(tag, arr)

    def record(
        self,
        step: int,
        *,
        matrices: Mapping[str, Mapping[str, Mapping[str, float]]] = {},  # noqa: B006
        vectors: Mapping[str, Mapping[str, float]] = {},  # noqa: B006
        scalars: Mapping[str, float] = {},  # noqa: B006
        wall_time: float | None = None,
    ) -> None:
        """Write one step's matrix, vector and scalar tags as ONE event (one record in
        the file instead of one per tag: less framing, fewer CRCs and queue hand-overs).
        Readers see exactly what :meth:`matrix`, :meth:`vector` and :meth:`scalars` would
        have written at that step.

        Args:
            step: the training step (int >= 0).
            matrices: matrix tag -> rows (as :meth:`matrix`).
            vectors: vector tag -> values (as :meth:`vector`).
            scalars: scalar tag -> finite value (as :meth:`scalars`).
            wall_time: seconds since the epoch (default: now).

        Raises:
            ValueError: as :meth:`matrix`, :meth:`vector` and :meth:`scalars`.
        """
        values = [self._matrix_value(tag, rows) for tag, rows in matrices.items()]
        values += [self._vector_value(tag, v) for tag, v in vectors.items()]
        values += self._scalar_values(scalars)
        if values:
            self._write_values(values, step, wall_time)

    def json(
        self, tag: str, step: int, obj: Mapping[str, Any], wall_time: float | None = None
    ) -> None:
        """Write a ``json`` tag: one UTF-8 JSON object as a scalar string tensor.

        Args:
            tag: a tag whose layout kind is ``json``.
            step: the training step.
            obj: a JSON-serialisable mapping (NaN and infinities are written as null).
            wall_time: seconds since the epoch (default: now).

        Raises:
            ValueError: the tag is not a json tag.
            TypeError: ``obj`` is not JSON-serialisable.
        """
        kind = metadata.LAYOUTS[tag][0]
        if kind != metadata.KIND_JSON:
            raise ValueError(f"tag {tag!r} is a {kind} tag, not a json tag")
        text = json.dumps(_finite(obj), allow_nan=False, sort_keys=True)
        self._write(tag, step, np.array(text.encode("utf-8"), dtype=object), wall_time)

    def scalars(
        self, step: int, values: Mapping[str, float], wall_time: float | None = None
    ) -> None:
        """Write standard TensorBoard scalars (what ``tf.summary.scalar`` writes: plugin
        ``scalars``, ``DATA_CLASS_SCALAR``, a float32 scalar tensor), in one event; the
        summary metadata goes with each tag's first value in the file.

        Args:
            step: the training step (int >= 0).
            values: tag (one of :data:`tb_plugin.metadata.SCALAR_TAGS`) -> finite value.
            wall_time: seconds since the epoch (default: now).

        Raises:
            ValueError: an unknown tag or a non-finite value.
        """
        protos = self._scalar_values(values)
        if protos:
            self._write_values(protos, step, wall_time)

    def _scalar_values(self, values: Mapping[str, float]) -> list[summary_pb2.Summary.Value]:
        protos = []
        for tag, v in values.items():
            if tag not in metadata.SCALAR_TAGS:
                raise ValueError(
                    f"unknown scalar tag {tag!r}; known: {sorted(metadata.SCALAR_TAGS)}"
                )
            if not math.isfinite(v):
                raise ValueError(f"scalar {tag!r} must be finite, got {v!r}")
            value = summary_pb2.Summary.Value(
                tag=tag,
                tensor=tensor_pb2.TensorProto(
                    dtype=types_pb2.DT_FLOAT, float_val=[v], tensor_shape={}
                ),
            )
            self._with_metadata(value, _scalar_metadata)
            protos.append(value)
        return protos

    def flush(self) -> None:
        """Write everything queued to disk (blocks until written)."""
        with self._lock:
            if not self._closed:
                self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; idempotent."""
        with self._lock:
            if not self._closed:
                self._writer.close()
                self._closed = True


@functools.cache
def _scalar_metadata(tag: str) -> summary_pb2.SummaryMetadata:
    return scalar_metadata.create_summary_metadata(
        display_name=tag, description=f"unit: {metadata.SCALAR_TAGS[tag]}"
    )


@functools.cache
def _metadata(tag: str) -> summary_pb2.SummaryMetadata:
    return metadata.create_summary_metadata(tag)


def _tensor_proto(array: np.ndarray) -> tensor_pb2.TensorProto:
    """A TensorProto for a float64 array (packed bytes) or a scalar bytes object."""
    if array.dtype == np.float64:
        proto = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_DOUBLE, tensor_content=np.ascontiguousarray(array).tobytes()
        )
        proto.tensor_shape.dim.extend(
            tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in array.shape
        )
        return proto
    return tensor_util.make_tensor_proto(array)


def _num(value: float | None) -> float:
    if value is None:
        return math.nan
    return float(value)


def _finite(obj: Any) -> Any:
    """Replace non-finite floats by None, recursively, so the JSON is strict."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        return [_finite(v) for v in obj]
    if isinstance(obj, np.generic):
        return _finite(obj.item())
    return obj
