"""Benchmark of the Memory Hierarchy View at scale: 10 runs x 100,000 steps.

Three phases, each timed:

1. **generate**: write the runs with the real write API, :class:`tb_plugin.summary.SummaryWriter`
   (tiers, readings, pages and timing at every step; run_info, estimate, placement and a
   few config events). The writer costs about 0.5 ms per summary on this class of machine
   (4 summaries per step), so writing 10 x 100,000 distinct steps (4,000,000 summaries)
   would take over half an hour. ``--distinct`` runs (default 2) are therefore written
   with ``SummaryWriter``, one process each, and the remaining runs are byte copies of
   their event files under other run names: the server loads and serves every copy as its
   own run, which is what the latency and paint figures depend on. ``view.json`` records
   how many runs were distinct.
2. **serve**: a real ``tensorboard`` (``--load_fast=true``,
   ``--samples_per_plugin=memory_hierarchy=0``), timed until every run's every step is
   loaded (``/runs`` reports ``max_step`` = steps - 1 for every run).
3. **measure**: the data routes' latency (p50/p95/max over repeated requests, cold and
   warm), and the tab's first meaningful paint in headless Chromium: the time from
   navigation until every selected run's tier chart has drawn (the view records the
   ``performance`` mark ``mh-first-meaningful-paint``; it is converted to the top page's
   navigation time origin).

Results go to ``bench/results/view.json`` with the date and the machine (nproc, RAM, CPU
model). Usage::

    .venv/bin/python bench/bench_view.py [--runs 10] [--steps 100000] [--distinct 2]
        [--logdir /tmp/mh_bench_logdir] [--regenerate]

The logdir is reused when it already holds a complete dataset of the same shape (its
``bench_manifest.json`` records how long generating it took).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tb_plugin import metadata  # noqa: E402

MIB = 2**20
GIB = 2**30
RESULTS = REPO / "bench" / "results" / "view.json"
CHROMIUM = "/usr/bin/chromium"
PLUGIN_FRAME = 'iframe[src*="plugin_entry.html?name=memory_hierarchy"]'
ROUTE_PREFIX = "/data/plugin/memory_hierarchy"
LATENCY_GOAL_MS = 100.0  # p95 of a data route, milliseconds
PAINT_GOAL_MS = 1500.0  # first meaningful paint, milliseconds from navigation
CHART_POINTS = 1000  # the point budget the view asks for per chart (see frontend model.js)
CONFIG_EVENT_EVERY = 25_000  # steps between synthetic config events
SERVER_LOAD_TIMEOUT = 1800.0  # seconds to wait for TensorBoard to load every step
_SERVER_URL = re.compile(r"TensorBoard \S+ at (http://127\.0\.0\.1:(\d+))/")


# -- phase 1: generate ---------------------------------------------------------------------


def run_name(i: int) -> str:
    """The name of the i-th benchmark run."""
    return f"run_{i:02d}"


def write_distinct_run(args: tuple[str, int, int]) -> float:
    """Write one run of ``steps`` steps with SummaryWriter; returns seconds taken."""
    logdir, index, steps = args
    from tb_plugin.summary import SummaryWriter

    start = time.perf_counter()
    scale = 1 + index
    writer = SummaryWriter(os.path.join(logdir, run_name(index)), flush_secs=30.0)
    base_wall = 1_700_000_000.0
    writer.json(
        metadata.TAG_RUN_INFO,
        0,
        {
            "stage": 3,
            "num_replicas": 2,
            "device_is_standin": True,
            "device_description": f"CPU:0 budget {256 * scale} MiB",
            "fallback_mirrored": False,
            "config": {"stage": 3},
        },
        wall_time=base_wall,
    )
    writer.json(
        metadata.TAG_ESTIMATE,
        0,
        {
            "per_process": {
                "device_bytes": 96 * scale * MIB,
                "host_bytes": 700 * scale * MIB,
                "nvme_bytes": 0,
            }
        },
        wall_time=base_wall,
    )
    writer.json(
        metadata.TAG_PLACEMENT,
        0,
        {
            "variables": [
                {
                    "name": f"layer_{k}/kernel",
                    "shape": [256, 256 * (1 + k % 4)],
                    "dtype": "float32",
                    "bytes": 4 * 256 * 256 * (1 + k % 4),
                    "partitioning": "optimizer state sharded 1/2",
                    "shard_bytes_per_replica": 2 * 256 * 256 * (1 + k % 4),
                    "param_tier": "device",
                    "grad_tier": "device",
                    "optimizer_tier": "host" if k % 3 else "nvme",
                }
                for k in range(64)
            ]
        },
        wall_time=base_wall,
    )
    for step in range(steps):
        wall = base_wall + 0.25 * step
        wave = math.sin(step / 500.0)
        device = (64 + 32 * wave) * scale * MIB + (step % 97) * 4096
        host = (512 + 8 * wave) * scale * MIB
        nvme = (step // 1000) * MIB
        writer.matrix(
            metadata.TAG_TIERS,
            step,
            {
                "device": {
                    "used_bytes": device,
                    "capacity_bytes": 256 * scale * MIB,
                    "peak_bytes": device + MIB,
                    "param_bytes": device / 2,
                    "grad_bytes": device / 4,
                    "optimizer_bytes": 0.0,
                    "other_bytes": device / 4,
                },
                "host": {
                    "used_bytes": host,
                    "capacity_bytes": 24.0 * GIB,
                    "peak_bytes": host,
                    "optimizer_bytes": host * 0.75,
                    "other_bytes": host * 0.25,
                },
                "nvme": {"used_bytes": nvme, "optimizer_bytes": nvme},
            },
            wall_time=wall,
        )
        writer.vector(
            metadata.TAG_READINGS,
            step,
            {
                "framework_device_bytes": device * 1.05,
                "process_rss_bytes": host + 300 * MIB,
                "nvme_disk_bytes": nvme,
            },
            wall_time=wall,
        )
        writer.vector(
            metadata.TAG_PAGES,
            step,
            {
                "h2d_pages": float(step % 8),
                "h2d_bytes": float(step % 8) * MIB,
                "d2h_pages": float(step % 5),
                "d2h_bytes": float(step % 5) * MIB,
                "prefetch_hits": float(step % 8),
                "prefetch_misses": float(step % 3),
                "stall_seconds": 0.001 * (step % 3),
            },
            wall_time=wall,
        )
        writer.vector(
            metadata.TAG_TIMING,
            step,
            {
                "step_seconds": 0.25,
                "compute_seconds": 0.18,
                "comm_seconds": 0.08,
                "overlap_seconds": 0.05,
                "stall_seconds": 0.02,
                "overlap_ratio": 0.625,
            },
            wall_time=wall,
        )
        if step and step % CONFIG_EVENT_EVERY == 0:
            writer.json(
                metadata.TAG_CONFIG_EVENT,
                step,
                {
                    "key": "prefetch_depth",
                    "old": step // CONFIG_EVENT_EVERY,
                    "new": 1 + step // CONFIG_EVENT_EVERY,
                },
                wall_time=wall,
            )
    writer.close()
    return time.perf_counter() - start


def generate(logdir: Path, runs: int, steps: int, distinct: int) -> dict[str, Any]:
    """Write the dataset; returns its manifest (shape and timings in seconds)."""
    shutil.rmtree(logdir, ignore_errors=True)
    logdir.mkdir(parents=True)
    distinct = max(1, min(distinct, runs))
    start = time.perf_counter()
    jobs = [(str(logdir), i, steps) for i in range(distinct)]
    with multiprocessing.get_context("spawn").Pool(min(distinct, os.cpu_count() or 1)) as pool:
        per_run = pool.map(write_distinct_run, jobs)
    written = time.perf_counter() - start
    for i in range(distinct, runs):
        source = logdir / run_name(i % distinct)
        target = logdir / run_name(i)
        target.mkdir()
        for f in source.iterdir():
            shutil.copyfile(f, target / f.name)
    total = time.perf_counter() - start
    size = sum(f.stat().st_size for f in logdir.rglob("*") if f.is_file())
    manifest = {
        "runs": runs,
        "steps": steps,
        "distinct_runs": distinct,
        "summaries_per_step": 4,
        "summaries_written": distinct * steps * 4,
        "write_seconds_per_distinct_run": [round(s, 1) for s in per_run],
        "write_seconds": round(written, 1),
        "generation_seconds": round(total, 1),
        "bytes_on_disk": size,
    }
    (logdir / "bench_manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


# -- phase 2: serve ------------------------------------------------------------------------


def start_tensorboard(logdir: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    """Start a real tensorboard (load_fast, every step kept); returns (process, url)."""
    cmd = [
        sys.executable,
        "-m",
        "tensorboard.main",
        "--logdir",
        str(logdir),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--load_fast=true",
        f"--samples_per_plugin={metadata.PLUGIN_NAME}=0",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        match = _SERVER_URL.search(log_path.read_text(errors="replace"))
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.25)
    stop(proc)
    raise RuntimeError(f"tensorboard did not start:\n{log_path.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    """Stop a server started here (its own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def get(url: str) -> tuple[float, bytes]:
    """GET a URL; returns (milliseconds, body)."""
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as resp:
        body = resp.read()
    return (time.perf_counter() - start) * 1000.0, body


def wait_until_loaded(url: str, runs: int, steps: int) -> float:
    """Poll /runs until every run reports every step of the tiers tag; returns seconds."""
    start = time.perf_counter()
    while time.perf_counter() - start < SERVER_LOAD_TIMEOUT:
        try:
            _ms, body = get(f"{url}{ROUTE_PREFIX}/runs")
            listing = json.loads(body)["runs"]
            done = [
                r
                for r in listing
                if all(
                    r["tags"].get(t, {}).get("max_step") == steps - 1
                    for t in (
                        metadata.TAG_TIERS,
                        metadata.TAG_READINGS,
                        metadata.TAG_PAGES,
                        metadata.TAG_TIMING,
                    )
                )
            ]
            if len(done) == runs:
                return time.perf_counter() - start
        except (OSError, ValueError):
            pass
        time.sleep(1.0)
    raise RuntimeError("tensorboard did not load every step in time")


# -- phase 3: measure ----------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest-rank."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summarize(values: list[float]) -> dict[str, float]:
    """p50/p95/max/mean of milliseconds, rounded."""
    return {
        "n": len(values),
        "p50_ms": round(statistics.median(values), 1),
        "p95_ms": round(percentile(values, 95), 1),
        "max_ms": round(max(values), 1),
        "mean_ms": round(statistics.fmean(values), 1),
    }


def route_urls(url: str, runs: int) -> dict[str, list[str]]:
    """The data requests the view makes for every run, grouped by route."""
    out: dict[str, list[str]] = {"runs": [f"{url}{ROUTE_PREFIX}/runs"], "series": [], "json": []}
    for i in range(runs):
        run = run_name(i)
        for tag in (
            metadata.TAG_TIERS,
            metadata.TAG_READINGS,
            metadata.TAG_PAGES,
            metadata.TAG_TIMING,
        ):
            query = urllib.parse.urlencode({"run": run, "tag": tag, "points": CHART_POINTS})
            out["series"].append(f"{url}{ROUTE_PREFIX}/series?{query}")
        for tag in (
            metadata.TAG_RUN_INFO,
            metadata.TAG_PLACEMENT,
            metadata.TAG_ESTIMATE,
            metadata.TAG_CONFIG_EVENT,
        ):
            query = urllib.parse.urlencode({"run": run, "tag": tag})
            out["json"].append(f"{url}{ROUTE_PREFIX}/json?{query}")
    return out


def measure_routes(url: str, runs: int, repeats: int) -> dict[str, Any]:
    """Latency of each data route: the first (cold) request of each URL, then warm repeats."""
    urls = route_urls(url, runs)
    cold: dict[str, list[float]] = {}
    warm: dict[str, list[float]] = {}
    for route, group in urls.items():
        cold[route] = [get(u)[0] for u in group]
    for route, group in urls.items():
        warm[route] = [get(u)[0] for _ in range(repeats) for u in group]
    full_query = urllib.parse.urlencode(
        {"run": run_name(0), "tag": metadata.TAG_TIERS, "points": 0, "format": "csv"}
    )
    full_ms, full_body = get(f"{url}{ROUTE_PREFIX}/series?{full_query}")
    all_warm = [v for values in warm.values() for v in values]
    return {
        "cold": {route: summarize(v) for route, v in cold.items()},
        "warm": {route: summarize(v) for route, v in warm.items()},
        "warm_all_routes": summarize(all_warm),
        "export_full_csv_one_run_ms": round(full_ms, 1),
        "export_full_csv_bytes": len(full_body),
    }


# Milliseconds from the top page's navigation to the view's marks: render() called
# (TensorBoard's own page and the plugin iframe loaded) and the first meaningful paint.
FIRST_PAINT_JS = """
() => {
  const frame = [...document.querySelectorAll('iframe')]
    .find((f) => f.src.includes('plugin_entry.html?name=memory_hierarchy'));
  const win = frame && frame.contentWindow;
  const at = (name) => {
    const mark = win && win.performance.getEntriesByName(name)[0];
    return mark ? win.performance.timeOrigin + mark.startTime - performance.timeOrigin : null;
  };
  const paint = at('mh-first-meaningful-paint');
  return paint === null ? null : {paint, renderStart: at('mh-render-start')};
}
"""


def measure_paint(url: str, runs: int, repeats: int) -> dict[str, Any]:
    """First meaningful paint of the tab in headless Chromium, milliseconds from navigation."""
    from playwright.sync_api import sync_playwright

    times: list[float] = []
    starts: list[float] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic"],
        )
        try:
            for _ in range(repeats):
                context = browser.new_context(viewport={"width": 1280, "height": 1400})
                page = context.new_page()
                page.goto(f"{url}/#memory_hierarchy")
                page.wait_for_function(FIRST_PAINT_JS, timeout=300_000, polling=50)
                marks = page.evaluate(FIRST_PAINT_JS)
                times.append(float(marks["paint"]))
                starts.append(float(marks["renderStart"]))
                drawn = (
                    page.frame_locator(PLUGIN_FRAME)
                    .locator("section.mh-run .mh-chart[data-points]")
                    .count()
                )
                if drawn != runs:
                    raise RuntimeError(f"{drawn} of {runs} tier charts drawn")
                context.close()
        finally:
            browser.close()
    return {
        "runs_selected": runs,
        "first_paint_ms": [round(t, 1) for t in times],
        "first_load_ms": round(times[0], 1),
        "median_ms": round(statistics.median(times), 1),
        "max_ms": round(max(times), 1),
        "render_start_ms": [round(t, 1) for t in starts],
        "plugin_only_ms": [round(t - r, 1) for t, r in zip(times, starts)],
        "note": "render_start_ms: TensorBoard's own page and the plugin iframe loading "
        "until the view's render() runs; plugin_only_ms: from render() to the paint",
    }


def machine() -> dict[str, Any]:
    """nproc, RAM and CPU model of this machine."""
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "nproc": os.cpu_count(),
        "ram_bytes": ram,
        "ram_gib": round(ram / GIB, 1),
        "cpu_model": model,
        "python": platform.python_version(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    """Generate (or reuse) the dataset, serve it, measure, write bench/results/view.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--distinct", type=int, default=2)
    parser.add_argument("--logdir", type=Path, default=Path("/tmp/mh_bench_logdir"))
    parser.add_argument("--regenerate", action="store_true")
    parser.add_argument("--generate-only", action="store_true")
    parser.add_argument("--repeats", type=int, default=5, help="warm requests per URL")
    parser.add_argument("--paint-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    manifest_path = args.logdir / "bench_manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    if (
        args.regenerate
        or manifest is None
        or (manifest["runs"], manifest["steps"], manifest["distinct_runs"])
        != (args.runs, args.steps, args.distinct)
    ):
        print(f"generating {args.runs} runs x {args.steps} steps in {args.logdir} ...", flush=True)
        manifest = generate(args.logdir, args.runs, args.steps, args.distinct)
    print(f"dataset: {json.dumps(manifest)}", flush=True)
    if args.generate_only:
        return

    log_path = args.logdir.parent / "mh_bench_tensorboard.log"
    load_before = machine()["load_average_1_5_15"]
    # Server 1: the tab, with empty server caches, then again warm.
    proc, url = start_tensorboard(args.logdir, log_path)
    try:
        load_seconds = wait_until_loaded(url, args.runs, args.steps)
        print(f"tensorboard at {url} loaded every step in {load_seconds:.1f} s", flush=True)
        paint_cold = measure_paint(url, args.runs, 1)
        print(f"first paint (cold server cache): {paint_cold}", flush=True)
        paint = measure_paint(url, args.runs, args.paint_repeats)
        print(f"first paint (warm server cache): {paint}", flush=True)
    finally:
        stop(proc)
    # Server 2: the routes alone, each URL once cold, then warm repeats.
    proc, url = start_tensorboard(args.logdir, log_path)
    try:
        wait_until_loaded(url, args.runs, args.steps)
        routes = measure_routes(url, args.runs, args.repeats)
        print(f"routes: {json.dumps(routes)}", flush=True)
    finally:
        stop(proc)

    p95 = routes["warm_all_routes"]["p95_ms"]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average_at_start": load_before,
        "dataset": manifest,
        "tensorboard": {
            "flags": ["--load_fast=true", f"--samples_per_plugin={metadata.PLUGIN_NAME}=0"],
            "load_every_step_seconds": round(load_seconds, 1),
        },
        "chart_points": CHART_POINTS,
        "routes": routes,
        "first_meaningful_paint": {
            "definition": "ms from navigation of the TensorBoard page until every selected "
            "run's tier charts have drawn (performance mark mh-first-meaningful-paint)",
            "cold_server_cache": paint_cold,
            "warm_server_cache": paint,
        },
        "goals": {
            "route_p95_ms": LATENCY_GOAL_MS,
            "route_p95_warm_met": p95 <= LATENCY_GOAL_MS,
            "first_paint_ms": PAINT_GOAL_MS,
            "first_paint_warm_met": paint["median_ms"] <= PAINT_GOAL_MS,
            "first_paint_cold_met": paint_cold["first_load_ms"] <= PAINT_GOAL_MS,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
