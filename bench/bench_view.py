"""Benchmark of the Memory Hierarchy View at scale: load, first paint and route latency.

Three scenarios (``--scenarios``, default all): 10 runs x 100,000 steps, 1 run x
1,000,000 steps, 200 runs x 2,000 steps. Each is timed in three phases:

1. **generate**: the runs' event files, exactly what :class:`tb_plugin.summary.SummaryWriter`
   writes (tiers, readings, pages and timing at every step; run_info, estimate, placement
   and a few config events), serialised from reused protos and written with TensorFlow's
   C++ TFRecord writer (SummaryWriter's pure-Python CRC is too slow for millions of
   summaries). ``distinct`` runs are written, the others are byte copies under other run
   names: the server loads and serves every copy as its own run.
2. **serve**: a real ``tensorboard`` (``--load_fast=true``,
   ``--samples_per_plugin=memory_hierarchy=0``), timed until every run's every step is
   loaded (``/runs`` reports ``max_step`` = steps - 1) and then until the plugin's
   precomputed levels hold every step (``/runs?levels=1``, ``levels_step``).
3. **measure**: the tab's first meaningful paint in headless Chromium (the performance
   mark ``mh-first-meaningful-paint``: the tier charts of every selected run in view have
   drawn), on the first visit and on later ones, with the main thread's long tasks; for
   10 x 100k, the data routes' latency on a second server (the first request of each URL,
   then warm repeats); for 1M steps, the every-step exports (streamed) with TensorBoard's
   memory.

Results go to ``bench/results/view.json`` with the date and the machine (nproc, RAM, CPU
model, load). Usage::

    .venv/bin/python bench/bench_view.py [--scenarios a,b] [--regenerate]

A logdir is reused when it already holds a complete dataset of the same shape (its
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

import numpy as np

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


def _json_proto(obj: dict[str, Any]) -> Any:
    from tensorboard.util import tensor_util

    text = json.dumps(obj, sort_keys=True).encode("utf-8")
    return tensor_util.make_tensor_proto(np.array(text, dtype=object))


def step_arrays(index: int, steps: int) -> dict[str, Any]:
    """Every step's values of the four per-step tags of distinct run ``index``, vectorised:
    tag -> float64 ``[steps, *shape]`` (NaN = not written)."""
    nan = np.nan
    scale = 1 + index
    s = np.arange(steps, dtype=np.float64)
    sine = np.sin(s / 500.0)
    device = (64 + 32 * sine) * scale * MIB + (np.arange(steps) % 97) * 4096
    host = (512 + 8 * sine) * scale * MIB
    nvme = (np.arange(steps) // 1000) * float(MIB)
    full = lambda v: np.full(steps, v, dtype=np.float64)  # noqa: E731
    tiers = np.stack(
        [
            np.stack(
                [
                    device,
                    full(256 * scale * MIB),
                    device + MIB,
                    device / 2,
                    device / 4,
                    full(0.0),
                    device / 4,
                ],
                axis=1,
            ),
            np.stack(
                [host, full(24.0 * GIB), host, full(nan), full(nan), host * 0.75, host * 0.25],
                axis=1,
            ),
            np.stack([nvme, full(nan), full(nan), full(nan), full(nan), nvme, full(nan)], axis=1),
        ],
        axis=1,
    )  # [N, 3, 7] in TIERS x TIER_COLUMNS order
    readings = np.stack(
        [device * 1.05, full(nan), full(nan), full(nan), host + 300 * MIB, nvme], axis=1
    )
    m8, m5, m3 = (np.arange(steps) % k for k in (8, 5, 3))
    pages = np.stack(
        [
            m5,
            m5 * MIB,
            m8,
            m8 * MIB,
            full(nan),
            full(nan),
            full(nan),
            full(nan),
            full(nan),
            m8,
            m3,
            0.001 * m3,
            full(nan),
        ],
        axis=1,
    ).astype(np.float64)  # PAGE_COLUMNS order
    timing = np.tile(np.array([0.25, 0.18, 0.08, 0.05, 0.02, 0.625]), (steps, 1))
    return {
        metadata.TAG_TIERS: tiers,
        metadata.TAG_READINGS: readings,
        metadata.TAG_PAGES: pages,
        metadata.TAG_TIMING: timing,
    }


def write_distinct_run(args: tuple[str, int, int]) -> float:
    """Write one run of ``steps`` steps; returns seconds taken.

    The events are exactly what :class:`tb_plugin.summary.SummaryWriter` writes (the same
    summary metadata, float64 ``tensor_content`` and json tensors, in step order), but
    serialised from reused protos and written through TensorFlow's C++ TFRecord writer
    (an event file is a TFRecord file): SummaryWriter's pure-Python CRC costs about
    0.5 ms per summary, too slow for a million steps.
    """
    logdir, index, steps = args
    import socket

    import tensorflow as tf
    from tensorboard.compat.proto import (
        event_pb2,
        summary_pb2,
        tensor_pb2,
        tensor_shape_pb2,
        types_pb2,
    )

    start = time.perf_counter()
    scale = 1 + index
    run_dir = os.path.join(logdir, run_name(index))
    os.makedirs(run_dir, exist_ok=True)
    base_wall = 1_700_000_000.0
    name = f"events.out.tfevents.{int(base_wall)}.{socket.gethostname()}.{os.getpid()}.0"
    writer = tf.io.TFRecordWriter(os.path.join(run_dir, name + ".memory_hierarchy"))
    writer.write(
        event_pb2.Event(wall_time=base_wall, file_version="brain.Event:2").SerializeToString()
    )

    def write_json(tag: str, step: int, obj: dict[str, Any], wall: float) -> None:
        value = summary_pb2.Summary.Value(tag=tag, tensor=_json_proto(obj))
        value.metadata.CopyFrom(metadata.create_summary_metadata(tag))
        event = event_pb2.Event(
            wall_time=wall, step=step, summary=summary_pb2.Summary(value=[value])
        )
        writer.write(event.SerializeToString())

    write_json(
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
        base_wall,
    )
    write_json(
        metadata.TAG_ESTIMATE,
        0,
        {
            "per_process": {
                "device_bytes": 96 * scale * MIB,
                "host_bytes": 700 * scale * MIB,
                "nvme_bytes": 0,
            }
        },
        base_wall,
    )
    write_json(
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
        base_wall,
    )
    arrays = step_arrays(index, steps)
    templates = {}  # tag -> (event, value) reused for every step
    for tag, arr in arrays.items():
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE)
        tensor.tensor_shape.dim.extend(
            tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in arr.shape[1:]
        )
        value = summary_pb2.Summary.Value(tag=tag, tensor=tensor)
        value.metadata.CopyFrom(metadata.create_summary_metadata(tag))
        templates[tag] = event_pb2.Event(summary=summary_pb2.Summary(value=[value]))
    rows = {tag: np.ascontiguousarray(arr).reshape(steps, -1) for tag, arr in arrays.items()}
    for step in range(steps):
        wall = base_wall + 0.25 * step
        for tag, event in templates.items():
            event.step = step
            event.wall_time = wall
            event.summary.value[0].tensor.tensor_content = rows[tag][step].tobytes()
            writer.write(event.SerializeToString())
        if step and step % CONFIG_EVENT_EVERY == 0:
            write_json(
                metadata.TAG_CONFIG_EVENT,
                step,
                {
                    "key": "prefetch_depth",
                    "old": step // CONFIG_EVENT_EVERY,
                    "new": 1 + step // CONFIG_EVENT_EVERY,
                },
                wall,
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


PER_STEP_TAGS = (
    metadata.TAG_TIERS,
    metadata.TAG_READINGS,
    metadata.TAG_PAGES,
    metadata.TAG_TIMING,
)


def wait_until(url: str, runs: int, steps: int, field: str) -> float:
    """Poll ``/runs?levels=1`` until every run's per-step tags report ``field``
    (``max_step``: TensorBoard loaded every step; ``levels_step``: the plugin's levels
    hold every step) = steps - 1; returns seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < SERVER_LOAD_TIMEOUT:
        try:
            _ms, body = get(f"{url}{ROUTE_PREFIX}/runs?levels=1")
            listing = json.loads(body)["runs"]
            done = [
                r
                for r in listing
                if all(r["tags"].get(t, {}).get(field) == steps - 1 for t in PER_STEP_TAGS)
            ]
            if len(done) == runs:
                return time.perf_counter() - start
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{field} did not reach every step in time")


def wait_until_loaded(url: str, runs: int, steps: int) -> tuple[float, float]:
    """(seconds until TensorBoard loaded every step, further seconds until the plugin's
    precomputed levels held every step too)."""
    loaded = wait_until(url, runs, steps, "max_step")
    indexed = wait_until(url, runs, steps, "levels_step")
    return loaded, indexed


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
  if (paint === null) return null;
  // When TensorBoard's page created the plugin's iframe (its navigation start).
  const handover = win.performance.timeOrigin - performance.timeOrigin;
  return {paint, renderStart: at('mh-render-start'), handover};
}
"""

# TensorBoard's page alone: milliseconds from navigation until it creates the plugin's
# iframe (the plugin's index.js is refused, so none of the plugin's code runs), and its
# own load event.
HANDOVER_JS = """
() => {
  const frame = [...document.querySelectorAll('iframe')]
    .find((f) => f.src.includes('plugin_entry.html?name=memory_hierarchy'));
  const win = frame && frame.contentWindow;
  const nav = performance.getEntriesByType('navigation')[0];
  if (!win || !nav || !nav.loadEventEnd) return null;
  return {handover: win.performance.timeOrigin - performance.timeOrigin, load: nav.loadEventEnd};
}
"""


# Collects long tasks (> 50 ms on the main thread) in every frame from its start.
LONG_TASKS_INIT = """
window.__mhLongTasks = [];
try {
  new PerformanceObserver((list) => {
    for (const e of list.getEntries()) {
      window.__mhLongTasks.push({start: e.startTime, duration: e.duration});
    }
  }).observe({type: 'longtask', buffered: true});
} catch (e) {}
"""
SETTLE_SECONDS = 2.0  # long tasks are also counted this long after the first paint


def measure_paint(url: str, runs: int, repeats: int) -> dict[str, Any]:
    """First meaningful paint of the tab in headless Chromium, milliseconds from navigation,
    and the main thread's long tasks from navigation until SETTLE_SECONDS after it."""
    from playwright.sync_api import sync_playwright

    times: list[float] = []
    starts: list[float] = []
    handovers: list[float] = []
    drawn_runs: list[int] = []
    longest_plugin: list[float] = []
    longest_page: list[float] = []
    over_200: list[int] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic"],
        )
        try:
            for _ in range(repeats):
                context = browser.new_context(viewport={"width": 1280, "height": 1400})
                context.add_init_script(LONG_TASKS_INIT)
                page = context.new_page()
                page.goto(f"{url}/#memory_hierarchy")
                page.wait_for_function(FIRST_PAINT_JS, timeout=300_000, polling=50)
                marks = page.evaluate(FIRST_PAINT_JS)
                times.append(float(marks["paint"]))
                starts.append(float(marks["renderStart"]))
                handovers.append(float(marks["handover"]))
                time.sleep(SETTLE_SECONDS)
                frame = next(f for f in page.frames if "name=memory_hierarchy" in f.url)
                expected = int(frame.evaluate("document.body.dataset.firstPaintRuns || '0'"))
                drawn = (
                    page.frame_locator(PLUGIN_FRAME)
                    .locator("section.mh-run .mh-chart[data-points]")
                    .count()
                )
                if expected < 1 or drawn < expected:
                    raise RuntimeError(f"{drawn} tier charts drawn, {expected} expected")
                drawn_runs.append(drawn)
                plugin_tasks = frame.evaluate("window.__mhLongTasks || []")
                page_tasks = page.evaluate("window.__mhLongTasks || []")
                everything = [t["duration"] for t in plugin_tasks + page_tasks]
                longest_plugin.append(max((t["duration"] for t in plugin_tasks), default=0.0))
                longest_page.append(max((t["duration"] for t in page_tasks), default=0.0))
                over_200.append(sum(1 for d in everything if d > 200.0))
                context.close()
        finally:
            browser.close()
    return {
        "runs_listed": runs,
        "first_paint_ms": [round(t, 1) for t in times],
        "first_load_ms": round(times[0], 1),
        "median_ms": round(statistics.median(times), 1),
        "max_ms": round(max(times), 1),
        "tensorboard_handover_ms": [round(t, 1) for t in handovers],
        "render_start_ms": [round(t, 1) for t in starts],
        "plugin_only_ms": [round(t - r, 1) for t, r in zip(times, starts)],
        "plugin_part_ms": [round(t - h, 1) for t, h in zip(times, handovers)],
        "runs_drawn_at_first_paint": drawn_runs,
        "longest_task_ms_plugin_frame": [round(t, 1) for t in longest_plugin],
        "longest_task_ms_tensorboard_page": [round(t, 1) for t in longest_page],
        "long_tasks_over_200ms": over_200,
        "note": "tensorboard_handover_ms: TensorBoard's own page until it creates the "
        "plugin's iframe; plugin_part_ms: from then to the paint (the plugin's page, "
        "index.js, render() and its data); render_start_ms: until the view's render() "
        "runs; plugin_only_ms: from render() to the paint. "
        "Long tasks (PerformanceObserver 'longtask', both frames share the main thread) "
        f"from navigation to {SETTLE_SECONDS} s after the paint",
    }


def measure_tensorboard_alone(url: str, repeats: int) -> dict[str, Any]:
    """TensorBoard's own page on the same server with the plugin's code refused (its
    index.js aborted): ms from navigation until TensorBoard creates the plugin's iframe
    (where the plugin's part of a first paint starts) and until its load event. The floor
    under the first paint that no plugin change can lower."""
    from playwright.sync_api import sync_playwright

    handovers: list[float] = []
    loads: list[float] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic"],
        )
        try:
            for _ in range(repeats):
                context = browser.new_context(viewport={"width": 1280, "height": 1400})
                context.route(f"**{ROUTE_PREFIX}/index.js", lambda route: route.abort())
                page = context.new_page()
                page.goto(f"{url}/#memory_hierarchy")
                page.wait_for_function(HANDOVER_JS, timeout=300_000, polling=50)
                marks = page.evaluate(HANDOVER_JS)
                handovers.append(float(marks["handover"]))
                loads.append(float(marks["load"]))
                context.close()
        finally:
            browser.close()
    return {
        "handover_ms": [round(t, 1) for t in handovers],
        "median_handover_ms": round(statistics.median(handovers), 1),
        "load_event_ms": [round(t, 1) for t in loads],
        "note": "TensorBoard's page with the plugin's index.js refused: navigation until "
        "it creates the plugin's iframe (handover), and its load event",
    }


def measure_export(url: str, proc: subprocess.Popen, run: str) -> dict[str, Any]:
    """Every-step exports (CSV and JSON, gzip as a browser asks) of one run's tiers: time,
    bytes, and TensorBoard's Python process memory (RSS) before and at its peak during."""
    import threading

    import psutil

    tb = psutil.Process(proc.pid)
    out: dict[str, Any] = {"rss_before_bytes": tb.memory_info().rss}
    for fmt in ("csv", "json"):
        query = urllib.parse.urlencode(
            {"run": run, "tag": metadata.TAG_TIERS, "points": 0, "format": fmt}
        )
        peak = [tb.memory_info().rss]
        done = threading.Event()

        def sample(peak: list[int] = peak, done: threading.Event = done) -> None:
            while not done.is_set():
                peak[0] = max(peak[0], tb.memory_info().rss)
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        request = urllib.request.Request(
            f"{url}{ROUTE_PREFIX}/series?{query}", headers={"Accept-Encoding": "gzip"}
        )
        start = time.perf_counter()
        first_byte = None
        size = 0
        with urllib.request.urlopen(request, timeout=900) as resp:
            while True:
                chunk = resp.read(1 << 16)
                if first_byte is None:
                    first_byte = time.perf_counter() - start
                if not chunk:
                    break
                size += len(chunk)
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
        out[fmt] = {
            "seconds": round(seconds, 2),
            "first_byte_seconds": round(first_byte or 0.0, 3),
            "gzipped_bytes": size,
            "rss_peak_bytes": peak[0],
            "rss_growth_bytes": peak[0] - out["rss_before_bytes"],
        }
    return out


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


SCENARIOS = {
    # name: (runs, steps, distinct runs written, default logdir)
    "10_runs_100k_steps": (10, 100_000, 2, "/tmp/mh_bench_logdir"),
    "1_run_1M_steps": (1, 1_000_000, 1, "/tmp/mh_bench_1m"),
    "200_runs_2k_steps": (200, 2_000, 2, "/tmp/mh_bench_200"),
}
FIRST_CHART_GOAL_MS = 2000.0  # 1 run x 1M steps and 200 runs x 2k steps
LONG_TASK_GOAL_MS = 200.0


def dataset(name: str, regenerate: bool) -> tuple[Path, dict[str, Any]]:
    """The scenario's logdir (generated unless a complete one of the same shape exists)."""
    runs, steps, distinct, logdir = SCENARIOS[name]
    logdir = Path(logdir)
    manifest_path = logdir / "bench_manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    if (
        regenerate
        or manifest is None
        or (manifest["runs"], manifest["steps"], manifest["distinct_runs"])
        != (runs, steps, distinct)
    ):
        print(f"generating {runs} runs x {steps} steps in {logdir} ...", flush=True)
        manifest = generate(logdir, runs, steps, distinct)
    print(f"dataset {name}: {json.dumps(manifest)}", flush=True)
    return logdir, manifest


def serve_and_paint(
    name: str, logdir: Path, paint_repeats: int, export_run: str | None = None
) -> dict[str, Any]:
    """One server: load, levels, first paint cold (first visit) and warm; optionally the
    every-step exports of one run."""
    runs, steps, _distinct, _dir = SCENARIOS[name]
    log_path = logdir.parent / f"mh_bench_tensorboard_{name}.log"
    proc, url = start_tensorboard(logdir, log_path)
    try:
        loaded, indexed = wait_until_loaded(url, runs, steps)
        print(f"{name}: loaded in {loaded:.1f} s, levels {indexed:.1f} s later", flush=True)
        cold = measure_paint(url, runs, 1)
        print(f"{name}: first paint (first visit): {cold}", flush=True)
        warm = measure_paint(url, runs, paint_repeats)
        print(f"{name}: first paint (again): {warm}", flush=True)
        alone = measure_tensorboard_alone(url, paint_repeats)
        print(f"{name}: TensorBoard's page alone: {alone}", flush=True)
        exports = measure_export(url, proc, export_run) if export_run else None
        if exports:
            print(f"{name}: exports: {exports}", flush=True)
    finally:
        stop(proc)
    return {
        "load_every_step_seconds": round(loaded, 1),
        "levels_built_seconds_after_load": round(indexed, 1),
        "first_paint_first_visit": cold,
        "first_paint_again": warm,
        "tensorboard_page_alone": alone,
        **({"export_every_step": exports} if exports else {}),
    }


PAINT_DEFINITION = (
    "ms from navigation of the TensorBoard page until the tier charts of every selected run "
    "in view have drawn (performance mark mh-first-meaningful-paint). 'first visit': the "
    "first browser visit to a server that has loaded every step (and whose plugin has built "
    "its levels); 'again': later visits (new browser contexts). The view selects the 10 "
    "most recent runs by default and fills panels as they scroll into view. "
    "'plugin_only': from the view's render() (TensorBoard's own page and the plugin iframe "
    "loaded) to the paint. 'plugin_part': from TensorBoard's page creating the plugin's "
    "iframe to the paint: everything the plugin serves and runs (its page, index.js, "
    "render() and data). 'tensorboard_page_alone': TensorBoard's own page on the same "
    "server with the plugin's index.js refused, until it creates the plugin's iframe: the "
    "floor under the first paint that the plugin cannot lower (the goal of 1.5 s from "
    "navigation is below it on this machine)."
)


def goals(scenarios: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, met or not, from the scenarios' figures (None: not measured)."""

    def get(name: str, which: str, key: str) -> Any:
        entry = scenarios.get(name)
        return entry[which][key] if entry else None

    def longest(name: str, frames: tuple[str, ...]) -> float | None:
        entry = scenarios.get(name)
        if not entry:
            return None
        return max(
            t
            for which in ("first_paint_first_visit", "first_paint_again")
            for frame in frames
            for t in entry[which][f"longest_task_ms_{frame}"]
        )

    met = lambda v, goal: None if v is None else v <= goal  # noqa: E731
    both = ("plugin_frame", "tensorboard_page")
    main, one_m, many = "10_runs_100k_steps", "1_run_1M_steps", "200_runs_2k_steps"
    routes = scenarios.get(main, {}).get("routes")
    cold_p95 = routes["cold"]["series"]["p95_ms"] if routes else None
    out: dict[str, Any] = {
        "first_paint_goal_ms": PAINT_GOAL_MS,
        "first_chart_goal_ms": FIRST_CHART_GOAL_MS,
        "long_task_goal_ms": LONG_TASK_GOAL_MS,
        "series_p95_cold_goal_ms": LATENCY_GOAL_MS,
        "series_p95_cold_ms": cold_p95,
        "series_p95_cold_met": met(cold_p95, LATENCY_GOAL_MS),
    }
    for label, name, which, goal in (
        ("10x100k_first_paint_first_visit", main, "first_paint_first_visit", PAINT_GOAL_MS),
        ("10x100k_first_paint_again", main, "first_paint_again", PAINT_GOAL_MS),
        ("1x1M_first_chart_first_visit", one_m, "first_paint_first_visit", FIRST_CHART_GOAL_MS),
        ("1x1M_first_chart_again", one_m, "first_paint_again", FIRST_CHART_GOAL_MS),
        ("200x2k_first_chart_first_visit", many, "first_paint_first_visit", FIRST_CHART_GOAL_MS),
        ("200x2k_first_chart_again", many, "first_paint_again", FIRST_CHART_GOAL_MS),
    ):
        total = get(name, which, "median_ms")
        plugin = get(name, which, "plugin_only_ms")
        plugin = statistics.median(plugin) if plugin else None
        out[f"{label}_ms"] = total
        out[f"{label}_met"] = met(total, goal)
        out[f"{label}_plugin_only_ms"] = plugin
        out[f"{label}_plugin_only_met"] = met(plugin, goal)
        part = get(name, which, "plugin_part_ms") if name in scenarios else None
        part = statistics.median(part) if part else None
        out[f"{label}_plugin_part_ms"] = part
        out[f"{label}_plugin_part_met"] = met(part, goal)
        alone = scenarios.get(name, {}).get("tensorboard_page_alone")
        out[f"{label}_tensorboard_page_alone_handover_ms"] = (
            alone["median_handover_ms"] if alone else None
        )
    out["200x2k_longest_task_ms"] = longest(many, both)
    out["200x2k_longest_task_met"] = met(out["200x2k_longest_task_ms"], LONG_TASK_GOAL_MS)
    out["200x2k_longest_task_ms_plugin_frame"] = longest(many, ("plugin_frame",))
    out["200x2k_longest_task_plugin_frame_met"] = met(
        out["200x2k_longest_task_ms_plugin_frame"], LONG_TASK_GOAL_MS
    )
    return out


def main() -> None:
    """Generate (or reuse) the datasets, serve them, measure, write bench/results/view.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--regenerate", action="store_true")
    parser.add_argument("--generate-only", action="store_true")
    parser.add_argument("--repeats", type=int, default=5, help="warm requests per URL")
    parser.add_argument("--paint-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--goals-only",
        action="store_true",
        help="recompute the goals of an existing results file from its scenarios",
    )
    args = parser.parse_args()
    if args.goals_only:
        result = json.loads(args.out.read_text())
        result["first_meaningful_paint_definition"] = PAINT_DEFINITION
        result["goals"] = goals(result["scenarios"])
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["goals"], indent=2))
        return
    names = [n for n in args.scenarios.split(",") if n]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {list(SCENARIOS)}")
    data = {n: dataset(n, args.regenerate) for n in names}
    if args.generate_only:
        return
    load_before = machine()["load_average_1_5_15"]
    scenarios: dict[str, Any] = {}
    routes = None
    for name in names:
        logdir, manifest = data[name]
        export_run = run_name(0) if name == "1_run_1M_steps" else None
        result = serve_and_paint(name, logdir, args.paint_repeats, export_run)
        scenarios[name] = {"dataset": manifest, **result}
        if name == "10_runs_100k_steps":
            # A second server: the routes alone, each URL once cold, then warm repeats.
            runs, steps, _d, _l = SCENARIOS[name]
            log_path = logdir.parent / "mh_bench_tensorboard_routes.log"
            proc, url = start_tensorboard(logdir, log_path)
            try:
                wait_until_loaded(url, runs, steps)
                routes = measure_routes(url, runs, args.repeats)
                print(f"routes: {json.dumps(routes)}", flush=True)
            finally:
                stop(proc)
            scenarios[name]["routes"] = routes

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average_at_start": load_before,
        "note": "The machine (2 cores) was shared with other sessions running TensorFlow "
        "while this ran: figures were taken under load (see load averages).",
        "tensorboard": {
            "flags": ["--load_fast=true", f"--samples_per_plugin={metadata.PLUGIN_NAME}=0"],
        },
        "chart_points": CHART_POINTS,
        "first_meaningful_paint_definition": PAINT_DEFINITION,
        "scenarios": scenarios,
        "goals": goals(scenarios),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
