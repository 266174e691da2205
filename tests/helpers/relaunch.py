"""Launch a multi-worker test job, relaunched once when its workers hit TensorFlow's
start-up broadcast stall.

Seen in CI on 2 loaded cores, in 3 different jobs: both workers of a fresh
``MultiWorkerMirroredStrategy`` block in the broadcast of a new variable's initial value
from rank 0 (``collective_bcast_send`` / ``collective_bcast_recv``, the same group and
instance keys on both, no connection from rank 0 to rank 1), for ever: the cause is inside
TensorFlow's collective runtime and was not found. The runtime bounds that broadcast
(``comm.watchdog._wrap_initial_values``): the job then fails with the watchdog's message
naming it. A test relaunches such a job once, in fresh processes, as a user's scheduler
would; any other failure, and a second stall, is returned as it is.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

from zero_runtime import launch

#: The watchdog's message for the stalled initial-value broadcast.
STARTUP_STALL = "broadcast of variable"


def launch_job(
    nproc: int,
    args: Sequence[str],
    out: io.StringIO,
    reset: Callable[[], None] | None = None,
) -> int:
    """``zero_runtime.launch.launch(nproc, args, out=out)``, relaunched once after a
    start-up broadcast stall (the module doc). ``reset``: called before the relaunch
    (e.g. empty the job's output directories). Returns the last launch's status; ``out``
    holds every attempt's output, the relaunch announced by a line."""
    text = io.StringIO()
    status = launch.launch(nproc, list(args), out=text)
    out.write(text.getvalue())
    if status == 0 or STARTUP_STALL not in text.getvalue():
        return status
    out.write("\n[test] start-up broadcast stall (TensorFlow): relaunching once\n")
    if reset is not None:
        reset()
    return launch.launch(nproc, list(args), out=out)
