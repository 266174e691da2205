"""Run helper jobs (fresh Python processes that write one JSON record each) side by side.

A test that compares two measurements taken in fresh processes (an allocator peak with
and without a feature) runs both at once: the test process waits meanwhile, so the two
jobs share the machine's cores instead of running one after the other. Each process
measures only itself (its own allocator, its own step), so running them together changes
their wall time, not their figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_json_jobs(
    jobs: list[tuple[list[str], Path]], timeout: float = 600.0, env: dict | None = None
) -> list[dict]:
    """Start every ``(argv, out_path)`` job at once with ``sys.executable``, wait for all,
    and return the JSON each wrote to its ``out_path``, in order.

    Args:
        jobs: ``(arguments after the interpreter, the JSON file the job writes)`` pairs.
        timeout: seconds each job may take from the start of all (default 600).
        env: the jobs' environment (default: this process's).

    Raises:
        AssertionError: a job exited non-zero (its stderr's tail in the message) or did
            not finish within ``timeout`` (every job is then killed).
    """
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for argv, _ in jobs
    ]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired as exc:
        for p in procs:
            p.kill()
        raise AssertionError(f"a job did not finish within {timeout} s: {exc.cmd}") from exc
    for p, (argv, _), (_, err) in zip(procs, jobs, outputs):
        assert p.returncode == 0, f"{argv} exited {p.returncode}: {err[-4000:]}"
    return [json.loads(Path(out).read_text()) for _, out in jobs]
