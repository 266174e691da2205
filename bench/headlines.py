"""The headline figures of every benchmark's results file, as one Markdown table.

Each file ``bench/results/<name>.json`` is written by its bench script (mostly
``bench/bench_<name>.py``) in a shape of its own. :data:`EXTRACTORS` maps each file name to
a small function that picks the figures a user cares about (step-time ratios against
MirroredStrategy, the largest model in a budget, paging bandwidth against the disk, ...)
and the run's context: its date, the machine (cores, CPU, RAM, as far as the file records
them) and the 1-minute load average during the run. :func:`headline_rows` runs them over a
results directory and :func:`markdown_table` renders the rows.

The documentation build (``scripts/docs_hooks.py``) writes ``docs/performance.md`` from
this table, and ``python bench/headlines.py`` prints it, so no page restates a measured
run by hand. A results file without an extractor, or whose keys its extractor does not
find, raises :class:`ResultsFormatError` naming the file: a new benchmark cannot be left
out of the table silently.

Pure Python (the standard library only): neither TensorFlow nor the runtime is imported.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""The directory of the committed results files."""

GIB = 1 << 30
NOT_RECORDED = "not recorded"
"""The date, machine or load cell of a file that does not record it."""


class ResultsFormatError(ValueError):
    """A results file has no extractor in :data:`EXTRACTORS`, is not JSON, or lacks a key its
    extractor reads. The message starts with the file's path and says what to change."""


@dataclasses.dataclass(frozen=True)
class Run:
    """The context of one results file, as table text.

    Attributes:
        date: when the run ended, ``"YYYY-MM-DD HH:MM UTC"``.
        machine: ``"2 cores, AMD EPYC, 23.5 GiB"``; parts the file does not record are left
            out.
        load: the 1-minute load average, ``"4.13 → 5.38"`` (start → end of the run),
            ``"0.21 to 1.27"`` (lowest to highest reading) or ``"not recorded"``.
    """

    date: str
    machine: str
    load: str


@dataclasses.dataclass(frozen=True)
class Figure:
    """One headline figure of a results file.

    Attributes:
        name: what the figure is, in words.
        value: the number in ``unit`` (a percentage is given as percent, e.g. ``-5.0`` for
            -5 %), or a bool (shown ``yes`` / ``no``).
        unit: ``"×"`` for a ratio, ``"%"``, ``"s"``, ``"ms"``, ``"parameters"``, ...; ``""``
            for a plain number.
        goal: the goal the results file states for this figure, as text in ``unit``
            (``"≤ 1.1×"``), or None when it states none.
        met: whether the run met ``goal`` (the file's own verdict where it gives one), or
            None without a goal.
    """

    name: str
    value: float | int | bool
    unit: str = ""
    goal: str | None = None
    met: bool | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    """One table row: a figure of the results file ``results`` (a file name such as
    ``"step_time.json"``) of the benchmark ``benchmark`` (its title), with the run's
    context."""

    results: str
    benchmark: str
    figure: Figure
    run: Run


Extractor = Callable[[dict[str, Any]], tuple[Run, list[Figure]]]
"""A results file's parsed JSON -> its run's context and its headline figures. Raises
``KeyError``, ``TypeError`` or ``ValueError`` on a file of another shape."""


# -- cells -----------------------------------------------------------------------------


def _date(text: str) -> str:
    """An ISO 8601 time with its UTC offset (``2026-12-07T18:59:03+0000``) as
    ``"2026-12-07 18:59 UTC"``. Raises ValueError without an offset."""
    when = datetime.datetime.fromisoformat(text)
    if when.tzinfo is None:
        raise ValueError(f"date {text!r} has no UTC offset")
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _machine(cores: int, cpu: str | None = None, ram_bytes: float | None = None) -> str:
    parts = [f"{cores} cores"]
    if cpu:
        parts.append(cpu)
    if ram_bytes:
        parts.append(f"{ram_bytes / GIB:.1f} GiB")
    return ", ".join(parts)


def _load(before: Sequence[float], after: Sequence[float]) -> str:
    """1/5/15-minute load averages at the start and end (``os.getloadavg()`` order) as
    ``"start → end"`` of the 1-minute figure."""
    return f"{before[0]:.2f} → {after[0]:.2f}"


def _header_run(d: dict[str, Any], machine: str | None = None) -> Run:
    """The run of a file that opens with ``bench/_common.run_header``'s keys (``date``,
    ``nproc``, ``load_average_before``, ``load_average_after``); ``machine`` when the file
    records more of it than ``nproc``."""
    return Run(
        _date(d["date"]),
        machine or _machine(d["nproc"]),
        _load(d["load_average_before"], d["load_average_after"]),
    )


def _start_end_run(d: dict[str, Any]) -> Run:
    """The run of a file with top-level ``date``, ``nproc``, ``cpu``, ``ram_bytes`` and
    ``load_average_1_5_15: {at_start, at_end}``."""
    load = d["load_average_1_5_15"]
    return Run(
        _date(d["date"]),
        _machine(d["nproc"], d["cpu"], d["ram_bytes"]),
        _load(load["at_start"], load["at_end"]),
    )


def _number(value: float | int | bool) -> str:
    """``1,048,315,392`` for an int, three significant digits for a float below 1000
    (``0.955``, ``25.2``, ``1e-05``), a whole number with separators above; yes/no for a
    bool."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _with_unit(value: float | int | bool, unit: str) -> str:
    number = _number(value)
    if not unit:
        return number
    return number + unit if unit == "×" else f"{number} {unit}"


def _limit(goal: str) -> float:
    """The number after the ``<=`` of a results file's goal text (``"overhead_median <=
    0.02"`` -> 0.02; ``"median error <= 20% (...)"`` -> 0.2). Raises ValueError without
    one."""
    found = re.search(r"<=\s*([0-9.]+)\s*(%?)", goal)
    if found is None:
        raise ValueError(f"goal {goal!r} states no '<= limit'")
    return float(found.group(1)) / (100 if found.group(2) else 1)


def _at_most(name: str, value: float, limit: float, unit: str = "", met: bool | None = None):
    """A figure whose goal is ``value <= limit`` (both in ``unit``); ``met`` is the file's
    verdict, computed from the two when the file gives none."""
    met = value <= limit if met is None else met
    return Figure(name, value, unit, f"≤ {_with_unit(limit, unit)}", met)


def _at_least(name: str, value: float, limit: float, unit: str = "", met: bool | None = None):
    """As :func:`_at_most`, for a goal ``value >= limit``."""
    met = value >= limit if met is None else met
    return Figure(name, value, unit, f"≥ {_with_unit(limit, unit)}", met)


def _pct(fraction: float) -> float:
    return fraction * 100


def _median_overhead(d: dict[str, Any], name: str) -> Figure:
    """The figure of a results file with ``overhead_median`` (a fraction of the step) and
    a ``goal`` text ``"... <= limit"``, both shown in percent."""
    return _at_most(name, _pct(d["overhead_median"]), _pct(_limit(d["goal"])), "%")


# -- one extractor per results file ----------------------------------------------------


def applications_parity(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_applications_parity.py``: how many keras.applications comparisons at
    stage 3 stayed within the parity bounds, and the worst weight and loss differences."""
    run = _header_run(d, _machine(d["nproc"], ram_bytes=d["memory_gib"] * GIB))
    comparisons, bounds = d["comparisons"], d["bounds"]
    within = sum(bool(c["within_bounds"]) for c in comparisons)
    families = len({c["family"] for c in comparisons})
    loops = ", ".join(sorted({c["loop"] for c in comparisons}))
    return run, [
        Figure(
            f"comparisons within the parity bounds ({families} families; loops: {loops})",
            within,
            f"of {len(comparisons)}",
            "all",
            within == len(comparisons),
        ),
        _at_most(
            "worst weight difference, max |w − r| / max |r| per variable",
            max(c["weight_rel"] for c in comparisons),
            bounds["weight_rel"],
        ),
        _at_most(
            "worst loss difference, relative",
            max(c["loss_rel"] for c in comparisons),
            bounds["loss_rel"],
        ),
    ]


def estimate_peak(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_estimate_peak.py``: the estimator's device peak against the allocator's,
    per stage (percent error; goal within 15 %)."""
    run = Run(_date(d["date"]), _machine(d["machine"]["cpus"]), NOT_RECORDED)
    return run, [
        Figure(
            f"stage {r['stage']}: predicted / measured device peak − 1",
            _pct(r["error"]),
            "%",
            "within ±15 %",
            r["within_15_percent"],
        )
        for r in d["results"]
    ]


def fault_heal(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_fault_heal.py``: the faulted job finished and matched the uninterrupted
    one bitwise; restart seconds, steps lost per kill, goodput."""
    m = d["machine"]
    run = _header_run(d, _machine(m["nproc"], m["cpu"], m["ram_bytes"]))
    lost = d["steps_lost"]
    return run, [
        Figure(
            f"job finished by itself after {len(d['faults_sent'])} faults (kill -9 and "
            f"SIGTERM), {d['restarts']} restarts",
            d["finished"],
        ),
        Figure("final weights bitwise equal to an uninterrupted run", d["bitwise"]),
        Figure(
            "restart, failure → next group's first step, median",
            d["restart_seconds"]["median"],
            "s",
        ),
        _at_most(
            "steps lost per kill, worst", lost["max_per_kill"], lost["bound_per_kill"], "steps"
        ),
        Figure("goodput: steps kept / steps run", _pct(d["goodput"]["steps_ratio"]), "%"),
    ]


def host_adam(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_host_adam.py``: host Adam throughput as a share of the memory-bandwidth
    bound, the runtime's backend and NumPy's."""
    run = _header_run(d, _machine(d["nproc"], d["cpu_model"], d["ram_bytes"]))
    return run, [
        _at_least(
            f"host Adam update rate / memory-bandwidth bound, as the runtime runs it "
            f"({d['runtime_config']})",
            d["ratio"],
            d["goal"],
            "×",
            d["goal_met"],
        ),
        Figure("the same, NumPy kernel", d["numpy_ratio"], "×"),
    ]


def max_model(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_max_model.py``: the largest model each side trains in the device budget,
    their ratio, the model-state device ratio and the largest stage-3 step against its I/O
    bound."""
    run = Run(_date(d["date"]), _machine(d["nproc"], d["cpu"], d["ram_bytes"]), NOT_RECORDED)
    budget = f"{d['device_budget_bytes'] / (1 << 20):.0f} MiB device budget"
    states, io = d["model_states_device_ratio"], d["largest_stage3_io"]
    return run, [
        Figure(
            f"largest GPT trained, stage 3 + NVMe, {budget}",
            d["max_params"]["stage3_nvme"],
            "parameters",
        ),
        Figure(
            f"largest GPT trained, MirroredStrategy, {budget}",
            d["max_params"]["mirrored"],
            "parameters",
        ),
        Figure(
            "largest model, stage 3 + NVMe / MirroredStrategy",
            d["ratio_stage3_over_mirrored_params"],
            "×",
        ),
        _at_most(
            "model-state device bytes per replica, stage 3 / MirroredStrategy",
            states["ratio_params_grads_optimizer"],
            states["goal"],
            "×",
            states["goal_met"],
        ),
        _at_most(
            f"step of the largest stage-3 model ({io['params']:,} parameters) / its NVMe "
            "I/O lower bound",
            io["step_over_bound"],
            io["goal"],
            "×",
            io["goal_met"],
        ),
    ]


def oom_advice(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_oom_advice.py``: precision and recall of the post-mortem's "fits"
    suggestions (percent)."""
    run = Run(_date(d["date"]), _machine(d["machine"]["cpus"]), NOT_RECORDED)
    return run, [
        _at_least(
            f"precision of the 'fits' suggestions ({d['ooms']} OOM scenarios)",
            _pct(d["precision"]),
            _pct(d["precision_goal"]),
            "%",
            d["precision_met"],
        ),
        Figure(
            "recall: scenarios with a 'fits' suggestion / scenarios where one fits",
            _pct(d["recall"]),
            "%",
        ),
    ]


def paging(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_paging.py``: the pool's page-out / page-in bandwidth over fio's at the same
    queue depth, and prefetch hit rates. The load cell is the range of readings."""
    m, load = d["machine"], d["load_average"]
    run = Run(
        _date(d["date"]),
        _machine(m["nproc"], ram_bytes=m["ram_bytes"]),
        f"{load['min']:.2f} to {load['max']:.2f}",
    )
    ratios, goal = d["ratios"], d["goal_ratio"]
    policies = d["prefetch_trace"]["policies"]
    return run, [
        _at_least(
            "pool page-out / fio write bandwidth at the pool's queue depth",
            ratios["page_out_vs_fio_write_at_pool_depth"],
            goal,
            "×",
        ),
        _at_least(
            "pool page-in / fio read bandwidth at the pool's queue depth",
            ratios["page_in_vs_fio_read_at_pool_depth"],
            goal,
            "×",
        ),
        Figure(
            "prefetch hit rate, stage-3 access trace, prefetch with the access order",
            _pct(policies["prefetch+order"]["prefetch_hit_rate"]),
            "%",
        ),
        Figure(
            "prefetch hit rate, the same trace without prefetch",
            _pct(policies["none"]["prefetch_hit_rate"]),
            "%",
        ),
    ]


def partial_offload(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_partial_offload.py`` (both widths): how many partial-offload runs lie
    between no and full offload, and full offload's step against Mirrored's."""
    run = _header_run(d)
    between = d["partial_between_none_and_cpu"]
    inside = sum(bool(v) for v in between.values())
    vs_mirrored = d["ratios_vs_mirrored"]
    model = f"{d['model_params']:,} parameters"
    return run, [
        Figure(
            f"partial-offload runs whose step lies between no and full offload ({model})",
            inside,
            f"of {len(between)}",
            "all",
            inside == len(between),
        ),
        Figure(
            f"stage 1, optimizer on host: step / MirroredStrategy step ({model})",
            vs_mirrored["stage1_cpu"],
            "×",
        ),
        Figure(
            f"stage 2, optimizer on host: step / MirroredStrategy step ({model})",
            vs_mirrored["stage2_cpu"],
            "×",
        ),
    ]


def restart(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_restart.py``: kill to first new step, cold start, goodput at one failure
    an hour (medians over rounds)."""
    m, median = d["machine"], d["median"]
    run = _header_run(d, _machine(m["nproc"], m["cpu"], m["ram_bytes"]))
    return run, [
        Figure(
            "kill of a worker → first new step, median",
            median["kill_to_first_new_step_seconds"],
            "s",
        ),
        Figure(
            "cold start → first step, median (for scale)",
            median["cold_start_to_first_step_seconds"],
            "s",
        ),
        Figure(
            "goodput at one failure per hour", _pct(median["goodput_at_one_failure_per_hour"]), "%"
        ),
    ]


def stage3_nvme(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_stage3_nvme.py``: stage 3 on NVMe against its serial I/O lower bound and
    against Mirrored."""
    run = _header_run(d)
    ratios = d["ratios"]
    return run, [
        _at_most(
            "stage 3, parameters and optimizer on NVMe: step / serial I/O lower bound",
            ratios["stage3_nvme_vs_io_bound_serial"],
            _limit(d["goal"]),
            "×",
            d["goal_met"],
        ),
        Figure("the same: step / MirroredStrategy step", ratios["stage3_nvme_vs_mirrored"], "×"),
    ]


_STAGE3_TIERS = {"none": "on device", "cpu": "on host", "nvme": "on NVMe"}
"""Stage-3 configuration suffix -> where its parameters and optimizer states are."""


def _stage3_name(config: str) -> str:
    """``"stage3_cpu_bf16"`` -> ``"stage 3, states on host, bfloat16"``."""
    tier, _, policy = config.removeprefix("stage3_").partition("_")
    return f"stage 3, states {_STAGE3_TIERS[tier]}" + (", bfloat16" if policy else "")


def stage3_units(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_stage3_units.py``: stage-3 step over the same model's Mirrored step, chain
    and residual models, states on device and host."""
    run = _header_run(d)
    figures = []
    for key, ratio in d["ratios_vs_mirrored_same_model"].items():
        model, config = key.split("/")
        figures.append(
            Figure(
                f"{model} model, {_stage3_name(config)}: step / MirroredStrategy step", ratio, "×"
            )
        )
    return run, figures


_STAGE12_NAMES = {
    "stage1": "stage 1",
    "stage2": "stage 2",
    "stage2_no_overlap": "stage 2, overlap_comm off",
    "stage2_cpu": "stage 2, optimizer on host",
}


def step_time(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_step_time.py``: each stage's step over Mirrored's with the file's goals; stage
    3 on NVMe against its page I/O lower bound."""
    run = _header_run(d)
    figures = [
        _at_most(
            f"{_STAGE12_NAMES[key]}: step / MirroredStrategy step",
            d["ratios_vs_mirrored"][key],
            limit,
            "×",
            d["goals_met"][key],
        )
        for key, limit in d["goals"].items()
    ]
    for key, config in d["stage3"]["configs"].items():
        measure = config["goal"].split()[0]  # "vs_mirrored <= 1.5": the ratio it bounds
        against = {
            "vs_mirrored": "MirroredStrategy step",
            "vs_page_io_bound_serial": "serial page I/O lower bound",
        }[measure]
        figures.append(
            _at_most(
                f"{_stage3_name(key)}: step / {against}",
                config["ratios"][measure],
                _limit(config["goal"]),
                "×",
                config["goal_met"],
            )
        )
    return run, figures


def step_time_ab(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``step_time.json``'s stage-3 ratios at two revisions: B / A per configuration.
    The file has no top-level date: the latest run's date stands for it."""
    runs = d["runs"]
    run = Run(
        max(_date(r["date"]) for r in runs),
        _machine(d["nproc"], d["cpu"], d["ram_bytes"]),
        _load(runs[0]["load_average_before"], runs[-1]["load_average_after"]),
    )
    limit = _limit(d["goal"])
    revisions = d["revisions"]
    return run, [
        _at_most(
            f"{_stage3_name(key)}: step ratio to Mirrored, {revisions['B']} / {revisions['A']}",
            ratio,
            limit,
            "×",
        )
        for key, ratio in d["b_over_a"].items()
    ]


def telemetry(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_telemetry.py``: median step-time overhead of per-step telemetry and its
    CPU share of the step."""
    run = _start_end_run(d)
    return run, [
        _median_overhead(d, "step-time overhead of telemetry on every step, median"),
        Figure("telemetry CPU per step, share of the step", _pct(d["cpu_fraction_of_step"]), "%"),
    ]


def timing_callbacks(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_timing_callbacks.py``: median step-time overhead of timing the
    strategy's own collectives."""
    run = Run(_date(d["date"]), _machine(d["nproc"], d["cpu"], d["ram_bytes"]), NOT_RECORDED)
    return run, [
        _median_overhead(d, "step-time overhead of timing the strategy's collectives, median")
    ]


def units_peak(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_units_peak.py``: the stage-3 step's device peak per parameter, for each
    configuration of the largest model tried."""
    run = _header_run(d, _machine(d["nproc"], d["cpu"], d["ram_bytes"]))
    largest = max(t["k"] for t in d["trials"])
    return run, [
        Figure(
            f"stage-3 device step peak per parameter, {t['params']:,} parameters, {t['mode']}",
            t["peak_bytes_per_param"],
            "bytes",
        )
        for t in d["trials"]
        if t["k"] == largest
    ]


_VIEW_SCENARIOS = (
    # (key prefix in "goals", scenario, its goal's key)
    ("10x100k_first_paint_first_visit", "10 runs × 100k steps", "first_paint_goal_ms"),
    ("1x1M_first_chart_first_visit", "1 run × 1M steps", "first_chart_goal_ms"),
    ("200x2k_first_chart_first_visit", "200 runs × 2k steps", "first_chart_goal_ms"),
)


def view(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_view.py``: the tab's cold route latency, first paint per scenario (whole page
    and the plugin's part) and the longest main-thread task, each against its goal."""
    m, goals = d["machine"], d["goals"]
    run = Run(
        _date(d["date"]),
        _machine(m["nproc"], m["cpu_model"], m["ram_bytes"]),
        _load(d["load_average_at_start"], m["load_average_1_5_15"]),  # machine(): at the end
    )
    figures = [
        _at_most(
            "data route /series, cold, p95",
            goals["series_p95_cold_ms"],
            goals["series_p95_cold_goal_ms"],
            "ms",
            goals["series_p95_cold_met"],
        )
    ]
    for key, scenario, goal in _VIEW_SCENARIOS:
        limit = goals[goal]
        figures += [
            _at_most(
                f"first paint, first visit, {scenario}: whole page",
                goals[f"{key}_ms"],
                limit,
                "ms",
                goals[f"{key}_met"],
            ),
            _at_most(
                f"first paint, first visit, {scenario}: the plugin's part",
                goals[f"{key}_plugin_part_ms"],
                limit,
                "ms",
                goals[f"{key}_plugin_part_met"],
            ),
        ]
    figures += [
        _at_most(
            "longest main-thread task, 200 runs: whole page",
            goals["200x2k_longest_task_ms"],
            goals["long_task_goal_ms"],
            "ms",
            goals["200x2k_longest_task_met"],
        ),
        _at_most(
            "longest main-thread task, 200 runs: the plugin's frame",
            goals["200x2k_longest_task_ms_plugin_frame"],
            goals["long_task_goal_ms"],
            "ms",
            goals["200x2k_longest_task_plugin_frame_met"],
        ),
    ]
    return run, figures


def whatif(d: dict[str, Any]) -> tuple[Run, list[Figure]]:
    """``bench_whatif.py``: median what-if error of page moves and device peak, and the
    step-time overhead of recording the access trace."""
    run = _start_end_run(d)
    limit = _pct(_limit(d["goal"]))
    changes = len(d["changes"])
    return run, [
        _at_most(
            f"what-if error, page moves per step, median over {changes} live changes",
            _pct(d["median_error"]["moves"]),
            limit,
            "%",
            d["goal_met"],
        ),
        _at_most(
            f"what-if error, device peak, median over {changes} live changes",
            _pct(d["median_error"]["device_peak"]),
            limit,
            "%",
            d["goal_met"],
        ),
        Figure(
            "step-time overhead of recording the access trace, median",
            _pct(d["trace_cost"]["overhead_median"]),
            "%",
        ),
    ]


EXTRACTORS: dict[str, tuple[str, Extractor]] = {
    # results file name: (the benchmark's title, its extractor)
    "applications_parity.json": (
        "keras.applications at stage 3 vs MirroredStrategy",
        applications_parity,
    ),
    "estimate_peak.json": ("Estimated vs measured device peak, demo GPT", estimate_peak),
    "fault_heal.json": ("Self-healing job under kills and preemptions", fault_heal),
    "host_adam.json": ("Host Adam update vs memory bandwidth", host_adam),
    "max_model.json": ("Largest model in a device budget", max_model),
    "oom_advice.json": ("OOM post-mortem advice", oom_advice),
    "paging.json": ("Paged pool's NVMe tier vs the disk", paging),
    "partial_offload.json": ("Partial optimizer offload", partial_offload),
    "partial_offload_wide.json": ("Partial optimizer offload, wide model", partial_offload),
    "restart.json": ("Restart after a worker is killed", restart),
    "stage3_nvme.json": ("Stage 3 on NVMe vs its I/O bound", stage3_nvme),
    "stage3_units.json": ("Stage 3, chain and residual models", stage3_units),
    "step_time.json": ("Step time, ZeRO stages vs MirroredStrategy", step_time),
    "step_time_ab.json": ("Stage-3 step time, one revision against another", step_time_ab),
    "telemetry.json": ("Telemetry overhead", telemetry),
    "timing_callbacks.json": ("Timing the strategy's collectives", timing_callbacks),
    "units_peak.json": ("Stage-3 device peak per parameter", units_peak),
    "view.json": ("Memory Hierarchy tab at scale", view),
    "whatif.json": ("What-if prediction of live changes", whatif),
}
"""Results file name -> (benchmark title, extractor), one entry per file of
``bench/results/``."""


# -- the table -------------------------------------------------------------------------


def headline_rows(results_dir: Path = RESULTS_DIR) -> list[Row]:
    """The rows of every ``*.json`` file in ``results_dir``, in file-name order, each file's
    figures in its extractor's order.

    Raises:
        ResultsFormatError: a file without an extractor in :data:`EXTRACTORS`, not JSON,
            without a key (or with a value of another type) its extractor reads, or with
            no figure; the message names the file.
    """
    paths = sorted(Path(results_dir).glob("*.json"))
    if not paths:
        raise ResultsFormatError(f"{results_dir}: no results file (*.json) in this directory")
    rows: list[Row] = []
    for path in paths:
        if path.name not in EXTRACTORS:
            raise ResultsFormatError(
                f"{path}: no extractor for this results file: add one to EXTRACTORS in "
                "bench/headlines.py returning its headline figures"
            )
        title, extract = EXTRACTORS[path.name]
        try:
            run, figures = extract(json.loads(path.read_text(encoding="utf-8")))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise ResultsFormatError(
                f"{path}: its extractor {extract.__name__}() in bench/headlines.py does not "
                f"read this file ({type(e).__name__}: {e}); update the extractor to the "
                "file's keys"
            ) from e
        if not figures:
            raise ResultsFormatError(f"{path}: {extract.__name__}() found no figure in it")
        rows += [Row(path.name, title, figure, run) for figure in figures]
    return rows


HEADER = ("benchmark", "figure", "value", "goal", "met", "date", "machine", "load (1 min)")
"""The table's columns."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[Row]) -> str:
    """``rows`` as one Markdown table with the columns :data:`HEADER`: the benchmark's
    title and its results file (a code span), the figure, its value with unit, the goal
    (``–`` without one), ``yes`` / ``no`` (``–``), the run's date, machine and load."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    for row in rows:
        f = row.figure
        cells = (
            f"{row.benchmark} (`{row.results}`)",
            f.name,
            _with_unit(f.value, f.unit),
            f.goal or "–",
            "–" if f.met is None else _number(f.met),
            row.run.date,
            row.run.machine,
            row.run.load,
        )
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


PAGE_INTRO = """\
# Performance

The headline figures of every benchmark, read from its results file under `bench/results/`
by `bench/headlines.py` when this site is built (`python bench/headlines.py` prints the
same page). `bench/results/NAME.json` is written by `bench/bench_NAME.py`, whose docstring
gives the method; `partial_offload_wide.json` by `bench/bench_partial_offload.py --width
2048`, and `step_time_ab.json` by `bench/bench_step_time.py` run at two revisions in turn.
Each results file holds every measurement of its run; this table holds its headline
figures.

*goal*: the goal the results file states (– when it states none); *met*: whether the run
met it. *machine*: cores, CPU and RAM, as far as the file records them. *load (1 min)*:
the 1-minute load average at the start → the end of the run, or the lowest to the highest
reading during it: a load above the number of cores means other processes shared them
and slowed the timed figures.
"""
"""The page's title and the text above the table (Markdown)."""


def markdown_page(results_dir: Path = RESULTS_DIR) -> str:
    """The Markdown of ``docs/performance.md``: :data:`PAGE_INTRO` and the table of
    :func:`headline_rows` over ``results_dir``.

    Raises:
        ResultsFormatError: as :func:`headline_rows`.
    """
    return PAGE_INTRO + "\n" + markdown_table(headline_rows(results_dir))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the page of ``bench/results/`` (or of the directory given as the only
    argument) to stdout; exit status 1 with the error on stderr if a file cannot be read."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        page = markdown_page(Path(args[0]) if args else RESULTS_DIR)
    except ResultsFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
