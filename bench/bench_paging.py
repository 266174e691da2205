"""Benchmark of the paged buffer pool's NVMe tier against the disk (fio, dd), and of prefetch.

The physical limit of paging is the disk at the queue depth the pool keeps busy: the pool
runs ``--io-threads`` threads, each with one synchronous ``pwrite``/``preadv`` of one page
outstanding, so at most ``min(io_threads, queue_depth)`` page I/Os are in flight. In one
run, on one directory, ``--repeats`` times *interleaved* (so the machine's load, which
other jobs change, hits every side alike; the sides' order changes each repeat), with the
load average recorded:

1. **fio** (Debian package, installed by ``scripts/setup.sh``): sequential write then, in
   the same fio run, read of ``--total-mib`` in blocks of the pool's page size
   (``direct=1``; reading right after writing is faster on a virtual disk, so fio gets
   the same order as the pool's round trip),
   at queue depths 1, ``io_threads`` and ``2 * io_threads``, both as one ``libaio`` job
   at that ``iodepth`` and as that many ``psync`` threads (as the pool works); each
   write goes to a new file that fio preallocates (``fallocate=native``), as the pool's
   slab is.
2. **dd**: ``dd bs=4M oflag=direct`` / ``iflag=direct`` (queue depth 1); if the filesystem
   refuses direct I/O, ``conv=fdatasync`` and a buffered read after
   ``posix_fadvise(DONTNEED)``, and the mode used is recorded.
3. **pool**: ``--total-mib`` of distinct random data in tensors of ``--tensor-pages``
   pages, paged out with one ``evict(all, "nvme")`` and paged back in with
   ``prefetch(all)`` + ``synchronize()``; the data are checked after the page-in. Then
   the same round trip with the page checksum replaced by a constant, to show what the
   checksum costs.

Reported: medians, and the pool's page-out / page-in bandwidth as a ratio of fio's write
/ read bandwidth at the pool's queue depth (goal >= 0.8), also of fio's best depth and of
dd. Then:

4. **checksum**: CRC-32C (``crc32c``, the pool's) and zlib's CRC-32 throughput on pages,
   on 1 and ``io_threads`` threads.
5. **prefetch trace**: a replayed stage-3 style access trace (forward over the layers,
   then backward, for several steps) with the host tier holding a third of the
   parameters, simulated compute per layer, and three policies: no prefetch, prefetch
   with LRU eviction, prefetch with the access order declared (reuse distance). Reported:
   prefetch hit rate (hits / (hits + misses)), stall seconds and pages moved.

Results go to ``bench/results/paging.json`` with the date, the machine (nproc, RAM,
filesystem type) and the load average. Usage::

    .venv/bin/python bench/bench_paging.py [--dir DIR] [--total-mib 512] [--repeats 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
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
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zero_runtime.memory import PagedBufferPool  # noqa: E402
from zero_runtime.memory import io as memory_io  # noqa: E402
from zero_runtime.memory.checksum import ALGORITHM, HARDWARE, page_checksum  # noqa: E402
from zero_runtime.memory.pool import PoolConfig  # noqa: E402

MIB = 1 << 20
PAGE = 4 * MIB  # bytes per page (the pool's default)
GOAL = 0.8  # pool bandwidth / fio bandwidth at the pool's queue depth
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


def fio_available() -> str:
    """fio's version string.

    Raises:
        SystemExit: fio is not installed (``scripts/setup.sh`` installs Debian's).
    """
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed: run scripts/setup.sh (Debian package fio)")
    return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()


def run_fio(
    path: str, size: int, depth: int, engine: str, block: int = PAGE
) -> tuple[float, float]:
    """One fio run of two jobs, as the pool's round trip: a sequential write of ``size``
    bytes to a new, preallocated ``path`` in blocks of ``block`` bytes (default the pool's
    default page, 4 MiB), then (``stonewall``) a
    sequential read of it, both O_DIRECT with ``depth`` I/Os in flight; returns (write,
    read) bytes/s.

    ``engine`` 'libaio': one job submitting asynchronously at ``iodepth=depth``.
    'psync': ``depth`` threads (``--thread --numjobs``) with one synchronous
    ``pwrite``/``pread`` each, on consecutive ``size / depth`` slices of the file, which
    is how the pool's I/O threads work.
    """
    if engine == "libaio":
        shape = ["--ioengine=libaio", f"--iodepth={depth}", f"--size={size}"]
    else:
        part = size // depth
        shape = [
            "--ioengine=psync",
            "--thread",
            f"--numjobs={depth}",
            f"--size={part}",
            f"--offset_increment={part}",
            "--group_reporting",
        ]
    cmd = [
        "fio",
        f"--filename={path}",
        f"--bs={block}",
        "--direct=1",
        "--fallocate=native",
        "--output-format=json",
        *shape,
        "--name=write",
        "--rw=write",
        "--name=read",
        "--rw=read",
        "--stonewall",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    jobs = {job["jobname"]: job for job in json.loads(out[out.index("{") :])["jobs"]}
    os.unlink(path)
    return float(jobs["write"]["write"]["bw_bytes"]), float(jobs["read"]["read"]["bw_bytes"])


def pool_io_depth() -> int:
    """Page I/Os the pool keeps in flight: ``min(io_threads, queue_depth)`` at defaults."""
    fields = {f.name: f.default for f in dataclasses.fields(PoolConfig)}
    return min(int(fields["io_threads"]), int(fields["queue_depth"]))


def disk_rates(directory: str, size: int, depth: int, block: int = PAGE) -> dict[str, float]:
    """fio write and read bytes/s at ``depth`` in blocks of ``block`` bytes (:func:`run_fio`,
    libaio and psync; ``read`` / ``write`` the better engine of each)."""
    runs = {}
    for engine in ("libaio", "psync"):
        write, read = run_fio(os.path.join(directory, "fio.bin"), size, depth, engine, block)
        runs[f"{engine}_write"], runs[f"{engine}_read"] = write, read
    return {
        **runs,
        "write": max(runs["libaio_write"], runs["psync_write"]),
        "read": max(runs["libaio_read"], runs["psync_read"]),
    }


def fio_round(directory: str, size: int, depths: list[int]) -> dict[str, float]:
    """fio write + read at each depth, libaio and psync (:func:`run_fio`);
    ``{"<engine>_<rw>_qd<depth>": bytes/s}``."""
    rates: dict[str, float] = {}
    path = os.path.join(directory, "fio.bin")
    for engine in ("libaio", "psync"):
        for depth in depths:
            write, read = run_fio(path, size, depth, engine)
            rates[f"{engine}_write_qd{depth}"] = write
            rates[f"{engine}_read_qd{depth}"] = read
    return rates


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


def crc_throughput(fn: Callable[[memoryview], int], threads: int, buffers: int = 64) -> float:
    """Throughput (bytes/s) of checksum ``fn`` over ``buffers`` pages on ``threads``,
    on a writable page-aligned buffer as the pool's I/O threads see one."""
    buf = memory_io.aligned_buffer(PAGE)
    np.frombuffer(buf, np.uint8)[:] = np.random.default_rng(1).integers(0, 255, PAGE, np.uint8)
    view = memoryview(buf)[:PAGE]
    fn(view)  # warm up
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda _: fn(view), range(buffers)))
    seconds = time.perf_counter() - start
    view.release()
    buf.close()
    return buffers * PAGE / seconds


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


def load() -> list[float]:
    """The 1, 5 and 15-minute load averages now."""
    return [round(x, 2) for x in os.getloadavg()]


def ratio(a: float, b: float) -> float:
    """``a / b`` rounded to 3 places."""
    return round(a / b, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="directory on the disk to test")
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--tensor-pages", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    fio_version = fio_available()

    work = tempfile.mkdtemp(prefix="zr-bench-paging-", dir=args.dir)
    total = args.total_mib * MIB
    count = total // PAGE
    fs = filesystem_of(work)
    pool_depth = min(args.io_threads, args.queue_depth)  # page I/Os in flight at most
    depths = sorted({1, args.io_threads, 2 * args.io_threads})
    run = dict(
        directory=work,
        total=total,
        tensor_pages=args.tensor_pages,
        io_threads=args.io_threads,
        queue_depth=args.queue_depth,
    )
    loads = [load()]
    series: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        series.setdefault(key, []).append(value)

    try:
        dd_file = os.path.join(work, "dd.bin")
        modes: dict[str, str] = {}

        def side_fio() -> None:
            for key, rate in fio_round(work, total, depths).items():
                add(f"fio_{key}", rate)

        def side_dd() -> None:
            rate, modes["write"] = dd_write(dd_file, count)
            add("dd_write", rate)
            rate, modes["read"] = dd_read(dd_file)
            add("dd_read", rate)
            os.unlink(dd_file)

        def side_pool() -> None:
            result = pool_round_trip(**run)
            add("pool_page_out", result["page_out"])
            add("pool_page_in", result["page_in"])
            modes["pool"] = str(result["io_mode"])

        def side_pool_no_checksum() -> None:
            memory_io.page_checksum = _no_checksum  # type: ignore[assignment]
            try:
                bare = pool_round_trip(**run)
            finally:
                memory_io.page_checksum = page_checksum
            add("pool_no_checksum_page_out", bare["page_out"])
            add("pool_no_checksum_page_in", bare["page_in"])

        # The sides' order changes each repeat: rotated by rep // 2, and reversed on odd
        # repeats, so that no side always runs in the same place or after the same
        # side. With a fixed order, the round trip without checksum (always right after
        # the pool's) read 35% slower than the pool's.
        sides = [side_fio, side_dd, side_pool, side_pool_no_checksum]
        for rep in range(args.repeats):
            shift = rep // 2 % len(sides)
            order = sides[shift:] + sides[:shift]
            for side in order[::-1] if rep % 2 else order:
                side()
            loads.append(load())
            last = {key: values[-1] / MIB for key, values in series.items()}
            print(
                f"repeat {rep} (load {loads[-1][0]}): fio qd{pool_depth} write "
                f"{last[f'fio_libaio_write_qd{pool_depth}']:.0f}/"
                f"{last[f'fio_psync_write_qd{pool_depth}']:.0f} read "
                f"{last[f'fio_libaio_read_qd{pool_depth}']:.0f}/"
                f"{last[f'fio_psync_read_qd{pool_depth}']:.0f} (libaio/psync) | dd write "
                f"{last['dd_write']:.0f} read {last['dd_read']:.0f} | pool out "
                f"{last['pool_page_out']:.0f} in {last['pool_page_in']:.0f} | no checksum out "
                f"{last['pool_no_checksum_page_out']:.0f} in "
                f"{last['pool_no_checksum_page_in']:.0f} MiB/s",
                flush=True,
            )

        trace_cfg = {"layers": 24, "pages_per_layer": 2, "steps": 3, "compute": 0.04}
        trace = {
            policy: replay_trace(work, policy, **trace_cfg)
            for policy in ("none", "prefetch", "prefetch+order")
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {key: statistics.median(values) for key, values in series.items()}
    out, inn = med["pool_page_out"], med["pool_page_in"]
    engines = ("libaio", "psync")
    # The disk at the pool's depth: the better of the two ways fio keeps that many I/Os
    # in flight. Best: the best median over every engine and depth.
    fio_w = max(med[f"fio_{e}_write_qd{pool_depth}"] for e in engines)
    fio_r = max(med[f"fio_{e}_read_qd{pool_depth}"] for e in engines)
    best_w = max(med[f"fio_{e}_write_qd{d}"] for e in engines for d in depths)
    best_r = max(med[f"fio_{e}_read_qd{d}"] for e in engines for d in depths)
    ratios = {
        "page_out_vs_fio_write_at_pool_depth": ratio(out, fio_w),
        "page_in_vs_fio_read_at_pool_depth": ratio(inn, fio_r),
        "page_out_vs_fio_best_write": ratio(out, best_w),
        "page_in_vs_fio_best_read": ratio(inn, best_r),
        "page_out_vs_dd_write": ratio(out, med["dd_write"]),
        "page_in_vs_dd_read": ratio(inn, med["dd_read"]),
        "page_out_with_vs_without_checksum": ratio(out, med["pool_no_checksum_page_out"]),
        "page_in_with_vs_without_checksum": ratio(inn, med["pool_no_checksum_page_in"]),
    }
    # Paired: each repeat's pool figure over the same repeat's fio at the pool's depth
    # (better engine), whose median is less sensitive to load that changes between
    # repeats than the ratio of medians.
    paired = {
        direction: [
            round(p / max(series[f"fio_{e}_{rw}_qd{pool_depth}"][i] for e in engines), 3)
            for i, p in enumerate(series[f"pool_page_{direction}"])
        ]
        for direction, rw in (("out", "write"), ("in", "read"))
    }
    ratios["page_out_vs_fio_write_at_pool_depth_per_repeat"] = paired["out"]
    ratios["page_in_vs_fio_read_at_pool_depth_per_repeat"] = paired["in"]
    ratios["page_out_vs_fio_write_at_pool_depth_paired_median"] = statistics.median(paired["out"])
    ratios["page_in_vs_fio_read_at_pool_depth_paired_median"] = statistics.median(paired["in"])
    all_loads = [x[0] for x in loads]
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "nproc": os.cpu_count(),
            "ram_bytes": psutil.virtual_memory().total,
            "filesystem": fs,
            "kernel": platform.release(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "fio": fio_version,
        },
        "load_average": {
            "one_minute_per_repeat": all_loads,
            "min": min(all_loads),
            "max": max(all_loads),
            "note": "1-minute load average before the run and after each repeat; other "
            "jobs share the 2 cores, so every side of a repeat runs back to back",
        },
        "config": {
            "page_size_bytes": PAGE,
            "total_bytes": total,
            "tensor_pages": args.tensor_pages,
            "io_threads": args.io_threads,
            "queue_depth": args.queue_depth,
            "pool_io_depth": pool_depth,
            "fio_depths": depths,
            "repeats": args.repeats,
            "pool_io_mode": modes["pool"],
            "order": "fio, dd, pool, pool without checksum; rotated by repeat // 2, "
            "reversed on odd repeats",
            "checksum": ALGORITHM,
        },
        "fio": {
            "job": f"a write job then (stonewall) a read job of the same new file, as the "
            f"pool's round trip: bs={PAGE} direct=1 fallocate=native; libaio: one job, "
            f"iodepth=qd, size={total}; psync: qd threads (--thread --numjobs=qd) on "
            f"consecutive slices of {total} bytes",
            "at_pool_depth": {"write_bytes_per_second": fio_w, "read_bytes_per_second": fio_r},
            "runs_bytes_per_second": {
                key[len("fio_") :]: {"median": med[key], "runs": values}
                for key, values in series.items()
                if key.startswith("fio_")
            },
        },
        "dd": {
            "write_mode": modes["write"],
            "read_mode": modes["read"],
            "write_bytes_per_second": series["dd_write"],
            "read_bytes_per_second": series["dd_read"],
            "write_median_bytes_per_second": med["dd_write"],
            "read_median_bytes_per_second": med["dd_read"],
        },
        "pool": {
            "page_out_bytes_per_second": series["pool_page_out"],
            "page_in_bytes_per_second": series["pool_page_in"],
            "page_out_median_bytes_per_second": out,
            "page_in_median_bytes_per_second": inn,
            "no_checksum_page_out_median_bytes_per_second": med["pool_no_checksum_page_out"],
            "no_checksum_page_in_median_bytes_per_second": med["pool_no_checksum_page_in"],
        },
        "ratios": ratios,
        "goal_ratio": GOAL,
        "goal": "pool page-out and page-in >= 0.8 of fio write / read at the pool's queue "
        "depth (min(io_threads, queue_depth) page I/Os in flight; the better of libaio and "
        "psync medians)",
        "meets_goal": ratios["page_out_vs_fio_write_at_pool_depth"] >= GOAL
        and ratios["page_in_vs_fio_read_at_pool_depth"] >= GOAL,
        "checksum": {
            "algorithm": ALGORITHM,
            "hardware": HARDWARE,
            "crc32c_bytes_per_second_1_thread": crc_throughput(page_checksum, 1),
            f"crc32c_bytes_per_second_{args.io_threads}_threads": crc_throughput(
                page_checksum, args.io_threads
            ),
            "zlib_crc32_bytes_per_second_1_thread": crc_throughput(zlib.crc32, 1),
            f"zlib_crc32_bytes_per_second_{args.io_threads}_threads": crc_throughput(
                zlib.crc32, args.io_threads
            ),
            "note": "pages of 4 MiB in a writable aligned buffer; the pool's cost of the "
            "checksum is ratios.page_*_with_vs_without_checksum (each repeat also ran the "
            "round trip with the checksum replaced by a constant)",
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
    print(json.dumps({k: results[k] for k in ("ratios", "meets_goal", "load_average")}, indent=2))


if __name__ == "__main__":
    main()
