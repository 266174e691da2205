"""Restore: read a sharded checkpoint through its index and re-partition it onto the
current number of replicas.

The reader never assumes the saving job's partition: it rebuilds each tensor's canonical
value from the index's segments (any ``num_shards``, any bucket layout, stages 0-3) and
the current :class:`~zero_runtime.optim.training_state.TrainingState` cuts it into the
current replicas' shards (``partition.build_shard``). This process holds one tensor (one
slot of all parameters, for optimizer states) on the host at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Any

import numpy as np

from zero_runtime.checkpoint import index as ix
from zero_runtime.checkpoint import tables as tb
from zero_runtime.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from zero_runtime.optim.partition import build_shard, logical_from_canonical
from zero_runtime.optim.training_state import TrainingState

_READ_CHUNK = 16 << 20  # bytes per read when hashing


def resolve(path: str, tag: str | None = None) -> str:
    """The checkpoint directory for a root (+ tag or ``latest``) or a checkpoint directory.

    Args:
        path: a checkpoint root (holding ``latest`` and tag directories) or one
            checkpoint directory (holding ``index.json``).
        tag: a tag under the root; default: the one ``latest`` names (or ``path`` itself
            when it is a checkpoint directory).

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or is a file; the tag (or the one
            ``latest`` names, e.g. an empty or truncated ``latest``) is not a plain
            directory name or has no ``index.json``; the root has no ``latest`` pointer
            (nothing was published there yet). The message names the bad path or tag and
            lists the published tags.
    """
    if not os.path.isdir(path):
        what = "is a file, not a directory" if os.path.exists(path) else "does not exist"
        raise CheckpointNotFoundError(f"checkpoint directory {path!r} {what}")
    named_by = "asked for"
    if tag is None:
        if os.path.isfile(os.path.join(path, ix.INDEX_FILE)):
            return path
        tag = read_latest(path)
        if tag is None:
            raise CheckpointNotFoundError(
                f"no checkpoint in {path!r}: no {ix.LATEST_FILE!r} pointer (nothing published)"
            )
        named_by = f"named by {os.path.join(path, ix.LATEST_FILE)!r}"
    if not _is_plain_name(tag):
        raise CheckpointNotFoundError(
            f"checkpoint tag {tag!r} ({named_by}) is not a tag: a plain directory name is "
            f"expected; published tags under {path!r}: {published_tags(path)}"
        )
    target = os.path.join(path, tag)
    if not os.path.isfile(os.path.join(target, ix.INDEX_FILE)):
        state = (
            f"{target!r} has no {ix.INDEX_FILE} (incomplete or damaged)"
            if os.path.isdir(target)
            else f"{target!r} does not exist"
        )
        survivor = _replaced_copy(path, tag)
        hint = (
            f"; a save of the same tag was interrupted and the complete earlier copy is "
            f"{survivor!r}: rename it to {target!r}"
            if survivor
            else ""
        )
        raise CheckpointNotFoundError(
            f"checkpoint {tag!r} ({named_by}) not found: {state}; published tags under "
            f"{path!r}: {published_tags(path)} (pass one as tag, or repair "
            f"{ix.LATEST_FILE!r}){hint}"
        )
    return target


def read_latest(root: str) -> str | None:
    """The tag ``<root>/latest`` names (stripped; may be empty or invalid if the file was
    damaged), or None when there is no ``latest`` file (nothing published yet)."""
    try:
        with open(os.path.join(root, ix.LATEST_FILE), encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def published_tags(root: str) -> list[str]:
    """Names of the directories under ``root`` holding an ``index.json``, sorted (no
    ``.tmp-*`` directories); for error messages."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(
        n
        for n in names
        if not n.startswith(".") and os.path.isfile(os.path.join(root, n, ix.INDEX_FILE))
    )


def _replaced_copy(root: str, tag: str) -> str | None:
    """The path of a complete old copy of ``tag`` moved aside by a save of the same tag
    that died before renaming the new one in (``.tmp-old-<tag>-<nonce>``), or None."""
    prefix = f"{ix.TEMP_PREFIX}old-{tag}-"
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    for name in names:
        path = os.path.join(root, name)
        nonce = name[len(prefix) :]
        if name.startswith(prefix) and "-" not in nonce and nonce:
            if os.path.isfile(os.path.join(path, ix.INDEX_FILE)):
                return path
    return None


def _is_plain_name(tag: str) -> bool:
    """True for a non-empty directory name without separators, not starting with '.'."""
    return (
        bool(tag)
        and not tag.startswith(".")
        and os.sep not in tag
        and not (os.altsep and os.altsep in tag)
        and tag.isprintable()
    )


class CheckpointReader:
    """Reads tensors of one published checkpoint directory.

    Args:
        checkpoint_dir: a checkpoint directory (use :func:`resolve` for a root).

    Attributes:
        path: the directory.
        index: its :class:`~zero_runtime.checkpoint.index.CheckpointIndex`.

    Raises:
        CheckpointCorruptError: the index is missing or invalid.
    """

    def __init__(self, checkpoint_dir: str) -> None:
        self.path = checkpoint_dir
        self.index = ix.read_index(checkpoint_dir)
        self._verified: set[str] = set()

    def verify(self, names: list[str] | None = None) -> None:
        """Check that the shard files exist with their recorded sizes and SHA-256.

        Args:
            names: file names to check; default all files of the index.

        Raises:
            CheckpointCorruptError: a file is missing, or its size or checksum differs
                (the message names the file and both values).
        """
        for name in names if names is not None else sorted(self.index.files):
            if name in self._verified:
                continue
            rec = self.index.files[name]
            path = os.path.join(self.path, name)
            try:
                size = os.path.getsize(path)
            except OSError:
                raise CheckpointCorruptError(
                    f"checkpoint {self.index.tag!r}: shard file {name!r} is missing "
                    f"(written by rank {rec.rank})"
                ) from None
            if size != rec.bytes:
                raise CheckpointCorruptError(
                    f"checkpoint {self.index.tag!r}: shard file {name!r} has {size} bytes, "
                    f"the index records {rec.bytes}"
                )
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(_READ_CHUNK):
                    h.update(chunk)
            if h.hexdigest() != rec.sha256:
                raise CheckpointCorruptError(
                    f"checkpoint {self.index.tag!r}: checksum mismatch in shard file {name!r}: "
                    f"sha256 {h.hexdigest()} != recorded {rec.sha256}"
                )
            self._verified.add(name)

    def canonical(self, name: str) -> np.ndarray:
        """Tensor ``name``'s elements in canonical order, 1-D, stored dtype (verified).

        A sparse tensor (``TensorRecord.sparse``) is zero where no segment covers it.

        Raises:
            KeyError: no such tensor.
            CheckpointCorruptError: a segment outside its file or the tensor, or
                elements covered twice / not at all (a dense tensor) / more than once in
                total (a sparse one).
        """
        rec = self.index.tensor(name)
        self.verify(sorted({s.file for s in rec.segments}))
        dtype = np.dtype(rec.stored_dtype)
        out = np.zeros(rec.size, dtype) if rec.sparse else np.empty(rec.size, dtype)
        covered = 0
        handles: dict[str, object] = {}
        try:
            for s in rec.segments:
                if s.start < 0 or s.count < 0 or s.start + s.count > rec.size:
                    raise CheckpointCorruptError(
                        f"tensor {name!r}: segment [{s.start}, {s.start + s.count}) outside "
                        f"its {rec.size} elements"
                    )
                f = handles.get(s.file)
                if f is None:
                    f = handles[s.file] = open(os.path.join(self.path, s.file), "rb")
                f.seek(s.offset)
                data = np.fromfile(f, dtype, s.count)
                if data.size != s.count:
                    raise CheckpointCorruptError(
                        f"tensor {name!r}: file {s.file!r} ends before byte "
                        f"{s.offset + s.count * dtype.itemsize}"
                    )
                out[s.start : s.start + s.count] = data
                covered += s.count
        finally:
            for f in handles.values():
                f.close()
        if covered > rec.size or (covered != rec.size and not rec.sparse):
            raise CheckpointCorruptError(
                f"tensor {name!r}: segments cover {covered} of {rec.size} elements"
            )
        return out

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name``'s logical value (its shape, its saved dtype)."""
        rec = self.index.tensor(name)
        flat = self.canonical(name)
        if not rec.shape:
            return flat.reshape(()).astype(rec.dtype)
        value = logical_from_canonical(flat, rec.shape, rec.shard_dim)
        return np.ascontiguousarray(value).astype(np.dtype(rec.dtype), copy=False)

    def canonical_along(self, name: str, shard_dim: int) -> np.ndarray:
        """Tensor ``name``'s elements in the canonical order of ``shard_dim``: its value
        with that axis moved to the front, C order, 1-D, the saved dtype. The stored
        order when the checkpoint's ``shard_dim`` is the same; otherwise the elements are
        reordered (a stage-3 job that splits a variable along another axis than the
        saving job did, e.g. at another replica count: ``least_padding_dim``).

        Raises:
            KeyError: no such tensor (as :meth:`canonical`).
            CheckpointCorruptError: as :meth:`canonical`.
        """
        rec = self.index.tensor(name)
        flat = self.canonical(name)
        if len(rec.shape) < 2 or rec.shard_dim == shard_dim:
            return flat
        value = logical_from_canonical(flat, rec.shape, rec.shard_dim)
        return np.ascontiguousarray(np.moveaxis(value, shard_dim, 0)).reshape(-1)


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What a restore did.

    Attributes:
        path: the checkpoint directory read.
        tag: its tag.
        step: the optimizer step counter restored.
        saved_replicas: replicas of the saving job; ``replicas``: of this one.
        bytes_read: bytes of shard files verified and read on this worker.
        seconds: wall time of the restore, seconds.
        client_state: the data given to ``save``.
    """

    path: str
    tag: str
    step: int
    saved_replicas: int
    replicas: int
    bytes_read: int
    seconds: float
    client_state: dict


def accumulation_of(strategy: Any) -> int:
    """The strategy's ``gradient_accumulation_steps`` (1 without a ZeroConfig)."""
    return int(getattr(getattr(strategy, "config", None), "gradient_accumulation_steps", 1))


def rescaled_iterations(state: TrainingState, index: ix.CheckpointIndex) -> int | None:
    """The optimizer's ``iterations`` to restore when the checkpoint was saved at another
    gradient accumulation (a job resized by ``zero-runtime launch --min-nproc``:
    :mod:`zero_runtime.elastic`), else None (the saved value as it is).

    ``iterations`` counts micro-steps; the optimizer step is ``iterations // N`` for
    accumulation N (zero_runtime/optim/partitioned.py). A checkpoint of ``u`` optimizer
    steps saved at N (``iterations = u x N``) restores at N' as ``u x N'``, so the
    learning-rate schedule, bias correction and the accumulation boundary continue.
    The saved N is the index's ``world.gradient_accumulation_steps`` (1 when absent).

    Raises:
        CheckpointMismatchError: the accumulation differs and the checkpoint was saved in
            the middle of an accumulation (``iterations`` not a multiple of N: the partial
            gradient sum is not in the checkpoint), before any variable changes.
    """
    saved = int(index.world.get("gradient_accumulation_steps") or 1)
    now = accumulation_of(state.strategy)
    if state.optimizer is None or saved == now:
        return None
    if index.step % saved:
        raise CheckpointMismatchError(
            f"checkpoint {index.tag!r} was saved after {index.step} micro-steps with "
            f"gradient_accumulation_steps={saved}, in the middle of an accumulation: it can "
            f"only be restored with gradient_accumulation_steps={saved} (save at optimizer-"
            "step boundaries: ZeroBackupAndRestore and CheckpointManager.after_step do)"
        )
    return index.step // saved * now


def check_compatible(state: TrainingState, index: ix.CheckpointIndex) -> None:
    """Raise :class:`CheckpointMismatchError` naming the first variable, slot or count of
    the checkpoint that does not fit ``state``. With no optimizer (``state.optimizer`` is
    None) the optimizer's slots and variables are not compared (parameters only)."""
    params = index.group("param")
    if len(params) != len(state.params):
        raise CheckpointMismatchError(
            f"checkpoint {index.tag!r} has {len(params)} trainable parameters, the model has "
            f"{len(state.params)}"
        )
    for i, (rec, v) in enumerate(zip(params, state.params)):
        shape = tuple(int(d) for d in v.shape)
        if rec.shape != shape:
            raise CheckpointMismatchError(
                f"variable {getattr(v, 'path', '?')!r} (parameter #{i}): model shape {shape} "
                f"!= checkpoint shape {rec.shape} (saved as {rec.path!r})"
            )
    saved_slots = list(index.optimizer.get("slots") or [])
    if state.optimizer is not None and saved_slots != list(state.slots):
        raise CheckpointMismatchError(
            f"optimizer states differ: checkpoint {index.tag!r} holds slots {saved_slots} "
            f"({index.optimizer.get('class')}), the optimizer has {list(state.slots)} "
            f"({type(state.optimizer).__name__ if state.optimizer is not None else None})"
        )
    # Without an optimizer (an uncompiled model: inference, export) only the model's
    # tensors are restored; the optimizer's stay in the checkpoint.
    prefixes = ("model_var", "optimizer_var") if state.optimizer is not None else ("model_var",)
    for prefix in prefixes:
        saved = index.group(prefix)
        current = [(n, v) for n, v in state.replicated if n.startswith(prefix + "/")]
        if len(saved) != len(current):
            raise CheckpointMismatchError(
                f"checkpoint {index.tag!r} has {len(saved)} {prefix.replace('_', ' ')}s, the "
                f"model/optimizer has {len(current)}"
            )
        for rec, (_, v) in zip(saved, current):
            shape = tuple(int(d) for d in v.shape)
            if rec.shape != shape:
                raise CheckpointMismatchError(
                    f"variable {getattr(v, 'path', '?')!r}: model shape {shape} != checkpoint "
                    f"shape {rec.shape} (saved as {rec.path!r})"
                )


def restore(state: TrainingState, reader: CheckpointReader) -> RestoreResult:
    """Load ``reader``'s checkpoint into ``state``'s variables and optimizer shards.

    Every shard file is verified (size, SHA-256) before any variable changes. Parameters
    are assigned whole (replicated variables on every local replica; ShardedVariables
    scatter to their shards); each optimizer slot is cut into this worker's replicas'
    shards of the current layout and written to its tier (the stores' ``write_shard``),
    in the order of each variable's current ``shard_dim`` (which may differ from the
    saving job's: :meth:`CheckpointReader.canonical_along`).
    A row-paged table's states go to the current row pages that hold saved rows
    (:func:`~zero_runtime.checkpoint.tables.restore_states`); the others have none.

    Raises:
        CheckpointMismatchError: see :func:`check_compatible`.
        CheckpointCorruptError: a missing or altered shard file.
    """
    start = time.perf_counter()
    index = reader.index
    check_compatible(state, index)
    iterations = rescaled_iterations(state, index)
    reader.verify()
    for i, v in enumerate(state.params):
        v.assign(reader.read(f"param/{i}"))
    sizes = state.sizes
    for slot in state.slots:
        flats = {
            j: reader.canonical_along(f"slot/{slot}/{i}", state.shard_dim(i)).astype(
                np.float32, copy=False
            )
            for j, i in enumerate(state.dense)
        }
        for replica in state.local_replicas:
            shard = build_shard(state.layout, replica, flats, sizes)
            state.store.write_shard(replica, slot, shard)
        del flats
    for i, embedding in sorted(state.tables.items()):
        vocab, width = (int(d) for d in embedding.table.shape)
        covered = np.zeros(vocab, bool)  # rows whose states were saved
        values = {}
        for slot in state.slots:
            name = f"slot/{slot}/{i}"
            for seg in index.tensor(name).segments:
                covered[seg.start // width : (seg.start + seg.count) // width] = True
            values[slot] = reader.canonical_along(name, 0).astype(np.float32).reshape(vocab, width)
        tb.restore_states(embedding, state.local_replicas, values, covered)
        del values
    for name, v in state.replicated:
        v.assign(reader.read(name))
    if iterations is not None:
        state.optimizer.iterations.assign(iterations)
    return RestoreResult(
        path=reader.path,
        tag=index.tag,
        step=index.step,
        saved_replicas=int(index.world.get("num_replicas", 0)),
        replicas=state.layout.num_shards,
        bytes_read=index.total_bytes(),
        seconds=time.perf_counter() - start,
        client_state=dict(index.client_state),
    )
