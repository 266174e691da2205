"""Agreement between worker processes during a save, through TensorFlow's coordination service.

Multi-worker jobs (``MultiWorkerMirroredStrategy``) run TensorFlow's coordination service
(hosted by the chief); its key-value store carries the few facts a sharded save needs,
so no worker polls the file system:

1. the chief picks the save's *nonce* (names the temporary directory) and publishes it;
2. every worker writes and fsyncs its shard files, then posts its file records
   (size, SHA-256) under ``.../<nonce>/rank<R>``;
3. the chief collects every rank's records, writes the index and publishes the
   checkpoint, then posts ``.../<nonce>/published``; the workers wait for it.

Every wait is bounded by ``timeout_seconds``; a rank that died or stalled surfaces as
TensorFlow's error (``UnavailableError`` / ``DeadlineExceededError``), which the
multi-worker failure hook reports with the rank (``zero_runtime.multiworker``). In one
process :class:`LocalCoordinator` does the same steps without messages.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import uuid
from typing import Any

#: Key prefix in the coordination service's key-value store.
KEY_PREFIX = "zero_runtime/checkpoint"

_SAVE_COUNTERS: dict[str, itertools.count] = {}


class LocalCoordinator:
    """One process: the chief is the only rank; nothing to exchange."""

    rank = 0
    num_workers = 1

    def nonce(self, root: str) -> str:
        """A fresh save id (hex)."""
        del root
        return uuid.uuid4().hex[:12]

    def post_files(self, nonce: str, files: dict[str, Any]) -> None:
        """Nothing to post: the chief already holds its own records."""

    def gather_files(self, nonce: str, own: dict[str, Any]) -> dict[str, Any]:
        """The chief's own records."""
        return dict(own)

    def announce_published(self, nonce: str, tag: str) -> None:
        """Nothing to announce."""

    def wait_published(self, nonce: str) -> str:  # pragma: no cover - never a non-chief
        """Not used in one process."""
        raise RuntimeError("a single process has no non-chief worker")


class ServiceCoordinator:
    """Several workers: messages through the coordination service's key-value store.

    Args:
        rank: this worker's rank (0 = chief).
        num_workers: worker processes in the job.
        timeout_seconds: bound on every wait, seconds (> 0).
    """

    def __init__(self, rank: int, num_workers: int, timeout_seconds: float) -> None:
        from tensorflow.python.eager import context

        self._ctx = context.context()
        self.rank = rank
        self.num_workers = num_workers
        self.timeout_ms = max(1, int(timeout_seconds * 1000))

    def nonce(self, root: str) -> str:
        """The save id: chosen by the chief, read by the others (the N-th save of ``root``
        in this job has the same key on every worker)."""
        digest = hashlib.sha1(root.encode()).hexdigest()[:12]
        seq = next(_SAVE_COUNTERS.setdefault(digest, itertools.count()))
        key = f"{KEY_PREFIX}/{digest}/{seq}/nonce"
        if self.rank == 0:
            value = uuid.uuid4().hex[:12]
            self._ctx.set_config_key_value(key, value)
            return value
        return self._get(key)

    def post_files(self, nonce: str, files: dict[str, Any]) -> None:
        """Post this worker's file records (after its files are fsynced)."""
        self._ctx.set_config_key_value(f"{KEY_PREFIX}/{nonce}/rank{self.rank}", json.dumps(files))

    def gather_files(self, nonce: str, own: dict[str, Any]) -> dict[str, Any]:
        """Chief: every rank's file records merged with its own."""
        out = dict(own)
        for r in range(1, self.num_workers):
            out.update(json.loads(self._get(f"{KEY_PREFIX}/{nonce}/rank{r}")))
        return out

    def announce_published(self, nonce: str, tag: str) -> None:
        """Chief: the checkpoint is published under ``tag``."""
        self._ctx.set_config_key_value(f"{KEY_PREFIX}/{nonce}/published", tag)

    def wait_published(self, nonce: str) -> str:
        """Non-chief: wait until the chief published; returns the tag."""
        return self._get(f"{KEY_PREFIX}/{nonce}/published")

    def _get(self, key: str) -> str:
        value = self._ctx.get_config_key_value(key, self.timeout_ms)
        return value.decode() if isinstance(value, bytes) else str(value)


def coordinator_for(strategy: Any, timeout_seconds: float) -> LocalCoordinator | ServiceCoordinator:
    """The coordinator for ``strategy``: a service one when it spans several workers."""
    cluster = getattr(strategy, "cluster", None)
    if cluster is None or cluster.num_workers <= 1:
        return LocalCoordinator()
    return ServiceCoordinator(cluster.rank, cluster.num_workers, timeout_seconds)
