"""tb_plugin.event_file: the runtime's event file writer (record checksums in C) writes
what TensorBoard's own writer writes, and TensorBoard and TensorFlow read it back."""

from __future__ import annotations

import math
import os
import struct
import time

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as slow_crc
from tensorboard.summary.writer.event_file_writer import EventFileWriter as TbWriter
from tensorboard.util import tensor_util

from tb_plugin import event_file, metadata
from tb_plugin import summary as summary_module
from tb_plugin.summary import SummaryWriter


def events(n: int) -> list[event_pb2.Event]:
    """n events of growing size (a tensor summary each), steps 0 .. n-1."""
    out = []
    for step in range(n):
        proto = tensor_util.make_tensor_proto(np.arange(step + 1, dtype=np.float64))
        value = summary_pb2.Summary.Value(tag=f"t{step % 3}", tensor=proto)
        out.append(
            event_pb2.Event(
                wall_time=1.5 + step, step=step, summary=summary_pb2.Summary(value=[value])
            )
        )
    return out


def records(path: str) -> list[bytes]:
    """The raw TFRecords of a file (framing included), split by their length fields."""
    data = open(path, "rb").read()
    out, at = [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        out.append(data[at : at + 16 + length])
        at += 16 + length
    assert at == len(data)
    return out


def only_file(logdir) -> str:
    (name,) = os.listdir(logdir)
    return os.path.join(logdir, name)


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 1000, 65537])
def test_masked_crc32c_is_tensorboards(size):
    data = np.random.default_rng(size).bytes(size)
    assert event_file.masked_crc32c(data) == slow_crc(data)


def test_records_are_byte_for_byte_tensorboards(tmp_path):
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    ours = event_file.EventFileWriter(str(ours_dir), filename_suffix=".x")
    theirs = TbWriter(str(theirs_dir), filename_suffix=".x")
    for event in events(50):
        ours.add_event(event)
        theirs.add_event(event)
    ours.close()
    theirs.close()
    ours_path = only_file(ours_dir)
    assert os.path.basename(ours_path).startswith("events.out.tfevents.")
    assert f".{os.getpid()}." in ours_path and ours_path.endswith(".x")
    mine, tb = records(ours_path), records(only_file(theirs_dir))
    assert len(mine) == len(tb) == 51
    assert mine[1:] == tb[1:]  # the first is the file_version event (its own wall time)
    first = event_pb2.Event.FromString(mine[0][12:-4])
    assert first.file_version == "brain.Event:2"


def test_tensorflow_and_tensorboard_read_it_back_with_checksums(tmp_path):
    writer = event_file.EventFileWriter(str(tmp_path))
    written = events(20)
    for event in written:
        writer.add_event(event)
    writer.close()
    path = only_file(tmp_path)
    # tf.data verifies both checksums of every record.
    raw = [r.numpy() for r in tf.data.TFRecordDataset(path)]
    assert [event_pb2.Event.FromString(r) for r in raw[1:]] == written
    loaded = list(event_file_loader.EventFileLoader(path).Load())
    assert [e.step for e in loaded[1:]] == list(range(20))
    # A flipped byte fails the check.
    data = bytearray(open(path, "rb").read())
    data[-10] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(tf.errors.DataLossError):
        list(tf.data.TFRecordDataset(path))


def test_flushed_within_flush_secs_without_a_flush_call(tmp_path):
    writer = event_file.EventFileWriter(str(tmp_path), flush_secs=0.2)
    path = only_file(tmp_path)
    size = os.path.getsize(path)  # the file_version event, written at once
    writer.add_event(events(1)[0])
    deadline = time.monotonic() + 10.0
    while os.path.getsize(path) == size and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.getsize(path) > size
    writer.close()


def test_bad_event_and_closed_writer_are_refused(tmp_path):
    writer = event_file.EventFileWriter(str(tmp_path))
    with pytest.raises(TypeError, match="expected an event_pb2.Event proto"):
        writer.add_event(b"bytes")  # type: ignore[arg-type]
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(OSError, match="is closed"):
        writer.add_event(events(1)[0])
    with pytest.raises(OSError, match="is closed"):
        writer.flush()


def test_summary_writer_files_read_by_tensorboard(tmp_path):
    """The plugin's SummaryWriter (on this writer): tiers and scalars read back by TF."""
    writer = SummaryWriter(str(tmp_path))
    tiers = {"device": {"used_bytes": 5.0}, "host": {"used_bytes": 7.0}}
    writer.record(
        3, matrices={metadata.TAG_TIERS: tiers}, scalars={"zero/timing/step_seconds": 0.25}
    )
    writer.close()
    raw = [
        event_pb2.Event.FromString(r.numpy()) for r in tf.data.TFRecordDataset(only_file(tmp_path))
    ]
    (event,) = [e for e in raw if e.step == 3]
    values = {v.tag: v for v in event.summary.value}
    grid = tf.make_ndarray(values[metadata.TAG_TIERS].tensor)
    assert grid[0, 0] == 5.0 and grid[1, 0] == 7.0
    assert tf.make_ndarray(values["zero/timing/step_seconds"].tensor) == pytest.approx(0.25)


def _record_args(step: int) -> dict:
    """One telemetry record's tags with step-dependent cells (NaN and missing cells too)."""
    return {
        "matrices": {
            metadata.TAG_TIERS: {
                "device": {"used_bytes": 5.0 * step, "peak_bytes": 1e12 + step},
                "host": {"used_bytes": 7.0, "capacity_bytes": math.nan},
            }
        },
        "vectors": {
            metadata.TAG_READINGS: {"process_rss_bytes": 123456789.0 + step},
            metadata.TAG_TIMING: {"step_seconds": 0.0291 * (step + 1), "traced": 0.0},
        },
        "scalars": {"zero/timing/step_seconds": 0.0291 * (step + 1), "zero/host/used_bytes": 7.0},
    }


@pytest.mark.parametrize("step", [0, 1, 127, 128, 300, 2**40])
def test_fast_record_bytes_equal_protobufs(tmp_path, step):
    """Once a record's tags carry their metadata in the file, ``record`` puts the event
    together from per-tag prefixes (no protos); the bytes are protobuf's own."""
    writer = SummaryWriter(str(tmp_path))
    writer.record(0, **_record_args(0))  # the first values carry the metadata
    args = _record_args(step)
    wall_time = 1796281387.637240 + step
    fast = summary_module._encode_record(step, wall_time, **args)
    values = [writer._matrix_value(t, rows) for t, rows in args["matrices"].items()]
    values += [writer._vector_value(t, v) for t, v in args["vectors"].items()]
    values += writer._scalar_values(args["scalars"])
    assert not any(v.HasField("metadata") for v in values)
    summary = summary_pb2.Summary(value=values)
    proto = event_pb2.Event(wall_time=wall_time, step=step, summary=summary)
    assert fast == proto.SerializeToString()
    writer.close()


def test_held_records_are_written_at_release_in_call_order(tmp_path):
    """hold=True keeps a record in memory until release (or any other write, flush,
    close); every record ends up in the file once, in call order, with the metadata on
    each tag's first value only, and TensorFlow reads every checksum."""
    writer = SummaryWriter(str(tmp_path))
    for step in range(5):
        writer.record(step, hold=True, **_record_args(step))
    time.sleep(0.1)
    assert len(records(only_file(tmp_path))) == 1  # only the file_version event so far
    writer.release()
    writer.json(metadata.TAG_PLACEMENT, 5, {"variables": []})
    writer.record(6, hold=True, **_record_args(6))
    writer.flush()
    writer.record(7, hold=True, **_record_args(7))
    writer.close()  # writes the held step 7
    raw = [
        event_pb2.Event.FromString(r.numpy()) for r in tf.data.TFRecordDataset(only_file(tmp_path))
    ]
    assert [e.step for e in raw[1:]] == list(range(8))
    with_metadata = [v.tag for e in raw for v in e.summary.value if v.HasField("metadata")]
    assert sorted(with_metadata) == sorted(set(with_metadata))  # once per tag
    for e in raw[1:]:
        if e.step == 5:
            continue
        values = {v.tag: v for v in e.summary.value}
        grid = tf.make_ndarray(values[metadata.TAG_TIERS].tensor)
        assert grid.shape == (3, 7) and grid[0, 0] == 5.0 * e.step and math.isnan(grid[1, 1])
        timing = tf.make_ndarray(values[metadata.TAG_TIMING].tensor)
        assert timing[0] == 0.0291 * (e.step + 1)
        scalar = tf.make_ndarray(values["zero/timing/step_seconds"].tensor)
        assert scalar == np.float32(0.0291 * (e.step + 1))


def test_fast_record_validates_like_the_proto_path(tmp_path):
    """The precomputed path refuses what the proto path refuses, with the same message."""
    writer = SummaryWriter(str(tmp_path))
    writer.record(0, **_record_args(0))
    with pytest.raises(ValueError, match="unknown columns \\['bogus'\\]"):
        writer.record(1, vectors={metadata.TAG_TIMING: {"bogus": 1.0}})
    with pytest.raises(ValueError, match="unknown rows \\['gpu'\\]"):
        writer.record(1, matrices={metadata.TAG_TIERS: {"gpu": {}}})
    with pytest.raises(ValueError, match="must be finite"):
        writer.record(1, scalars={"zero/timing/step_seconds": math.inf})
    with pytest.raises(ValueError, match="step must be >= 0"):
        writer.record(-1, **_record_args(1))
    writer.close()
    with pytest.raises(RuntimeError, match="is closed"):
        writer.record(1, **_record_args(1))
