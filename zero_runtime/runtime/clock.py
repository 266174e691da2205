"""The step clock: a step ends when every local replica has updated its optimizer shard.

Each replica's host update (or its last block's update in backward) reports
``(iteration, replica)``; the clock counts them per iteration and, when the last local
replica of an iteration reports, returns a :class:`StepEnd` with the step's wall-clock
duration. Nothing else: what happens at a step end is the coordinator's
(:class:`zero_runtime.runtime.ZeroRuntime`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """One finished step.

    Attributes:
        step: the 0-based optimizer step (Keras's ``iterations`` before the update).
        wall_time: seconds since the epoch when the last local replica reported.
        seconds: seconds since the previous step ended (or since the clock started).
    """

    step: int
    wall_time: float
    seconds: float


class StepClock:
    """Counts replica reports per iteration; thread-safe (replicas report from their own
    host threads).

    Args:
        local_replicas: replicas that run in this process (>= 1); a step ends when all of
            them have reported.
        clock: seconds since the epoch (default ``time.time``).

    Raises:
        ValueError: ``local_replicas`` < 1.
    """

    def __init__(self, local_replicas: int, clock: Callable[[], float] = time.time) -> None:
        if local_replicas < 1:
            raise ValueError(f"local_replicas must be >= 1, got {local_replicas}")
        self.local_replicas = int(local_replicas)
        self._clock = clock
        self._pending: dict[int, int] = {}  # iteration -> local replicas reported
        self._lock = threading.Lock()
        self._last_end = clock()

    def replica_done(self, iteration: int) -> StepEnd | None:
        """Record that one local replica finished ``iteration``.

        Returns:
            The :class:`StepEnd` when this was the iteration's last local replica, else None.
        """
        with self._lock:
            done = self._pending.get(iteration, 0) + 1
            if done < self.local_replicas:
                self._pending[iteration] = done
                return None
            self._pending.pop(iteration, None)
            now = self._clock()
            seconds, self._last_end = now - self._last_end, now
        return StepEnd(int(iteration), now, seconds)
