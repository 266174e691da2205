"""The checkpoint index: one JSON file describing a sharded checkpoint (the data contract).

A checkpoint is a directory ``<root>/<tag>/`` holding raw little-endian shard files and
``index.json``. The index is written by the chief after every worker's files are on disk;
it is the only file that describes the others, and a reader trusts nothing it does not
list. Vocabulary:

- *tensor*: one logical array saved in the checkpoint: a trainable parameter
  (``param/<i>``), one optimizer slot of that parameter (``slot/<name>/<i>``, float32), a
  replicated model variable (``model_var/<j>``: non-trainable weights) or a Keras
  optimizer variable (``optimizer_var/<j>``: the step counter ``iterations``, the learning
  rate, and the stock optimizer's slots when the optimizer is not partitioned).
- *canonical order*: a tensor's elements in C order of its *moved* value, the logical
  value with ``shard_dim`` moved to axis 0 (``zero_runtime.sharded_variable``); for
  ``shard_dim == 0`` that is the logical value's C order.
- *segment*: ``count`` elements of a tensor, starting at canonical element ``start``,
  stored at byte ``offset`` of file ``file`` (dtype ``stored_dtype``). A tensor's segments
  cover each of its elements exactly once; padding is never listed.
- *file*: a shard file, with its byte size and SHA-256 checksum (hex), and the rank and
  replica that wrote it (``replica`` is None for the chief's ``replicated.bin``).

The ``partition`` record says how the writer partitioned the parameters and optimizer
states (ZeRO stage, ``num_shards``, ``kind`` 'flat' for stages 0-2 with the bucket list,
'rows' for stage 3 with each tensor's ``shard_dim`` and padded rows); a reader uses only
the segments, so any number of replicas can restore it (re-partitioning). Parsing refuses a
``version`` newer than :data:`INDEX_VERSION` (as TensorBoard's plugin metadata does).

Integrity: the files' SHA-256 cover the data; ``index_sha256`` (version 3) covers the index
itself, the SHA-256 of the canonical JSON of every other field (:func:`index_digest`), so
a changed segment offset, shape or file checksum is refused instead of restoring other
values than were saved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any

from zero_runtime.checkpoint.errors import CheckpointCorruptError

#: Schema version of ``index.json``; bump when a reader of the old version would misread.
#: Version 2 added sparse tensors (``sparse``: the segments cover some elements, the others
#: are zero; the lazy optimizer states of row-paged embedding tables); version 3 adds
#: ``index_sha256``, the checksum of the index itself, required from version 3 on (versions
#: 1 and 2, written before it existed, are read without it). Every index is written as 3.
INDEX_VERSION = 3
#: The index field holding the SHA-256 (hex) of the rest of the index (:func:`index_digest`).
CHECKSUM_FIELD = "index_sha256"
#: The ``format`` field of every index.
INDEX_FORMAT = "zero_runtime.checkpoint"
#: File names inside a checkpoint directory and its root.
INDEX_FILE = "index.json"
LATEST_FILE = "latest"
REPLICATED_FILE = "replicated.bin"
#: Prefix of in-progress (unpublished) checkpoint directories under the root.
TEMP_PREFIX = ".tmp-"


def replica_file(replica: int) -> str:
    """The shard file name of global replica ``replica``: ``replica_00003.bin``."""
    return f"replica_{replica:05d}.bin"


@dataclasses.dataclass(frozen=True)
class Segment:
    """``count`` elements of a tensor from canonical element ``start``, at byte ``offset``
    of ``file``."""

    file: str
    offset: int
    start: int
    count: int


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """One saved tensor.

    Attributes:
        name: unique name (``param/0``, ``slot/momentum/0``, ``model_var/0``,
            ``optimizer_var/0``).
        path: the Keras variable path at save time (for messages; matching is by name).
        shape: the logical shape.
        dtype: the variable's dtype name (restored as this dtype).
        stored_dtype: the dtype of the stored bytes (little-endian).
        shard_dim: the axis moved to the front for the canonical order.
        segments: where the elements are.
        sparse: False: the segments cover every element exactly once. True: they cover
            some elements at most once, and the others are zero (version 2).
    """

    name: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    stored_dtype: str
    shard_dim: int
    segments: tuple[Segment, ...]
    sparse: bool = False

    @property
    def size(self) -> int:
        """Element count, ``prod(shape)`` (1 for a scalar)."""
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One shard file: its size in bytes, SHA-256 (hex), writer rank and replica."""

    bytes: int
    sha256: str
    rank: int
    replica: int | None


@dataclasses.dataclass(frozen=True)
class CheckpointIndex:
    """The parsed ``index.json`` of one checkpoint.

    Attributes:
        tag: the checkpoint's directory name.
        step: the optimizer's ``iterations`` when saved (int).
        created: wall time of the save, seconds since the epoch.
        world: ``num_replicas``, ``num_workers``, ``stage``, ``offload_optimizer``,
            ``offload_param`` of the saving job.
        partition: how parameters and states were partitioned (see the module docstring).
        optimizer: ``class`` (qualified name), ``partitioned`` (bool), ``slots`` (names).
        tensors: the saved tensors, parameters first.
        files: file name -> :class:`FileRecord`.
        model_config: the model's Keras serialisation (for export), or None.
        client_state: JSON-serialisable user data given to ``save`` (e.g. the epoch).
    """

    tag: str
    step: int
    created: float
    world: dict[str, Any]
    partition: dict[str, Any]
    optimizer: dict[str, Any]
    tensors: tuple[TensorRecord, ...]
    files: dict[str, FileRecord]
    model_config: dict[str, Any] | None = None
    client_state: dict[str, Any] = dataclasses.field(default_factory=dict)

    def tensor(self, name: str) -> TensorRecord:
        """The tensor called ``name``. Raises KeyError naming it when absent."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"checkpoint {self.tag!r} has no tensor {name!r}")

    def group(self, prefix: str) -> list[TensorRecord]:
        """Tensors whose name starts with ``prefix + '/'``, in index order."""
        return [t for t in self.tensors if t.name.startswith(prefix + "/")]

    def total_bytes(self) -> int:
        """Bytes of all shard files."""
        return sum(f.bytes for f in self.files.values())

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to ``index.json``, its checksum included."""
        obj = {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            "tag": self.tag,
            "step": self.step,
            "created": self.created,
            "world": self.world,
            "partition": self.partition,
            "optimizer": self.optimizer,
            "tensors": [
                {
                    "name": t.name,
                    "path": t.path,
                    "shape": list(t.shape),
                    "dtype": t.dtype,
                    "stored_dtype": t.stored_dtype,
                    "shard_dim": t.shard_dim,
                    "segments": [dataclasses.asdict(s) for s in t.segments],
                    **({"sparse": True} if t.sparse else {}),
                }
                for t in self.tensors
            ],
            "files": {k: dataclasses.asdict(v) for k, v in sorted(self.files.items())},
            "model_config": self.model_config,
            "client_state": self.client_state,
        }
        obj[CHECKSUM_FIELD] = index_digest(obj)
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "index") -> CheckpointIndex:
        """Parse an index object.

        Raises:
            CheckpointCorruptError: not a checkpoint index, a version newer than
                :data:`INDEX_VERSION`, a missing or wrong ``index_sha256`` (version 3; an
                index edited or damaged after it was written), or a missing/ill-typed
                field (named).
        """
        if not isinstance(obj, dict) or obj.get("format") != INDEX_FORMAT:
            raise CheckpointCorruptError(f"{where}: not a {INDEX_FORMAT} index")
        version = obj.get("version")
        if not isinstance(version, int) or version > INDEX_VERSION:
            raise CheckpointCorruptError(
                f"{where}: index version {version!r} is newer than this reader's "
                f"{INDEX_VERSION}; upgrade zero_runtime"
            )
        recorded = obj.get(CHECKSUM_FIELD)
        if recorded is not None or version >= 3:  # present: always checked
            actual = index_digest(obj)
            if recorded != actual:
                raise CheckpointCorruptError(
                    f"{where}: index checksum mismatch: {CHECKSUM_FIELD} "
                    f"{recorded!r} != sha256 of the index {actual} (the index was altered "
                    "or damaged after it was written; nothing was restored)"
                )
        try:
            tensors = tuple(
                TensorRecord(
                    name=str(t["name"]),
                    path=str(t["path"]),
                    shape=tuple(int(d) for d in t["shape"]),
                    dtype=str(t["dtype"]),
                    stored_dtype=str(t["stored_dtype"]),
                    shard_dim=int(t["shard_dim"]),
                    segments=tuple(Segment(**s) for s in t["segments"]),
                    sparse=bool(t.get("sparse", False)),
                )
                for t in obj["tensors"]
            )
            files = {k: FileRecord(**v) for k, v in obj["files"].items()}
            return cls(
                tag=str(obj["tag"]),
                step=int(obj["step"]),
                created=float(obj["created"]),
                world=dict(obj["world"]),
                partition=dict(obj["partition"]),
                optimizer=dict(obj["optimizer"]),
                tensors=tensors,
                files=files,
                model_config=obj.get("model_config"),
                client_state=dict(obj.get("client_state") or {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorruptError(f"{where}: malformed index ({exc!r})") from None


def index_digest(obj: dict[str, Any]) -> str:
    """SHA-256 (hex) of an index object without its ``index_sha256`` field: of its
    canonical JSON (sorted keys, no spaces, ASCII), so it survives re-formatting."""
    rest = {k: v for k, v in obj.items() if k != CHECKSUM_FIELD}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def read_index(checkpoint_dir: str) -> CheckpointIndex:
    """Read, verify and parse ``<checkpoint_dir>/index.json``.

    Raises:
        CheckpointCorruptError: the file is missing, unreadable, not UTF-8, not JSON, not a
            valid index or fails its checksum; the message names the file.
    """
    path = os.path.join(checkpoint_dir, INDEX_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path}: index file missing") from None
    except OSError as exc:
        raise CheckpointCorruptError(f"{path}: unreadable index ({exc})") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointCorruptError(
            f"{path}: damaged index: byte {exc.start} is not UTF-8 ({exc.reason})"
        ) from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{path}: damaged index: not JSON ({exc})") from None
    return CheckpointIndex.from_json(obj, where=path)
