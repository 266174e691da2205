"""Atomic JSON files: the writer behind the files the runtime's services and the plugin
replace in place (control requests and acknowledgements, access-trace steps, what-if
predictions). Readers see the old file or the new one, never a partial one. (The OOM
post-mortem, written from the foundations layer, keeps its own in ``oom_report``.)"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def write_json_atomic(
    path: str,
    obj: Any,
    *,
    fsync: bool = True,
    make_dirs: bool = False,
    prefix: str = ".tmp_",
    suffix: str = ".json",
    **dump_kwargs: Any,
) -> None:
    """Write ``obj`` as JSON to ``path`` atomically: a temporary file in the same directory
    (``prefix``/``suffix`` name it), optionally fsync'd, then ``os.replace``. The temporary
    file is removed if anything fails.

    Args:
        path: the file to replace.
        obj: JSON-serialisable; NaN and infinity are refused.
        fsync: flush the data to disk before the rename (default True; False for files
            that are cheap to lose, such as access-trace steps).
        make_dirs: create the parent directory first (default False).
        prefix: the temporary file's name prefix (default ``.tmp_``).
        suffix: the temporary file's name suffix (default ``.json``).
        **dump_kwargs: passed to :func:`json.dump` (``indent``, ``sort_keys``,
            ``separators``).

    Raises:
        OSError: the directory cannot be created or written.
        ValueError: NaN or infinity in ``obj``.
        TypeError: ``obj`` is not JSON-serialisable.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if make_dirs:
        os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, allow_nan=False, **dump_kwargs)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
