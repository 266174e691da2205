"""Host Adam update throughput vs the machine's memory-bandwidth bound.

An Adam step reads param, grad, m, v and writes param, m, v: 7 float32 streams, 28 bytes
per parameter (ZeRO-Offload, Ren et al., ATC 2021, section 4.3 on the CPU optimizer being
memory bound). The bound is ``copy_bandwidth / 28`` parameters per second, where the copy
bandwidth (bytes read + written per second) is measured in the same run on arrays far
larger than the caches, two ways: ``np.copyto`` (the brief's "copy bandwidth"; it hides
write-allocate traffic, so it understates what the memory system moves) and an in-place
``a += 1``; the higher of the two sets the bound.

Writes ``bench/results/host_adam.json``: elements/s of the whole-array and tiled kernels,
the bandwidth, the ratio of the best to the bound (goal >= 0.5), date, nproc, RAM and CPU.

Usage: ``.venv/bin/python bench/bench_host_adam.py [--elements N] [--repeats R]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import _checkout  # noqa: E402, F401  (this checkout's zero_runtime, not the editable install's)
import numpy as np
import psutil

from zero_runtime.optim import kernels
from zero_runtime.optim.host_state import run_tiles

BYTES_PER_PARAM = 28  # read p, g, m, v + write p, m, v; float32
RESULTS = Path(__file__).parent / "results" / "host_adam.json"


def _best(fn, repeats: int) -> float:
    fn()  # warm up (page faults, caches)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes read + written per second by ``np.copyto`` of ``nbytes``-byte arrays."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * src.nbytes / _best(lambda: np.copyto(dst, src), repeats)


def inplace_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes read + written per second by an in-place ``a += 1`` over ``nbytes`` bytes.

    Unlike a copy, an in-place pass writes lines it has just read, so no write-allocate
    traffic is hidden in the figure (a copy reads the destination line before writing
    it: 3 bytes of traffic per 2 counted). Adam updates p, m, v in place.
    """
    a = np.ones(nbytes // 4, np.float32)
    one = np.float32(1.0)
    return 2 * a.nbytes / _best(lambda: np.add(a, one, out=a), repeats)


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    """Run the benchmark and write the results file."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=16_000_000, help="parameters (default 16M)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    n = args.elements
    rng = np.random.default_rng(0)
    p = rng.standard_normal(n, dtype=np.float32)
    g = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    consts = [np.float32(x) for x in (1e-3, 0.1, 0.001, 1e-7)]
    copy_bw = copy_bandwidth(4 * n * 2, args.repeats)
    inplace_bw = inplace_bandwidth(4 * n * 2, args.repeats)
    bandwidth = max(copy_bw, inplace_bw)  # the stricter (higher) bound
    bound = bandwidth / BYTES_PER_PARAM  # parameters per second

    s1, s2 = np.empty(n, np.float32), np.empty(n, np.float32)
    whole = n / _best(lambda: kernels.adam_update(p, g, m, v, *consts, s1, s2), args.repeats)

    def step(slots, scratch, param, grad):
        kernels.adam_update(param, grad, slots["m"], slots["v"], *consts, *scratch)

    tiled = {}
    for tile in (16_384, kernels.TILE_ELEMENTS, 262_144):
        scratch = (np.empty(tile, np.float32), np.empty(tile, np.float32))
        tiled[tile] = n / _best(
            lambda scratch=scratch: run_tiles(step, {"m": m, "v": v}, scratch, p, g, 0, n),
            args.repeats,
        )
    best = max(whole, *tiled.values())
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "cpu_model": cpu_model(),
        "elements": n,
        "bytes_per_param": BYTES_PER_PARAM,
        "copy_bandwidth_bytes_per_s": copy_bw,
        "inplace_bandwidth_bytes_per_s": inplace_bw,
        "bandwidth_used_for_bound_bytes_per_s": bandwidth,
        "bound_elements_per_s": bound,
        "whole_array_elements_per_s": whole,
        "tiled_elements_per_s": {str(k): v for k, v in tiled.items()},
        "runtime_tile_elements": kernels.TILE_ELEMENTS,
        "best_elements_per_s": best,
        "ratio": best / bound,
        "runtime_ratio": tiled[kernels.TILE_ELEMENTS] / bound,
        "goal": 0.5,
        "goal_met": best / bound >= 0.5,
        "note": "single thread numpy ufuncs with out=; the machine is shared (2 cores)",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
