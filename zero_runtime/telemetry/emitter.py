"""Write StepStats summaries off the training step's critical path.

The step boundary runs inside the step (the last replica's optimizer update, a
``tf.numpy_function``), so every millisecond spent there is step time. Serialising six
summaries costs ~1-2 ms on this machine; :class:`BackgroundEmitter` hands the finished
record to one daemon thread instead, and :meth:`drain` waits until everything handed over
has been written (``RunSummaries.flush``/``close`` call it, telemetry/summaries.py).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()


class BackgroundEmitter:
    """Run ``fn(item)`` for each submitted item, in order, on one daemon thread.

    Args:
        fn: the writer; its exceptions are logged, never raised into training.
        name: the thread's name.
    """

    def __init__(self, fn: Callable[[Any], None], name: str = "zr-telemetry") -> None:
        self._fn = fn
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, item: Any) -> None:
        """Queue ``item`` (never blocks). Raises RuntimeError after :meth:`close`."""
        if self._closed:
            raise RuntimeError("BackgroundEmitter is closed")
        self._queue.put(item)

    def drain(self) -> None:
        """Block until every submitted item has been processed."""
        self._queue.join()

    def close(self) -> None:
        """Drain, then stop the thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._fn(item)
            except Exception:  # noqa: BLE001 - telemetry must not break training
                log.exception("telemetry: writing a StepStats record failed")
            finally:
                self._queue.task_done()
