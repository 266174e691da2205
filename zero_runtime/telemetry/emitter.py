"""Write StepStats summaries off the training step's critical path, in batches.

The step boundary runs inside the step (the last replica's optimizer update, a
``tf.numpy_function``), so every millisecond spent there is step time. Serialising a
record costs ~0.1-0.2 ms of Python; :class:`BackgroundEmitter` hands the finished record to
one daemon thread instead. That thread still needs the interpreter lock and one of the 2
cores the training step runs on, so waking it at every step put its work right where the
step's own Python (the budget checks after the record, the host update) waited for the
lock. Records are therefore handed over without waking the thread: it wakes every
``max_delay`` seconds (or when ``batch`` records are waiting) and writes all of them, giving
the lock back between records (``time.sleep(0)``) so a step waiting for it waits at most
one record. :meth:`drain` wakes it and waits until everything handed over has been
written (``RunSummaries.flush``/``close`` call it, telemetry/summaries.py).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()

#: Records written together: the thread is woken early when this many are waiting.
DEFAULT_BATCH = 64
#: Seconds a record may wait before the thread writes it (the summary writer then flushes
#: to disk within its own ``flush_secs``, 2 s): a live run shows up within ~3 s.
DEFAULT_MAX_DELAY = 1.0


class BackgroundEmitter:
    """Run ``fn(item)`` for each submitted item, in order, on one daemon thread, in batches.

    Args:
        fn: the writer; its exceptions are logged, never raised into training.
        name: the thread's name.
        batch: items waiting that wake the thread before ``max_delay`` (int >= 1; 1 wakes
            it at every item).
        max_delay: seconds an item may wait before it is processed (> 0).
        after_batch: called on the thread after each batch (e.g. to hand the batch's
            events to the file writer at once), or None; its exceptions are logged.

    Raises:
        ValueError: ``batch`` < 1 or ``max_delay`` <= 0.
    """

    def __init__(
        self,
        fn: Callable[[Any], None],
        name: str = "zr-telemetry",
        batch: int = DEFAULT_BATCH,
        max_delay: float = DEFAULT_MAX_DELAY,
        after_batch: Callable[[], None] | None = None,
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch={batch!r} is invalid: expected an int >= 1")
        if not max_delay > 0:
            raise ValueError(f"max_delay={max_delay!r} is invalid: expected seconds > 0")
        self._fn = fn
        self._after_batch = after_batch
        self._batch = batch
        self._max_delay = max_delay
        self._items: collections.deque = collections.deque()  # appends/pops are atomic
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: Any) -> None:
        """Queue ``item`` (never blocks; wakes the thread only when ``batch`` items wait).

        Raises:
            RuntimeError: after :meth:`close`.
        """
        if self._closed:
            raise RuntimeError("BackgroundEmitter is closed")
        self._items.append(item)
        if len(self._items) >= self._batch:
            self._wake.set()

    def drain(self) -> None:
        """Block until every item submitted before the call has been processed (at once:
        the thread is woken). A no-op after :meth:`close` (everything was processed)."""
        if self._closed or not self._thread.is_alive():
            return
        done = threading.Event()
        self._items.append(done)
        self._wake.set()
        while not done.wait(0.5):
            if not self._thread.is_alive():
                return

    def close(self) -> None:
        """Process everything submitted, then stop the thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._items.append(_STOP)
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._max_delay)
            self._wake.clear()
            processed = 0
            try:
                while self._items:
                    item = self._items.popleft()
                    if item is _STOP:
                        return
                    if isinstance(item, threading.Event):  # a drain() marker
                        self._end_batch(processed)
                        processed = 0
                        item.set()
                        continue
                    try:
                        self._fn(item)
                    except Exception:  # noqa: BLE001 - telemetry must not break training
                        log.exception("telemetry: writing a StepStats record failed")
                    processed += 1
                    time.sleep(0)  # give the interpreter lock to a step waiting for it
            finally:
                self._end_batch(processed)

    def _end_batch(self, processed: int) -> None:
        if processed and self._after_batch is not None:
            try:
                self._after_batch()
            except Exception:  # noqa: BLE001 - telemetry must not break training
                log.exception("telemetry: handing a batch of records to the writer failed")
