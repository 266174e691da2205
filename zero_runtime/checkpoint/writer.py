"""Atomic sharded save: every worker writes its shards, the chief publishes the index.

Protocol (a checkpoint is visible only when complete; see docs/checkpoint.md):

1. every worker writes its local replicas' shard files (``replica_<r>.bin``: the
   parameter shard, then one ``[shard_size]`` float32 shard per optimizer slot, then
   each row-paged table's rows and touched state pages, :mod:`.tables`) into
   ``<root>/.tmp-<tag>-<nonce>/`` and fsyncs them; the chief also writes
   ``replicated.bin`` (non-partitioned variables and the optimizer's step counter);
2. the chief gathers every worker's file records (size, SHA-256;
   :mod:`~zero_runtime.checkpoint.coordination`), writes ``index.json`` and fsyncs it and
   the directory;
3. the chief publishes: ``rename(.tmp-<tag>-<nonce>, <tag>)``, then atomically replaces
   ``<root>/latest`` (temp file + ``os.replace``), fsyncing the root after each; only
   then are checkpoints beyond ``max_to_keep`` and stale temporary directories deleted.

A process killed before step 3 leaves a ``.tmp-*`` directory that no reader looks at;
``latest`` still names the previous checkpoint. ``rename`` and ``os.replace`` are atomic
on POSIX file systems.

Testing hook: with the environment variable :data:`KILL_AFTER_FILES_ENV` set to K, the
process SIGKILLs itself right after its K-th shard file is written and fsynced (a crash
mid-save, tests/test_checkpoint_multiworker.py).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import os
import shutil
import signal
import time
from typing import Any

import numpy as np

from zero_runtime.checkpoint import index as ix
from zero_runtime.checkpoint import tables as tb
from zero_runtime.checkpoint.coordination import coordinator_for
from zero_runtime.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
)
from zero_runtime.optim.partition import replica_pieces
from zero_runtime.optim.training_state import TrainingState

log = logging.getLogger(__name__)

#: Environment variable of the crash-mid-save testing hook (an int K >= 1).
KILL_AFTER_FILES_ENV = "ZERO_RUNTIME_CKPT_KILL_AFTER_FILES"
_WRITE_CHUNK = 16 << 20  # bytes per write() call and hash update


@dataclasses.dataclass(frozen=True)
class SaveResult:
    """What one worker's save did.

    Attributes:
        path: the published checkpoint directory.
        tag: its name under the root.
        step: the optimizer's step counter saved (``iterations``).
        bytes_written: bytes of shard files this worker wrote (index excluded).
        seconds: wall time of the save on this worker, seconds.
    """

    path: str
    tag: str
    step: int
    bytes_written: int
    seconds: float


def check_tag(tag: str) -> str:
    """Validate a checkpoint tag (a directory name). Raises ValueError naming it."""
    if (
        not isinstance(tag, str)
        or not tag
        or tag in (".", "..", ix.LATEST_FILE)
        or tag.startswith(".")
        or os.sep in tag
        or (os.altsep and os.altsep in tag)
    ):
        raise ValueError(f"invalid checkpoint tag {tag!r}: use a plain directory name")
    return tag


def save(
    state: TrainingState,
    root: str,
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    max_to_keep: int | None = 3,
    timeout_seconds: float = 60.0,
) -> SaveResult:
    """Save ``state`` as ``<root>/<tag>`` (every worker calls this at the same point).

    Args:
        state: the :class:`TrainingState` of the model and optimizer.
        root: the checkpoint root directory (created if missing).
        tag: the checkpoint name; default ``step<iterations:08d>``. An existing
            checkpoint of the same tag is replaced.
        client_state: JSON-serialisable data stored in the index (e.g. the epoch).
        max_to_keep: published checkpoints kept (the newest by save time), int >= 1, or
            None to keep all. Older ones are deleted after the new one is published.
        timeout_seconds: bound on each wait for another worker, seconds.

    Returns:
        A :class:`SaveResult`.

    Raises:
        ValueError: a bad tag or ``max_to_keep``.
        TypeError: ``client_state`` is not a JSON-serialisable dict (checked before any
            file is written).
        zero_runtime.checkpoint.CheckpointWriteError: (an ``OSError``) the file system
            refused a write: the message names the file, and on a full disk
            (``ENOSPC``/``EDQUOT``/``EFBIG``) the bytes needed and free. The save's
            temporary directory is removed first; the published checkpoints and
            ``latest`` are untouched and the next save works once there is room.
        tensorflow.errors.OpError: a peer worker failed or timed out (multi-worker).
    """
    start = time.perf_counter()
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
        raise ValueError(f"max_to_keep must be an int >= 1 or None, got {max_to_keep!r}")
    _check_client_state(client_state)  # before any file is written (and on every worker)
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    opt = state.optimizer
    step = int(opt.iterations.numpy()) if opt is not None else 0
    tag = check_tag(tag if tag is not None else f"step{step:08d}")
    coord = coordinator_for(state.strategy, timeout_seconds)
    nonce = coord.nonce(root)
    tmp = os.path.join(root, f"{ix.TEMP_PREFIX}{tag}-{nonce}")
    try:
        result = _save_into(state, root, tmp, tag, step, nonce, coord, client_state, start)
    except BaseException as exc:
        # Nothing of a failed save stays: its temporary directory (and a half-written
        # 'latest' pointer) go; published checkpoints and 'latest' were not touched. The
        # directory is shared by the workers: the chief removes it, another worker only
        # its own files (a dead chief's are pruned by the next save).
        if coord.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_quietly(os.path.join(root, f"{ix.TEMP_PREFIX}{ix.LATEST_FILE}-{nonce}"))
        else:
            for replica in state.local_replicas:
                _remove_quietly(os.path.join(tmp, ix.replica_file(replica)))
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise _write_error(exc, root, tmp, _expected_bytes(state)) from exc
        raise
    if coord.rank == 0 and max_to_keep is not None:
        prune(root, max_to_keep, keep=tag)
    if coord.rank == 0:
        log.info(
            "checkpoint %s: %d bytes written in %.3f s",
            result.path,
            result.bytes_written,
            result.seconds,
        )
    return result


def _save_into(
    state: TrainingState,
    root: str,
    tmp: str,
    tag: str,
    step: int,
    nonce: str,
    coord: Any,
    client_state: dict[str, Any] | None,
    start: float,
) -> SaveResult:
    """Write this worker's files into ``tmp`` and (the chief) publish ``<root>/<tag>``;
    :func:`save` without its clean-up and pruning. Raises OSError from the file system."""
    os.makedirs(tmp, exist_ok=True)
    files: dict[str, dict[str, Any]] = {}
    kill_after = int(os.environ.get(KILL_AFTER_FILES_ENV, "0") or 0)
    for local, replica in enumerate(state.local_replicas):
        arrays = [state.param_shard(replica, local)]
        arrays += [state.store.read_shard(replica, s) for s in state.slots]
        row_pages = {}
        for i, embedding in sorted(state.tables.items()):
            extra, row_pages[str(i)] = tb.replica_arrays(embedding, replica, state.slots)
            arrays += extra
        name = ix.replica_file(replica)
        nbytes, digest = _write_file(os.path.join(tmp, name), arrays)
        files[name] = {"bytes": nbytes, "sha256": digest, "rank": state.rank, "replica": replica}
        if row_pages:  # which row pages had optimizer states (to the chief, for the index)
            files[name]["row_pages"] = row_pages
        if kill_after and len(files) >= kill_after:
            log.warning("%s=%d: killing this process mid-save", KILL_AFTER_FILES_ENV, kill_after)
            os.kill(os.getpid(), signal.SIGKILL)
    written = sum(f["bytes"] for f in files.values())
    final = os.path.join(root, tag)
    if coord.rank != 0:
        _fsync_dir(tmp)
        coord.post_files(nonce, files)
        coord.wait_published(nonce)
        return SaveResult(final, tag, step, written, time.perf_counter() - start)
    replicated_layout = []
    arrays = []
    offset = 0
    for name, var in state.replicated:
        value = np.asarray(var.numpy())
        stored = value.dtype.newbyteorder("<")
        arrays.append(value.astype(stored, copy=False))
        replicated_layout.append((name, var, value, offset))
        offset += value.nbytes
    nbytes, digest = _write_file(os.path.join(tmp, ix.REPLICATED_FILE), arrays)
    files[ix.REPLICATED_FILE] = {"bytes": nbytes, "sha256": digest, "rank": 0, "replica": None}
    written += nbytes
    files = coord.gather_files(nonce, files)
    row_pages = {k: dict(v).pop("row_pages", {}) for k, v in files.items()}
    files = {k: {f: x for f, x in v.items() if f != "row_pages"} for k, v in files.items()}
    index = _make_index(state, tag, step, files, replicated_layout, client_state or {}, row_pages)
    _write_json_durably(os.path.join(tmp, ix.INDEX_FILE), index.to_json())
    _fsync_dir(tmp)
    _publish(root, tmp, final, tag, nonce)
    coord.announce_published(nonce, tag)
    return SaveResult(final, tag, step, written, time.perf_counter() - start)


def _expected_bytes(state: TrainingState) -> int:
    """Bytes this worker's save writes at least: its replicas' files (parameter shard and
    one shard per slot, float32; row-paged tables' rows and states come on top) and, on
    the chief, ``replicated.bin``."""
    per_file = 4 * state.layout.shard_size * (1 + len(state.slots))
    total = per_file * len(state.local_replicas)
    if state.rank == 0:
        total += sum(int(np.asarray(v.numpy()).nbytes) for _, v in state.replicated)
    return total


#: errno values of a full file system or quota (and a file-size limit).
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _write_error(exc: OSError, root: str, tmp: str, needed: int) -> CheckpointWriteError:
    """A :class:`CheckpointWriteError` for ``exc``: names the file (``exc.filename`` or the
    temporary directory), the error, and for a full disk the bytes needed and free."""
    path = exc.filename or tmp
    what = exc.strerror or str(exc)
    if exc.errno not in _FULL:
        return CheckpointWriteError(
            f"checkpoint save failed writing {path}: {what} (errno {exc.errno}); its "
            f"temporary directory was removed and the published checkpoints under {root} "
            "are unchanged",
            exc.errno,
            path,
        )
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    room = f"{free} bytes are free there now" if free is not None else "free space unknown"
    return CheckpointWriteError(
        f"checkpoint save failed: the file system is full ({what}) writing {path}: this "
        f"worker's save needs at least {needed} bytes and {room}; the partial save was "
        f"removed and the published checkpoints under {root} are unchanged (free space "
        "or lower max_to_keep, then save again)",
        exc.errno,
        path,
        bytes_needed=needed,
        bytes_free=free,
    )


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _check_client_state(client_state: Any) -> None:
    """Raise TypeError unless ``client_state`` is None or a dict that ``json.dumps``
    accepts (it is stored in ``index.json``); the message names the offending value."""
    import json

    if client_state is None:
        return
    if not isinstance(client_state, dict):
        raise TypeError(f"client_state must be a dict, got {type(client_state).__name__}")
    try:
        json.dumps(client_state)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"client_state must be JSON-serialisable (str/int/float/bool/None, lists and "
            f"dicts with str keys): {exc}"
        ) from None


def _make_index(
    state: TrainingState,
    tag: str,
    step: int,
    files: dict[str, dict[str, Any]],
    replicated_layout: list,
    client_state: dict[str, Any],
    row_pages: dict[str, dict[str, list[int]]],
) -> ix.CheckpointIndex:
    layout = state.layout
    n = layout.num_shards
    missing = [ix.replica_file(r) for r in range(n) if ix.replica_file(r) not in files]
    if missing:
        raise CheckpointError(f"workers did not report shard files {missing}")
    sizes = state.sizes
    by_var: list[list[tuple[int, Any]]] = [[] for _ in state.dense]  # layout order
    for r in range(n):
        for p in replica_pieces(layout, r, sizes):
            by_var[p.var].append((r, p))
    dense = {pos: j for j, pos in enumerate(state.dense)}
    groups = ["param", *(f"slot/{s}" for s in state.slots)]
    table_segments, row_paged = _table_segments(state, files, row_pages, len(groups))
    tensors = []
    for g, group in enumerate(groups):
        for i, v in enumerate(state.params):
            sparse = False
            if i in state.tables:  # rows (dense), or the touched pages' states (sparse)
                segments = table_segments[i][group]
                sparse = g > 0
            else:
                segments = tuple(
                    ix.Segment(
                        ix.replica_file(r),
                        4 * (g * layout.shard_size + p.shard_offset),
                        p.start,
                        p.count,
                    )
                    for r, p in by_var[dense[i]]
                )
            tensors.append(
                ix.TensorRecord(
                    name=f"{group}/{i}",
                    path=_path(v),
                    shape=tuple(int(d) for d in v.shape),
                    dtype=_dtype_name(v) if g == 0 else "float32",
                    stored_dtype="<f4",
                    shard_dim=state.shard_dim(i),
                    segments=segments,
                    sparse=sparse,
                )
            )
    for name, var, value, offset in replicated_layout:
        seg = (ix.Segment(ix.REPLICATED_FILE, offset, 0, int(value.size)),)
        tensors.append(
            ix.TensorRecord(
                name=name,
                path=_path(var),
                shape=tuple(int(d) for d in value.shape),
                dtype=str(value.dtype),
                stored_dtype=value.dtype.newbyteorder("<").str,
                shard_dim=0,
                segments=seg,
            )
        )
    config = getattr(state.strategy, "config", None)
    world = {
        "num_replicas": n,
        "num_workers": state.num_workers,
        "stage": getattr(config, "stage", None),
        "offload_optimizer": getattr(config, "offload_optimizer", None),
        "offload_param": getattr(config, "offload_param", None),
        "gradient_accumulation_steps": getattr(config, "gradient_accumulation_steps", 1),
    }
    partition: dict[str, Any] = {
        "kind": state.kind,
        "num_shards": n,
        "shard_size": layout.shard_size,
        "groups": groups,
        "shard_file_layout": "groups in order, each float32 [shard_size]",
        "buckets": [dataclasses.asdict(b) for b in layout.buckets],
        "padding": [b.padded_size(n) - sum(sizes[b.var_start : b.var_end]) for b in layout.buckets],
    }
    if row_paged:
        partition["row_paged"] = row_paged
    opt = state.optimizer
    optimizer = {
        "class": f"{type(opt).__module__}.{type(opt).__qualname__}" if opt is not None else None,
        "partitioned": state.store is not None,
        "slots": list(state.slots),
        "tier": getattr(state.store, "tier", None),
    }
    return ix.CheckpointIndex(
        tag=tag,
        step=step,
        created=time.time(),
        world=world,
        partition=partition,
        optimizer=optimizer,
        tensors=tuple(tensors),
        files={k: ix.FileRecord(**v) for k, v in files.items()},
        model_config=state.model_config,
        client_state=client_state,
    )


def _table_segments(
    state: TrainingState,
    files: dict[str, dict[str, Any]],
    row_pages: dict[str, dict[str, list[int]]],
    num_groups: int,
) -> tuple[dict[int, dict[str, tuple[ix.Segment, ...]]], list[dict[str, Any]]]:
    """Segments of the row-paged tables' tensors and their ``partition.row_paged`` records.

    Returns:
        ``({param position: {group: segments}}, [record per table])``.

    Raises:
        CheckpointError: a shard file's size is not what its contents add up to.
    """
    if not state.tables:
        return {}, []
    shard_bytes = 4 * state.layout.shard_size * num_groups
    out: dict[int, dict[str, list[ix.Segment]]] = {
        i: {"param": [], **{f"slot/{s}": [] for s in state.slots}} for i in state.tables
    }
    geometry = {i: tb.TableGeometry.of(e.table) for i, e in state.tables.items()}
    pages_of: dict[int, dict[str, list[int]]] = {i: {} for i in state.tables}
    for r in range(state.layout.num_shards):
        name = ix.replica_file(r)
        offset = shard_bytes
        for i in sorted(state.tables):
            pages = list(row_pages.get(name, {}).get(str(i), []))
            pages_of[i][str(r)] = pages
            rows, states, offset = tb.replica_segments(
                geometry[i], r, pages, state.slots, name, offset
            )
            if rows.count:
                out[i]["param"].append(rows)
            for s in state.slots:
                out[i][f"slot/{s}"] += states[s]
        if files[name]["bytes"] != offset:
            raise CheckpointError(
                f"shard file {name!r} has {files[name]['bytes']} bytes, its contents add up "
                f"to {offset}"
            )
    records = []
    for i in sorted(state.tables):
        geo = geometry[i]
        first = out[i].get(f"slot/{state.slots[0]}", []) if state.slots else []
        records.append(
            {
                "param": i,
                "shape": [geo.vocab, geo.width],
                "rows_per_shard": geo.rows,
                "rows_per_page": geo.rows_per_page,
                "pages_per_shard": geo.pages_per_shard,
                "state_pages": pages_of[i],
                "state_rows": tb.merged_rows(first, geo.width),
            }
        )
    return {i: {g: tuple(v) for g, v in d.items()} for i, d in out.items()}, records


def _publish(root: str, tmp: str, final: str, tag: str, nonce: str) -> None:
    """Rename the complete temp directory to ``final`` and point ``latest`` at it."""
    trash = None
    if os.path.exists(final):
        trash = os.path.join(root, f"{ix.TEMP_PREFIX}old-{tag}-{nonce}")
        os.rename(final, trash)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = os.path.join(root, f"{ix.TEMP_PREFIX}{ix.LATEST_FILE}-{nonce}")
    try:
        with open(pointer, "w", encoding="utf-8") as f:
            f.write(tag + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        exc.filename = exc.filename or pointer
        raise
    os.replace(pointer, os.path.join(root, ix.LATEST_FILE))
    _fsync_dir(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def list_checkpoints(root: str) -> list[str]:
    """Tags of the published checkpoints under ``root``, oldest first (by save time).

    A directory counts when it holds a readable ``index.json``; temporary
    (``.tmp-*``) directories never do.
    """
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(path, ix.INDEX_FILE)):
            continue
        try:
            created = ix.read_index(path).created
        except CheckpointCorruptError:  # damaged (not UTF-8, not JSON, checksum): by mtime
            created = os.path.getmtime(path)
        found.append((created, name))
    return [name for _, name in sorted(found)]


def prune(root: str, max_to_keep: int, keep: str | None = None) -> list[str]:
    """Delete published checkpoints beyond the newest ``max_to_keep`` and stale temporary
    directories; never ``keep`` nor the one ``latest`` names. Returns the deleted tags."""
    latest = None
    try:  # a damaged (non-UTF-8) 'latest' must not stop a save: it is replaced anyway
        with open(os.path.join(root, ix.LATEST_FILE), encoding="utf-8", errors="replace") as f:
            latest = f.read().strip()
    except OSError:
        pass
    tags = list_checkpoints(root)
    doomed = [t for t in tags[: max(0, len(tags) - max_to_keep)] if t not in (keep, latest)]
    for t in doomed:
        shutil.rmtree(os.path.join(root, t), ignore_errors=True)
    for name in os.listdir(root):  # leftovers of saves that died before publishing
        if name.startswith(ix.TEMP_PREFIX):
            path = os.path.join(root, name)
            if _sole_copy(root, name):
                continue
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
    if doomed:
        _fsync_dir(root)
    return doomed


def _replaced_copy_tag(name: str) -> str | None:
    """The tag of ``name`` when it is the moved-aside old copy of a checkpoint being
    replaced (``.tmp-old-<tag>-<nonce>``, :func:`_publish`), else None."""
    prefix = f"{ix.TEMP_PREFIX}old-"
    if not name.startswith(prefix) or "-" not in name[len(prefix) :]:
        return None
    return name[len(prefix) :].rsplit("-", 1)[0] or None


def _sole_copy(root: str, name: str) -> bool:
    """True when ``name`` is a replaced checkpoint's old copy whose replacement never
    landed (a save of the same tag died between its two renames): then it is the only
    copy of that tag, and pruning must keep it."""
    tag = _replaced_copy_tag(name)
    return (
        tag is not None
        and os.path.isfile(os.path.join(root, name, ix.INDEX_FILE))
        and not os.path.isfile(os.path.join(root, tag, ix.INDEX_FILE))
    )


def _write_file(path: str, arrays: list[np.ndarray]) -> tuple[int, str]:
    """Write arrays' raw bytes back to back, fsync; returns (bytes, SHA-256 hex).

    Raises:
        OSError: the write, flush or fsync failed; ``filename`` is ``path``.
    """
    h = hashlib.sha256()
    total = 0
    try:
        with open(path, "wb") as f:
            for a in arrays:
                mv = memoryview(np.ascontiguousarray(a)).cast("B")
                for s in range(0, len(mv), _WRITE_CHUNK):
                    chunk = mv[s : s + _WRITE_CHUNK]
                    f.write(chunk)
                    h.update(chunk)
                total += len(mv)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        exc.filename = exc.filename or path  # write()/fsync() errors carry no path
        raise
    return total, h.hexdigest()


def _write_json_durably(path: str, obj: dict[str, Any]) -> None:
    """Write ``obj`` as JSON (ASCII) and fsync. Raises OSError with ``filename`` set."""
    import json

    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        exc.filename = exc.filename or path
        raise


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _path(v) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", "?"))


def _dtype_name(v) -> str:
    dt = v.dtype
    return dt if isinstance(dt, str) else getattr(dt, "name", str(dt))
