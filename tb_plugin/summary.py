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
import struct
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
    and makes further writes raise ``RuntimeError``. Events written with ``hold=True``
    (:meth:`record`) wait in memory until :meth:`release` hands them to the file writer's
    thread together (one wake-up of that thread per batch instead of per event); any
    other write, :meth:`flush` and :meth:`close` release them first, so the file keeps the
    order of the calls.
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
        self._held: list[bytes] = []  # serialised events written with hold=True

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
        self,
        values: list[summary_pb2.Summary.Value],
        step: int,
        wall_time: float | None,
        hold: bool = False,
    ) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        event = event_pb2.Event(
            wall_time=time.time() if wall_time is None else wall_time,
            step=int(step),
            summary=summary_pb2.Summary(value=values),
        )
        self._queue(
            event.SerializeToString(), [v.tag for v in values if v.HasField("metadata")], hold
        )

    def _queue(self, data: bytes, metadata_tags: list[str], hold: bool) -> None:
        """Hand one serialised event to the file writer (or hold it, :meth:`release`) and
        mark the tags whose metadata it carries as written."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"SummaryWriter for {self.logdir!r} is closed")
            if hold:
                self._held.append(data)
            else:
                self._release_locked()
                self._writer.add_serialized_event(data)
            self._tags_written.update(metadata_tags)

    def release(self) -> None:
        """Hand the events held so far (``hold=True``) to the file writer, at once."""
        with self._lock:
            if not self._closed:
                self._release_locked()

    def _release_locked(self) -> None:
        if self._held:
            held, self._held = self._held, []
            self._writer.add_serialized_events(held)

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
        arr = np.array(_vector_cells(tag, values), dtype=np.float64)
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
        row_names, columns = metadata.LAYOUTS[tag][1:3]
        cells = _matrix_cells(tag, rows)
        arr = np.array(cells, dtype=np.float64).reshape(len(row_names), len(columns))
        return self._value(tag, arr)

    def record(
        self,
        step: int,
        *,
        matrices: Mapping[str, Mapping[str, Mapping[str, float]]] = {},  # noqa: B006
        vectors: Mapping[str, Mapping[str, float]] = {},  # noqa: B006
        scalars: Mapping[str, float] = {},  # noqa: B006
        wall_time: float | None = None,
        hold: bool = False,
    ) -> None:
        """Write one step's matrix, vector and scalar tags as ONE event (one record in
        the file instead of one per tag: less framing, fewer CRCs and queue hand-overs).
        Readers see exactly what :meth:`matrix`, :meth:`vector` and :meth:`scalars` would
        have written at that step. Once every tag's metadata is in the file, the event's
        bytes are put together from per-tag prefixes and the packed cells, without
        building protos (the same bytes, ``_encode_record``).

        Args:
            step: the training step (int >= 0).
            matrices: matrix tag -> rows (as :meth:`matrix`).
            vectors: vector tag -> values (as :meth:`vector`).
            scalars: scalar tag -> finite value (as :meth:`scalars`).
            wall_time: seconds since the epoch (default: now).
            hold: True keeps the event in memory until :meth:`release` (or any other
                write, :meth:`flush`, :meth:`close`); False (default) queues it now.

        Raises:
            ValueError: as :meth:`matrix`, :meth:`vector` and :meth:`scalars`.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        written = self._tags_written
        if (
            written.issuperset(matrices)
            and written.issuperset(vectors)
            and written.issuperset(scalars)
        ):
            # Every tag's metadata is in the file: encode the event from precomputed bytes.
            data = _encode_record(
                step, time.time() if wall_time is None else wall_time, matrices, vectors, scalars
            )
            if data is not None:
                self._queue(data, [], hold)
                return
        values = [self._matrix_value(tag, rows) for tag, rows in matrices.items()]
        values += [self._vector_value(tag, v) for tag, v in vectors.items()]
        values += self._scalar_values(scalars)
        if values:
            self._write_values(values, step, wall_time, hold)

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
            _check_scalar(tag, v)
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
        """Write everything queued or held to disk (blocks until written)."""
        with self._lock:
            if not self._closed:
                self._release_locked()
                self._writer.flush()

    def close(self) -> None:
        """Write everything queued or held, and close the event file; idempotent."""
        with self._lock:
            if not self._closed:
                self._release_locked()
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


def _vector_cells(tag: str, values: Mapping[str, float]) -> list[float]:
    """The float64 cells of vector ``tag`` (NaN for a missing column), in column order.

    Raises:
        ValueError: ``tag`` is not a vector tag, or ``values`` names unknown columns.
    """
    kind, _rows, columns, _units = metadata.LAYOUTS[tag]
    if kind != metadata.KIND_VECTOR:
        raise ValueError(f"tag {tag!r} is a {kind} tag, not a vector tag")
    if not _column_set(tag).issuperset(values):
        unknown = set(values) - set(columns)
        raise ValueError(f"unknown columns {sorted(unknown)} for {tag!r}; known: {columns}")
    return [_num(values.get(c)) for c in columns]


def _matrix_cells(tag: str, rows: Mapping[str, Mapping[str, float]]) -> list[float]:
    """The float64 cells of matrix ``tag``, row-major (NaN for a missing row or cell).

    Raises:
        ValueError: ``tag`` is not a matrix tag, or ``rows`` names unknown rows or columns.
    """
    kind, row_names, columns, _units = metadata.LAYOUTS[tag]
    if kind != metadata.KIND_MATRIX:
        raise ValueError(f"tag {tag!r} is a {kind} tag, not a matrix tag")
    unknown_rows = set(rows) - set(row_names)
    if unknown_rows:
        raise ValueError(f"unknown rows {sorted(unknown_rows)} for {tag!r}; known: {row_names}")
    known = _column_set(tag)
    out: list[float] = []
    for r in row_names:
        cells = rows.get(r, {})
        if not known.issuperset(cells):
            unknown = set(cells) - set(columns)
            raise ValueError(f"unknown columns {sorted(unknown)} for {tag!r}; known: {columns}")
        out.extend(_num(cells.get(c)) for c in columns)
    return out


def _check_scalar(tag: str, value: float) -> None:
    """Raise ValueError unless ``tag`` is one of :data:`metadata.SCALAR_TAGS` and ``value``
    is finite."""
    if tag not in metadata.SCALAR_TAGS:
        raise ValueError(f"unknown scalar tag {tag!r}; known: {sorted(metadata.SCALAR_TAGS)}")
    if not math.isfinite(value):
        raise ValueError(f"scalar {tag!r} must be finite, got {value!r}")


@functools.cache
def _column_set(tag: str) -> frozenset[str]:
    return frozenset(metadata.LAYOUTS[tag][2])


# -- the per-step record from precomputed bytes ------------------------------------------
# A telemetry record is the same few tags at every step, each a fixed-shape tensor; once
# their metadata is in the file, the only bytes that change are the cells, the step and
# the wall time. The Summary.Value bytes before the cells are taken once per tag from
# protobuf's own serialisation (fields are written in field-number order, and the cells
# are the last field: ``TensorProto.tensor_content`` for float64, ``float_val`` for the
# float32 scalars), so an event costs a struct.pack per tag instead of building and
# serialising ~20 protos (tests/test_telemetry_event_file.py checks the bytes are equal).


def _varint(n: int) -> bytes:
    """Protobuf base-128 varint of ``n`` >= 0."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


@functools.cache
def _tensor_prefix(tag: str) -> tuple[bytes, struct.Struct]:
    """(Summary.Value bytes of float64 tag ``tag`` up to its cells, the cells' packer)."""
    kind, rows, columns, _units = metadata.LAYOUTS[tag]
    shape = (len(rows), len(columns)) if kind == metadata.KIND_MATRIX else (len(columns),)
    size = 8 * math.prod(shape)
    template = summary_pb2.Summary.Value(tag=tag, tensor=_tensor_proto(np.zeros(shape)))
    data = template.SerializeToString()
    if not data.endswith(bytes(size)):
        raise AssertionError(f"Summary.Value of {tag!r} does not end with its cells")
    return data[:-size], struct.Struct(f"<{size // 8}d")


@functools.cache
def _scalar_prefix(tag: str) -> bytes:
    """Summary.Value bytes of scalar ``tag`` (float32, no metadata) up to its value."""
    template = summary_pb2.Summary.Value(
        tag=tag,
        tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[0.0], tensor_shape={}),
    )
    data = template.SerializeToString()
    if not data.endswith(bytes(4)):
        raise AssertionError(f"Summary.Value of {tag!r} does not end with its value")
    return data[:-4]


_F32 = struct.Struct("<f")
_F64 = struct.Struct("<d")


def _encode_record(
    step: int,
    wall_time: float,
    matrices: Mapping[str, Mapping[str, Mapping[str, float]]],
    vectors: Mapping[str, Mapping[str, float]],
    scalars: Mapping[str, float],
) -> bytes | None:
    """The serialised ``Event`` :meth:`SummaryWriter.record` writes for tags whose metadata
    is in the file already (byte for byte what protobuf writes); None when a scalar does
    not fit a float32 (the caller builds the protos instead).

    Raises:
        ValueError: as :meth:`SummaryWriter.record`.
    """
    values = []
    for tag, rows in matrices.items():
        prefix, packer = _tensor_prefix(tag)
        values.append(prefix + packer.pack(*_matrix_cells(tag, rows)))
    for tag, cells in vectors.items():
        prefix, packer = _tensor_prefix(tag)
        values.append(prefix + packer.pack(*_vector_cells(tag, cells)))
    for tag, v in scalars.items():
        _check_scalar(tag, v)
        try:
            values.append(_scalar_prefix(tag) + _F32.pack(v))
        except OverflowError:  # beyond float32: let protobuf decide
            return None
    summary = b"".join([_field(1, v) for v in values])
    head = b"\x09" + _F64.pack(wall_time) if wall_time != 0.0 else b""
    if step:
        head += b"\x10" + _varint(step)
    return head + _field(5, summary)


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
