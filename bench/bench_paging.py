"""Benchmark of the paged buffer pool's NVMe tier against the raw disk, and of prefetch.

In one run, on one directory:

1. **dd**: ``dd if=/dev/zero of=F bs=4M count=N oflag=direct`` and ``dd if=F
   of=/dev/null bs=4M iflag=direct``; if the filesystem refuses direct I/O, the write
   falls back to ``conv=fdatasync`` and the read to a buffered read after
   ``posix_fadvise(DONTNEED)``, and the mode used is recorded.
2. **pool**: ``--total-mib`` of distinct random data in tensors of ``--tensor-pages``
   4 MiB pages, paged out with one ``evict(all, "nvme")`` (sequential page-out) and
   paged back in with ``prefetch(all)`` + ``synchronize()`` (sequential page-in); the
   data are checked after the page-in. Repeated ``--repeats`` times, interleaved with dd;
   medians are reported, with the ratios pool / dd (goal >= 0.8).
3. **checksum**: zlib.crc32 throughput on 4 MiB buffers (1 thread and ``io_threads``
   threads), and one page-out/page-in with the CRC replaced by a constant, to show
   whether the CRC limits throughput.
4. **prefetch trace**: a replayed stage-3 style access trace (forward over the layers,
   then backward, for several steps) with the host tier holding a third of the
   parameters, simulated compute per layer, and three policies: no prefetch, prefetch
   with LRU eviction, prefetch with the access order declared (reuse distance). Reported:
   prefetch hit rate (hits / (hits + misses)), stall seconds and pages moved.

Results go to ``bench/results/paging.json`` with the date and the machine (nproc, RAM,
filesystem type). Usage::

    .venv/bin/python bench/bench_paging.py [--dir DIR] [--total-mib 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zero_runtime.memory import PagedBufferPool  # noqa: E402
from zero_runtime.memory import io as memory_io  # noqa: E402
from zero_runtime.memory.checksum import page_checksum  # noqa: E402

MIB = 1 << 20
PAGE = 4 * MIB  # bytes per page (the pool's default)
GOAL = 0.8  # pool throughput / dd throughput
RESULTS = Path(__file__).resolve().parent / "results" / "paging.json"
DD_RATE = re.compile(r"(\d+) bytes .* copied, ([\d.]+) s")


def filesystem_of(path: str) -> dict[str, str]:
    """The mount (device, mount point, type) holding ``path``, from /proc/mounts."""
    real = os.path.realpath(path)
    best = {"device": "?", "mount_point": "/", "type": "?"}
    with open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            device, mount_point, fstype = line.split()[:3]
            inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best["mount_point"]):
                best = {"device": device, "mount_point": mount_point, "type": fstype}
    return best


def run_dd(args: list[str]) -> tuple[int, float]:
    """Run dd; return (bytes, seconds) from its summary line."""
    result = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    match = DD_RATE.search(result.stderr)
    if not match:
        raise RuntimeError(f"unexpected dd output: {result.stderr!r}")
    return int(match.group(1)), float(match.group(2))


def dd_write(path: str, count: int) -> tuple[float, str]:
    """Sequential write of ``count`` 4 MiB blocks; (bytes/s, mode)."""
    base = ["if=/dev/zero", f"of={path}", "bs=4M", f"count={count}"]
    try:
        nbytes, seconds = run_dd([*base, "oflag=direct"])
        return nbytes / seconds, "oflag=direct"
    except subprocess.CalledProcessError:
        nbytes, seconds = run_dd([*base, "conv=fdatasync"])
        return nbytes / seconds, "conv=fdatasync"


def dd_read(path: str) -> tuple[float, str]:
    """Sequential read of the file in 4 MiB blocks; (bytes/s, mode)."""
    try:
        nbytes, seconds = run_dd([f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"])
        return nbytes / seconds, "iflag=direct"
    except subprocess.CalledProcessError:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        nbytes, seconds = run_dd([f"if={path}", "of=/dev/null", "bs=4M"])
        return nbytes / seconds, "buffered after fadvise(DONTNEED)"


def pool_round_trip(
    directory: str, total: int, tensor_pages: int, io_threads: int, queue_depth: int
) -> dict[str, float | str]:
    """Page ``total`` bytes out and back in; return the throughputs (bytes/s)."""
    n_tensors = total // (tensor_pages * PAGE)
    floats = tensor_pages * PAGE // 4
    with PagedBufferPool(
        page_size_bytes=PAGE,
        host_budget_bytes=total,
        nvme_path=directory,
        nvme_budget_bytes=total,
        io_threads=io_threads,
        queue_depth=queue_depth,
    ) as pool:
        ids = [f"w{i}" for i in range(n_tensors)]
        digests = {}
        rng = np.random.default_rng(0)
        for tid in ids:
            data = rng.integers(0, 2**31, floats, dtype=np.int32).view(np.float32)
            pool.allocate(tid, data.shape, data.dtype, kind="param")
            pool.write(tid, data)
            digests[tid] = zlib.crc32(data)
        pool.step_boundary(0)
        start = time.perf_counter()
        pool.evict(ids, "nvme")
        out_seconds = time.perf_counter() - start
        start = time.perf_counter()
        pool.prefetch(ids)
        pool.synchronize()
        in_seconds = time.perf_counter() - start
        counters = pool.step_boundary(1)
        assert counters.h2n_bytes == total and counters.n2h_bytes == total, counters
        for tid in ids:
            got = pool.acquire(tid)
            assert zlib.crc32(got) == digests[tid], f"{tid} changed on the round trip"
            pool.release(tid)
        return {
            "page_out": total / out_seconds,
            "page_in": total / in_seconds,
            "io_mode": pool.nvme_io_mode,
            "io_seconds": counters.io_seconds,
        }


def _no_checksum(data) -> int:
    """Stand-in for the I/O module's page checksum: a constant (to time the pool without
    it)."""
    return 0


def crc_throughput(threads: int, buffers: int = 64) -> float:
    """zlib.crc32 throughput (bytes/s) over ``buffers`` 4 MiB buffers on ``threads``."""
    data = np.random.default_rng(1).integers(0, 255, PAGE, dtype=np.uint8).tobytes()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda _: zlib.crc32(data), range(buffers)))
    return buffers * PAGE / (time.perf_counter() - start)


def replay_trace(
    directory: str, policy: str, layers: int, pages_per_layer: int, steps: int, compute: float
) -> dict[str, float]:
    """Replay forward+backward over ``layers`` tensors for ``steps`` steps.

    The host tier holds a third of the parameters; the rest start on NVMe. Per access:
    (optionally) prefetch the tensor ``lookahead`` accesses ahead, acquire, compute
    (sleep ``compute`` seconds, which releases the GIL like a TensorFlow op), release.
    """
    ids = [f"layer{i}" for i in range(layers)]
    trace = ids + ids[::-1]  # forward then backward, as stage 3 gathers parameters
    lookahead = 2
    host_pages = max(lookahead + 1, layers * pages_per_layer // 3)
    with PagedBufferPool(
        page_size_bytes=PAGE,
        host_budget_bytes=host_pages * PAGE,
        nvme_path=directory,
    ) as pool:
        for tid in ids:
            pool.allocate(tid, (pages_per_layer * PAGE // 4,), np.float32, kind="param")
            pool.evict(tid, "nvme")
        if policy == "prefetch+order":
            pool.set_access_order(trace)
        pool.step_boundary(-1)
        totals: dict[str, float] = {}
        for step in range(steps):
            if policy != "none":
                pool.prefetch(trace[:lookahead])
            for i, tid in enumerate(trace):
                if policy != "none" and i + lookahead < len(trace):
                    pool.prefetch(trace[i + lookahead])
                pool.acquire(tid)
                time.sleep(compute)
                pool.release(tid)
            counters = pool.step_boundary(step)
            for key, value in vars(counters).items():
                totals[key] = totals.get(key, 0) + value
        acquired = totals["prefetch_hits"] + totals["prefetch_misses"]
        return {
            "prefetch_hit_rate": totals["prefetch_hits"] / acquired,
            "prefetch_hits": totals["prefetch_hits"],
            "prefetch_misses": totals["prefetch_misses"],
            "stall_seconds": totals["stall_seconds"],
            "n2h_pages": totals["n2h_pages"],
            "h2n_pages": totals["h2n_pages"],
            "evictions": totals["evictions"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="directory on the disk to test")
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--tensor-pages", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    work = tempfile.mkdtemp(prefix="zr-bench-paging-", dir=args.dir)
    total = args.total_mib * MIB
    count = total // PAGE
    fs = filesystem_of(work)
    try:
        dd_file = os.path.join(work, "dd.bin")
        dd_w, dd_r, out, inn = [], [], [], []
        modes: dict[str, str] = {}
        io_mode = None
        for rep in range(args.repeats):
            rate, modes["write"] = dd_write(dd_file, count)
            dd_w.append(rate)
            rate, modes["read"] = dd_read(dd_file)
            dd_r.append(rate)
            os.unlink(dd_file)
            result = pool_round_trip(
                work, total, args.tensor_pages, args.io_threads, args.queue_depth
            )
            out.append(result["page_out"])
            inn.append(result["page_in"])
            io_mode = result["io_mode"]
            print(
                f"repeat {rep}: dd write {dd_w[-1] / MIB:.0f} MiB/s read {dd_r[-1] / MIB:.0f} "
                f"MiB/s | pool out {out[-1] / MIB:.0f} MiB/s in {inn[-1] / MIB:.0f} MiB/s",
                flush=True,
            )

        memory_io.page_checksum = _no_checksum  # type: ignore[assignment]
        try:
            no_crc = pool_round_trip(
                work, total, args.tensor_pages, args.io_threads, args.queue_depth
            )
        finally:
            memory_io.page_checksum = page_checksum

        trace_cfg = {"layers": 24, "pages_per_layer": 2, "steps": 3, "compute": 0.04}
        trace = {
            policy: replay_trace(work, policy, **trace_cfg)
            for policy in ("none", "prefetch", "prefetch+order")
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "nproc": os.cpu_count(),
            "ram_bytes": psutil.virtual_memory().total,
            "filesystem": fs,
            "kernel": platform.release(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "config": {
            "page_size_bytes": PAGE,
            "total_bytes": total,
            "tensor_pages": args.tensor_pages,
            "io_threads": args.io_threads,
            "queue_depth": args.queue_depth,
            "repeats": args.repeats,
            "pool_io_mode": io_mode,
        },
        "dd": {
            "write_mode": modes["write"],
            "read_mode": modes["read"],
            "write_bytes_per_second": dd_w,
            "read_bytes_per_second": dd_r,
            "write_median_bytes_per_second": med(dd_w),
            "read_median_bytes_per_second": med(dd_r),
        },
        "pool": {
            "page_out_bytes_per_second": out,
            "page_in_bytes_per_second": inn,
            "page_out_median_bytes_per_second": med(out),
            "page_in_median_bytes_per_second": med(inn),
        },
        "ratios": {
            "page_out_vs_dd_write": med(out) / med(dd_w),
            "page_in_vs_dd_read": med(inn) / med(dd_r),
        },
        "goal_ratio": GOAL,
        "meets_goal": med(out) / med(dd_w) >= GOAL and med(inn) / med(dd_r) >= GOAL,
        "checksum": {
            "crc32_bytes_per_second_1_thread": crc_throughput(1),
            f"crc32_bytes_per_second_{args.io_threads}_threads": crc_throughput(args.io_threads),
            "pool_without_crc_page_out_bytes_per_second": no_crc["page_out"],
            "pool_without_crc_page_in_bytes_per_second": no_crc["page_in"],
            "note": "one round trip with zlib.crc32 replaced by a constant in the I/O "
            "threads; compare with the pool medians above",
        },
        "prefetch_trace": {
            "description": "forward then backward over 24 layers of 2 pages (8 MiB) each, "
            "3 steps, host tier = 1/3 of the parameters, the rest on NVMe; per access: "
            "prefetch 2 accesses ahead, acquire, 40 ms simulated compute (sleep), release",
            **trace_cfg,
            "policies": trace,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: results[k] for k in ("ratios", "meets_goal", "prefetch_trace")}, indent=2))


if __name__ == "__main__":
    main()
