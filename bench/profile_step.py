"""Per-thread timeline of one stage-3 trial of ``bench_max_model.py``: where a step's
seconds go, thread by thread.

Runs one trial in this process (``bench_max_model.run_trial``, the same spec as the
benchmark's ``trial``: the same budgets and ZeroConfig) with the runtime's host-side
functions wrapped (:data:`SPANS`) so each call records ``(thread, label, start, end)``
(``time.perf_counter`` seconds), then reports, for one step (default the last), per
thread the seconds each label covered (the union of its calls, nested labels counted on
their own) against the step's wall time. The I/O threads' ``pread``/``pwrite`` spans give
the disk's busy time; the update thread's ``store.update`` minus ``adam`` its waits.

Usage (the 1B-parameter run, k = 22, takes about 13 minutes and 18 GB of RSS)::

    .venv/bin/python bench/profile_step.py --k 22 --batch 2 --out /tmp/tl.json
    .venv/bin/python bench/profile_step.py --report /tmp/tl.json [--step 1]

The other options are ``bench_max_model.py``'s (defaults: ``--engine units
--offload-optimizer nvme --pool-device-fraction 1.0``, the committed run's). Only
a tool for finding the critical path; its figures are not results (the wrappers add
about a microsecond per call).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: ``(module, attribute path, label)``: the host functions whose calls are recorded.
SPANS = (
    ("zero_runtime.optim.backward_update", "BackwardShardUpdate._host_enqueue", "enqueue"),
    ("zero_runtime.optim.backward_update", "_UpdateQueue.admit", "admit"),
    ("zero_runtime.optim.backward_update", "BackwardShardUpdate._host_update", "host_update"),
    ("zero_runtime.optim.backward_update", "BackwardShardUpdate._host_finish", "finish"),
    ("zero_runtime.optim.shard_update", "ShardedUpdate._zero3_read_shards", "read_params"),
    ("zero_runtime.optim.shard_update", "ShardedUpdate._zero3_write_shards", "write_params"),
    ("zero_runtime.optim.nvme_state", "NvmeOptimizerState.update", "store.update"),
    ("zero_runtime.optim.nvme_state", "NvmeOptimizerState.mark_updated", "store.mark"),
    ("zero_runtime.optim.state_journal", "StateTransactions._shadow", "store.shadow"),
    ("zero_runtime.optim.kernels", "adam_update", "adam"),
    ("zero_runtime.memory.pool", "PagedBufferPool.acquire", "pool.acquire"),
    ("zero_runtime.memory.pool", "PagedBufferPool.acquire_pages", "pool.acquire_pages"),
    ("zero_runtime.memory.pool", "PagedBufferPool.prefetch", "pool.prefetch"),
    ("zero_runtime.memory.pool", "PagedBufferPool.evict", "pool.evict"),
    ("zero_runtime.memory.pool", "PagedBufferPool.fork", "pool.fork"),
    ("zero_runtime.stage3.unit_comm", "_read_shards", "read_shards"),
    ("zero_runtime.stage3.tiling", "_read_tile", "read_tile"),
    ("zero_runtime.sharded_variable", "ShardedVariable.write_shard", "var.write_shard"),
    ("zero_runtime.sharded_variable", "ShardedVariable.read_shard_into", "var.read_shard"),
    ("zero_runtime.optim.transaction", "StepJournals.record_params", "journal_params"),
    ("zero_runtime.memory.placement", "Placement.settle", "place.settle"),
    ("zero_runtime.memory.placement", "Placement.victims", "place.victims"),
    ("zero_runtime.memory.io", "NvmeFile.pread_into", "pread"),
    ("zero_runtime.memory.io", "NvmeFile.pwrite", "pwrite"),
)


class Recorder:
    """Spans of the wrapped calls: ``(thread name, label, start, end)``, seconds."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] = []
        self.steps: list[tuple[float, float]] = []
        self.cpu: list[dict[str, float]] = []  # per step: CPU seconds by thread name
        self.store_files: set[str] = set()  # the NVMe store pools' slab files
        self._lock = threading.Lock()

    def wrap(self, fn, label: str):
        """``fn`` recording a span per call under ``label``."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                with self._lock:
                    self.spans.append((threading.current_thread().name, label, start, end))

        return timed

    def install(self) -> None:
        """Wrap every function of :data:`SPANS` (before the model's graph is traced); the
        NVMe files' page I/O is labelled by pool (``.store``: the NVMe optimizer-state
        store's, ``.params``: the others)."""
        for module, path, label in SPANS:
            owner = importlib.import_module(module)
            *parents, name = path.split(".")
            for part in parents:
                owner = getattr(owner, part)
            fn = getattr(owner, name)
            wrapped = self.wrap_io(fn, label) if label in ("pread", "pwrite") else None
            setattr(owner, name, wrapped or self.wrap(fn, label))
        from zero_runtime.optim.nvme_state import NvmeOptimizerState

        init = NvmeOptimizerState.__init__

        def store_init(store, *args, **kwargs):
            init(store, *args, **kwargs)
            self.store_files.add(store.pool.nvme_file)

        NvmeOptimizerState.__init__ = store_init

    def wrap_io(self, fn, label: str):
        """``NvmeFile.pread_into``/``pwrite`` recording ``label.store`` or
        ``label.params`` by the file's pool."""
        store, params = self.wrap(fn, f"{label}.store"), self.wrap(fn, f"{label}.params")

        @functools.wraps(fn)
        def timed(file, *args, **kwargs):
            return (store if file.path in self.store_files else params)(file, *args, **kwargs)

        return timed

    def callback(self):
        """A Keras callback recording each training step's ``(start, end)``."""
        import keras

        marks: dict = {}

        def begin(batch, logs) -> None:
            marks["cpu"] = thread_cpu()
            marks["t"] = time.perf_counter()

        def end(batch, logs) -> None:
            self.steps.append((marks["t"], time.perf_counter()))
            after = thread_cpu()
            used: dict[str, float] = collections.defaultdict(float)
            for tid, (name, seconds) in after.items():
                used[name] += seconds - marks["cpu"].get(tid, (name, 0.0))[1]
            self.cpu.append(dict(used))

        return keras.callbacks.LambdaCallback(on_train_batch_begin=begin, on_train_batch_end=end)


class PySampler:
    """Samples every Python thread's stack ``hz`` times a second, weighting each sample
    by the CPU seconds its thread used since the previous one (``/proc/self/task/*/schedstat``),
    so a thread blocked in a read or a lock counts nothing and the TensorFlow executor
    threads running the runtime's ``py_function`` hosts are seen like any other.

    Records ``(t, thread name, stack id, cpu seconds)``; ``stacks[id]`` is the stack, outermost
    first, as ``"file:function"`` strings (the line left out so a function adds up).
    """

    def __init__(self, hz: float) -> None:
        self.period = 1.0 / hz
        self.samples: list[tuple[float, str, int, float]] = []
        self.stacks: list[tuple[str, ...]] = []
        self._ids: dict[tuple[str, ...], int] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="py-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.period):
            now = time.perf_counter()
            threads = {t.ident: t for t in threading.enumerate()}
            frames = sys._current_frames()  # noqa: SLF001
            used_by: dict[int, float] = {}
            # Every known thread's clock moves on each tick, in Python or not, so a
            # TensorFlow thread's native op time is not charged to its next Python frame.
            # Read from /proc by kernel thread id: a thread that has ended gives an
            # OSError there (pthread_getcpuclockid on an ended thread's id crashed).
            for ident, t in threads.items():
                nid = getattr(t, "native_id", None)
                if ident == me or nid is None:
                    continue
                try:
                    with open(f"/proc/self/task/{nid}/schedstat") as f:
                        cpu = int(f.read().split()[0]) / 1e9  # ns on a CPU
                except (OSError, ValueError, IndexError):
                    continue
                used_by[ident] = cpu - self._last.get(ident, cpu)
                self._last[ident] = cpu
            for ident, frame in frames.items():
                used = used_by.get(ident, 0.0)
                if used <= 0:
                    continue
                stack = []
                while frame is not None:
                    code = frame.f_code
                    stack.append(f"{Path(code.co_filename).name}:{code.co_name}")
                    frame = frame.f_back
                key = tuple(reversed(stack))
                sid = self._ids.setdefault(key, len(self.stacks))
                if sid == len(self.stacks):
                    self.stacks.append(key)
                self.samples.append((now, threads[ident].name, sid, used))


def py_report(data: dict, step: int, top: int = 25) -> str:
    """The sampled Python CPU seconds within step ``step``, by thread kind: per function,
    self (the innermost frame) and inclusive (anywhere on the stack, once per sample)."""
    if not data.get("py_samples"):
        return ""
    lo, hi = data["steps"][step]
    stacks = data["py_stacks"]
    self_s: dict = collections.defaultdict(collections.Counter)
    incl: dict = collections.defaultdict(collections.Counter)
    for t, name, sid, used in data["py_samples"]:
        if not lo <= t <= hi:
            continue
        kind = _thread_kind(name)
        stack = stacks[sid]
        self_s[kind][stack[-1]] += used
        for fn in set(stack):
            incl[kind][fn] += used
    lines = [f"  Python CPU seconds sampled (step {step}), by thread kind:"]
    for kind in sorted(self_s, key=lambda k: -sum(self_s[k].values())):
        lines.append(f"  {kind}: {sum(self_s[kind].values()):.2f} s")
        lines.append("    self:")
        for fn, sec in self_s[kind].most_common(top):
            lines.append(f"      {sec:7.2f}  {fn}")
        lines.append("    inclusive:")
        for fn, sec in incl[kind].most_common(top):
            lines.append(f"      {sec:7.2f}  {fn}")
    return "\n".join(lines)


def name_os_threads() -> None:
    """Give every Python thread started from now on its Python name as its kernel name
    (``prctl(PR_SET_NAME)``, 15 bytes). Without it a thread keeps the name of the thread
    that started it: the pools' I/O threads, started from a TensorFlow executor thread,
    show as ``tf_Compute`` in ``/proc/self/task/*/comm`` (:func:`thread_cpu`) and perf."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    bootstrap = threading.Thread._bootstrap_inner  # noqa: SLF001

    def named(thread) -> None:
        libc.prctl(15, thread.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        bootstrap(thread)

    threading.Thread._bootstrap_inner = named  # noqa: SLF001


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every thread of this process so far, by thread id,
    with the thread's name as the kernel knows it (``/proc/self/task/*/comm``: Python
    threads' names, TensorFlow's own threads' names), numbers stripped so that a pool of
    threads adds up under one name."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip().rstrip("0123456789_-")
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (name or "?", (int(fields[11]) + int(fields[12])) / tick)
    return out


def _union(intervals) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def report(data: dict, step: int) -> str:
    """Per thread, per label: seconds covered within step ``step`` (clipped to it), and
    each thread's busy seconds (any label); the step's wall seconds first."""
    lo, hi = data["steps"][step]
    per: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for thread, label, s, e in data["spans"]:
        s, e = max(s, lo), min(e, hi)
        if e > s:
            per[_thread_kind(thread)][label].append((s, e))
    lines = [f"step {step}: {hi - lo:.2f} s wall"]
    if data.get("cpu"):
        cpu = data["cpu"][step]
        lines.append(f"  CPU seconds by thread (all: {sum(cpu.values()):.1f}):")
        for name, sec in sorted(cpu.items(), key=lambda kv: -kv[1]):
            if sec >= 0.05:
                lines.append(f"    {name:20s} {sec:7.2f}")
    for thread in sorted(per):
        labels = per[thread]
        busy = _union([iv for ivs in labels.values() for iv in ivs])
        lines.append(f"  {thread}: any {busy:.2f} s")
        for label, ivs in sorted(labels.items(), key=lambda kv: -_union(kv[1])):
            lines.append(f"    {label:20s} {_union(ivs):7.2f} s  {len(ivs):6d} calls")
    return "\n".join(lines)


def _thread_kind(name: str) -> str:
    """Threads grouped by role: the pools' I/O threads and TensorFlow's executors each
    merged (their numbering is not stable)."""
    for prefix, kind in (("zr-io", "io threads"), ("zr-wb", "store write-behind")):
        if name.startswith(prefix):
            return kind
    if name.startswith("zero3-update"):
        return name.rsplit("_", 1)[0]
    if name.startswith("ThreadPoolExecutor") or name.startswith("Dummy"):
        return "tf executors"
    return name


def main() -> None:
    """Run the trial and write the spans (``--out``), or report a file (``--report``)."""
    import bench_max_model as bm

    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        parents=[bm.parser()],
        add_help=False,
        conflict_handler="resolve",
    )
    ap.add_argument("--k", type=int, default=22, help="family member (bench_max_model)")
    ap.add_argument("--out", default="/tmp/profile_step.json")
    ap.add_argument("--report", help="a file written by --out: print its report")
    ap.add_argument("--step", type=int, default=-1, help="the step reported")
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=0.0,
        help="sys.setswitchinterval for the run, seconds (0: Python's default, 0.005)",
    )
    ap.add_argument(
        "--py-sample-hz",
        type=float,
        default=0.0,
        help="sample Python stacks this often, weighted by thread CPU (0: off; PySampler)",
    )
    ap.set_defaults(engine="units", offload_optimizer="nvme", pool_device_fraction=1.0)
    args = ap.parse_args()
    if args.report:
        data = json.loads(Path(args.report).read_text())
        print(report(data, args.step))
        print(py_report(data, args.step))
        return
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    os.makedirs(args.nvme_path, exist_ok=True)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    name_os_threads()
    rec = Recorder()
    rec.install()
    sampler = PySampler(args.py_sample_hz) if args.py_sample_hz > 0 else None
    if sampler is not None:
        sampler.start()
    with tempfile.TemporaryDirectory(prefix="profile_", dir=args.nvme_path) as nvme_dir:
        spec = bm.trial_spec("stage3", bm.family_config(args.k), args, nvme_dir, 3600.0)
        out = bm.run_trial(spec, callbacks=(rec.callback(),))
    data = {"trial": out, "steps": rec.steps, "spans": rec.spans, "cpu": rec.cpu}
    if sampler is not None:
        sampler.stop()
        data["py_samples"], data["py_stacks"] = sampler.samples, sampler.stacks
    Path(args.out).write_text(json.dumps(data))
    print(report(data, args.step))
    print(py_report(data, args.step))


if __name__ == "__main__":
    main()
