"""Notice that a run's event files were replaced or truncated, so its caches are rebuilt.

The plugin's caches (:mod:`tb_plugin.reader`'s levels and json records, the encoded
``/series`` answers) are keyed by ``max_step``, which only tells that a run grew. A demo
rerun into the same logdir empties the run's directory and writes new files: the new run
can end at the same ``max_step`` as the old one (or the levels, already past it, are never
read again), and a TensorBoard left open would keep answering the old data.

:class:`RunGenerations` stats a run's event files (``*tfevents*`` directly in its
directory) on each call and counts a new **generation** when a file it saw is gone, has
another inode, or is smaller than it was (truncated), or when a file appears whose name
sorts before the newest one seen (an older writer's file is never created later). A live
run appending to its file, or opening a newer one, keeps its generation, so its caches
stay incremental. The generation goes into every cache key of the run.
"""

from __future__ import annotations

import os
import threading

_FileState = dict[str, tuple[int, int]]  # file name -> (inode, size in bytes)


def event_files(run_dir: str) -> _FileState:
    """``{name: (inode, size)}`` of the event files directly in ``run_dir`` ({} if none
    or the directory is unreadable)."""
    found: _FileState = {}
    try:
        with os.scandir(run_dir) as entries:
            for entry in entries:
                if "tfevents" in entry.name and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    found[entry.name] = (st.st_ino, st.st_size)
    except OSError:
        return {}
    return found


def replaced(before: _FileState, now: _FileState) -> bool:
    """Whether ``now`` is not ``before`` grown: a file gone, with another inode, shorter,
    or a new file named before the newest one of ``before``."""
    for name, (inode, size) in before.items():
        current = now.get(name)
        if current is None or current[0] != inode or current[1] < size:
            return True
    newest = max(before, default="")
    return any(name not in before and name < newest for name in now)


class RunGenerations:
    """Per run directory, a generation number that changes when its files were replaced.

    Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, _FileState]] = {}  # run -> (generation, files)

    def generation(self, logdir: str, run: str) -> int:
        """The run's generation now (0 first; +1 at each replacement seen).

        Args:
            logdir: TensorBoard's ``--logdir``; empty or a URL (``gs://``...): always 0
                (nothing to stat).
            run: the run name, a path relative to ``logdir`` (``"."``: the logdir).
        """
        if not logdir or "://" in logdir:
            return 0
        now = event_files(os.path.join(logdir, run))
        with self._lock:
            gen, before = self._seen.get(run, (0, {}))
            if replaced(before, now):
                gen += 1
            self._seen[run] = (gen, now)
            return gen
