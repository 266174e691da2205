"""What each failure cost and the job's goodput, from the workers' progress reports.

Each worker group (an *attempt*) reports through rank 0's progress file
(:mod:`zero_runtime.progress`) the step it resumed at (``S_r``, at time ``t_r``) and then
each step it completed; the launcher samples the file about every 50 ms
(:meth:`Ledger.poll`). An attempt that resumed at ``S_r`` and last reported ``S_f`` ran
``S_f - S_r`` steps; of those it *kept* the ones the next attempt did not redo, up to
``min(S_f, S_r')`` where ``S_r'`` is the next attempt's resume step (all of them for the
last attempt).

- **steps lost** by the failure before an attempt: the steps the earlier attempts ran
  past ``S_r'`` (the work since the last save), ``max S_f - S_r'``;
- **seconds lost**: from the time the earlier attempt reached its last kept step to
  ``t_r'`` (the redone steps, the step in flight, stopping the group, starting the new
  one, restoring);
- **restart seconds**: from the failure (the launcher saw it) to the new attempt's first
  completed step (start-up, restore, the first step's trace): the figure of
  ``bench/bench_restart.py``;
- **goodput**: ``useful_steps / all_steps`` (kept steps / steps run) and
  ``useful_seconds / wall_seconds``, where an attempt's useful seconds run from its
  ``t_r`` to the time it reached its last kept step (its first step's trace included),
  and the wall time from the first group's start (TensorFlow's start-up included).

Times are the workers' own clock (``time.time()`` in the record) and the launcher's, on
one machine; a step's time is the first sample at or past it (the 50 ms sampling rounds
it up when steps are faster than that).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from zero_runtime import progress


@dataclasses.dataclass
class Attempt:
    """One worker group's progress.

    Attributes:
        number: 0 for the first group, then one more for each restart or resize.
        nproc: its world size.
        started: ``time.time()`` when it was started.
        resumed: its resume report (``S_r``, ``t_r``), or None before it reported.
        samples: ``(steps, time)`` of each completed-step report seen, in order.
        ended: ``time.time()`` when its failure was seen or it ended, or None.
        cause: why the attempt before it ended (the restart or resize line), or None.
        kind: ``"restart"``, ``"preemption"`` (the group before it saved and exited 42) or
            ``"resize"`` (it runs at another world size); None for the first.
        emitted: whether its ``resume`` event was produced.
    """

    number: int
    nproc: int
    started: float
    resumed: progress.Report | None = None
    samples: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    ended: float | None = None
    cause: str | None = None
    kind: str | None = None
    emitted: bool = False

    @property
    def last_step(self) -> int | None:
        """The last step it reported done (``S_f``; ``S_r`` before any), or None."""
        if self.samples:
            return self.samples[-1][0]
        return self.resumed.steps if self.resumed is not None else None

    def time_at(self, steps: int) -> float:
        """When it first reported ``steps`` or more done (``t_r`` at or below ``S_r``)."""
        assert self.resumed is not None
        if steps <= self.resumed.steps:
            return self.resumed.time
        for done, when in self.samples:
            if done >= steps:
                return when
        return self.samples[-1][1] if self.samples else self.resumed.time


class Ledger:
    """The attempts of one job and what each failure cost.

    Args:
        path: the progress file rank 0 writes (``ZERO_RUNTIME_PROGRESS_FILE``).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.attempts: list[Attempt] = []

    def start(
        self, number: int, nproc: int, cause: str | None = None, kind: str | None = None
    ) -> None:
        """A group starts: a new attempt (the progress file is emptied first), after a
        ``kind`` (:class:`Attempt`) for ``cause``."""
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        self.attempts.append(Attempt(number, nproc, time.time(), cause=cause, kind=kind))

    def poll(self) -> dict[str, Any] | None:
        """Read the progress file into the running attempt. Returns the attempt's
        ``resume`` record (:meth:`resume_record`) once, at its first completed step."""
        if not self.attempts:
            return None
        now = self.attempts[-1]
        resumed, step = progress.read(self.path)
        if resumed is not None:
            now.resumed = resumed
        if now.resumed is None:
            return None  # a step record without its resume record: a torn read
        if step is not None and (not now.samples or step.steps > now.samples[-1][0]):
            now.samples.append((step.steps, step.time))
        if now.samples and not now.emitted:
            now.emitted = True
            return self.resume_record(len(self.attempts) - 1)
        return None

    def end(self, when: float) -> dict[str, Any] | None:
        """The running attempt ended (failure seen, or done) at ``when``; a last poll.
        Returns its ``resume`` record when it resumed but never completed a step."""
        if not self.attempts:
            return None
        record = self.poll()
        now = self.attempts[-1]
        now.ended = when
        if record is None and now.resumed is not None and not now.emitted:
            now.emitted = True
            record = self.resume_record(len(self.attempts) - 1)
        return record

    def _previous_resumed(self, i: int) -> list[Attempt]:
        """The attempts before ``i`` back to (and with) the last one that resumed."""
        back = []
        for a in reversed(self.attempts[:i]):
            back.append(a)
            if a.resumed is not None:
                break
        return back

    def resume_record(self, i: int) -> dict[str, Any]:
        """Attempt ``i``'s ``resume`` record: ``attempt``, ``nproc``, ``step`` (resumed
        at), ``kind`` and ``cause`` (of the restart or resize before it; None for the
        first),
        ``steps_lost``, ``seconds_lost``, ``restart_seconds`` (None for the first, or
        when unknown), and the ``goodput`` so far (:meth:`goodput`)."""
        a = self.attempts[i]
        assert a.resumed is not None
        record: dict[str, Any] = {
            "attempt": a.number,
            "nproc": a.nproc,
            "step": a.resumed.steps,
            "kind": a.kind,
            "cause": a.cause,
            "steps_lost": None,
            "seconds_lost": None,
            "restart_seconds": None,
        }
        before = self._previous_resumed(i)
        if before:
            ran = [x.last_step for x in before if x.last_step is not None]
            record["steps_lost"] = max(0, max(ran, default=a.resumed.steps) - a.resumed.steps)
            failed = self.attempts[i - 1]
            if failed.ended is not None and a.samples:
                record["restart_seconds"] = round(a.samples[0][1] - failed.ended, 3)
            last = before[-1]
            if last.resumed is not None:
                kept_to = self._kept_end(self.attempts.index(last))
                record["seconds_lost"] = round(a.resumed.time - last.time_at(kept_to), 3)
        record["goodput"] = self.goodput()
        return record

    def _kept_end(self, i: int) -> int:
        """The last step attempt ``i`` kept: ``min(S_f, S_r')`` of the next attempt that
        resumed (``S_f`` when none did), never below its own ``S_r``."""
        a = self.attempts[i]
        assert a.resumed is not None
        end = a.last_step if a.last_step is not None else a.resumed.steps
        for b in self.attempts[i + 1 :]:
            if b.resumed is not None:
                end = min(end, b.resumed.steps)
                break
        return max(end, a.resumed.steps)

    def goodput(self, now: float | None = None) -> dict[str, Any]:
        """The job's goodput up to ``now`` (default: the time of the call).

        Returns:
            ``{"useful_steps", "all_steps", "steps_ratio", "useful_seconds",
            "wall_seconds", "time_ratio"}``: steps kept and steps run (ints), their ratio
            (None before any step), seconds of kept steps and since the first group
            started (s, 3 decimals), their ratio in [0, 1] (None at 0 s).
        """
        now = time.time() if now is None else now
        useful = run = 0
        useful_s = 0.0
        for i, a in enumerate(self.attempts):
            if a.resumed is None:
                continue
            last = a.last_step if a.last_step is not None else a.resumed.steps
            run += max(0, last - a.resumed.steps)
            kept = self._kept_end(i)
            useful += kept - a.resumed.steps
            if kept > a.resumed.steps:
                useful_s += a.time_at(kept) - a.resumed.time
        wall = now - self.attempts[0].started if self.attempts else 0.0
        return {
            "useful_steps": useful,
            "all_steps": run,
            "steps_ratio": round(useful / run, 4) if run else None,
            "useful_seconds": round(useful_s, 3),
            "wall_seconds": round(wall, 3),
            "time_ratio": round(min(1.0, useful_s / wall), 4) if wall > 0 else None,
        }
