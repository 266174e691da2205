"""The data contract between the runtime's summaries and the Memory Hierarchy View.

Every summary the runtime writes carries plugin name :data:`PLUGIN_NAME`, ``data_class``
TENSOR (TensorBoard's Rust data server drops custom summaries without a data class) and
a metadata content that is a JSON object::

    {"version": 1, "kind": "matrix" | "vector" | "json",
     "rows": [...], "columns": [...], "units": [...]}

``rows``/``columns`` name the axes of a ``matrix`` (float64, shape ``[len(rows),
len(columns)]``); a ``vector`` has ``columns`` only (float64, shape ``[len(columns)]``);
a ``json`` tensor is a scalar string holding one UTF-8 JSON object. ``units`` parallels
``columns``. A value that was not measured (for example the NVML reading on a host without
a GPU) is NaN: absent, never zero.

The reader refuses a ``version`` newer than :data:`SCHEMA_VERSION` with
:class:`UnsupportedSchemaError`, so the format can evolve without silent misreads (the
pattern of TensorBoard's scalar plugin, ``tensorboard/plugins/scalar/metadata.py``).
Tag names are stable; ``docs/events.md`` documents each with its units.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tensorboard.compat.proto import summary_pb2

PLUGIN_NAME = "memory_hierarchy"

# Version of the metadata content and of the tensor layouts below. Bump when a layout
# changes incompatibly; readers refuse newer versions.
SCHEMA_VERSION = 1

# --- tiers ----------------------------------------------------------------------------
TIERS = ("device", "host", "nvme")

# Columns of the per-step tier matrix (rows are TIERS). All in bytes.
TIER_COLUMNS = (
    "used_bytes",  # bytes in use on the tier at the end of the step
    "capacity_bytes",  # the tier's budget (NaN when unbounded / unknown)
    "peak_bytes",  # highest use since the previous record
    "param_bytes",  # of used: parameters
    "grad_bytes",  # of used: gradients
    "optimizer_bytes",  # of used: optimizer states (and fp32 master weights)
    "other_bytes",  # of used: activations and everything not attributed
)

# Columns of the per-step readings vector: what the framework, driver and OS report,
# shown beside the runtime's own accounting. Bytes; NaN when the source is absent.
READING_COLUMNS = (
    "framework_device_bytes",  # tf.config.experimental.get_memory_info()['current']
    "framework_device_peak_bytes",  # ... ['peak']
    "nvml_used_bytes",  # NVML nvmlDeviceGetMemoryInfo().used (GPU hosts only)
    "nvml_total_bytes",  # NVML ... .total
    "process_rss_bytes",  # psutil.Process().memory_info().rss
    "nvme_disk_bytes",  # bytes on disk under nvme_path
)

# Columns of the per-step page-move vector (counts, bytes, seconds).
PAGE_COLUMNS = (
    "d2h_pages",
    "d2h_bytes",
    "h2d_pages",
    "h2d_bytes",
    "h2n_pages",
    "h2n_bytes",
    "n2h_pages",
    "n2h_bytes",
    "evictions",
    "prefetch_hits",
    "prefetch_misses",
    "stall_seconds",
    "io_seconds",
    "h2n_clean_pages",  # host -> NVMe with no write: the page's NVMe copy was current
    "h2n_clean_bytes",
)

# Columns of the per-step timing vector (seconds, except the ratio in [0, 1]).
TIMING_COLUMNS = (
    "step_seconds",
    "compute_seconds",
    "comm_seconds",
    "overlap_seconds",
    "stall_seconds",
    "overlap_ratio",  # overlap_seconds / comm_seconds; NaN when comm_seconds == 0
    "io_seconds",  # NVMe page I/O the runtime drove during the step (union of its jobs)
    "traced",  # 1 when the step traced (compiled) its step function: step 0, a retrace
)

# Widths an older writer used for a vector tag: such a vector is read with the columns
# added since as NaN (not measured). TIMING_COLUMNS had 6 before io_seconds and traced;
# PAGE_COLUMNS 13 before the clean evictions (h2n_clean_*).
LEGACY_WIDTHS: dict[str, tuple[int, ...]] = {
    "memory_hierarchy/timing": (6,),
    "memory_hierarchy/pages": (13,),
}

# Columns of the per-step collective vector: bytes each collective kind's input buffers
# hold per optimizer step (summed over the local replicas), then calls per kind.
COLLECTIVE_COLUMNS = (
    "all_reduce_bytes",
    "reduce_scatter_bytes",
    "all_gather_bytes",
    "all_reduce_calls",
    "reduce_scatter_calls",
    "all_gather_calls",
)

# Columns of the per-step info vector (flags are 0/1).
STEP_INFO_COLUMNS = (
    "config_version",  # version of the active config (0 = as started)
    "stage",  # ZeRO stage in effect
    "fallback_mirrored",  # 1 when running as plain mirrored data parallelism
    "profiled",  # 1 when the timing's comm/compute came from a profiler trace
)

# --- tags -----------------------------------------------------------------------------
TAG_TIERS = "memory_hierarchy/tiers"  # matrix TIERS x TIER_COLUMNS, every record
TAG_READINGS = "memory_hierarchy/readings"  # vector READING_COLUMNS, every record
TAG_PAGES = "memory_hierarchy/pages"  # vector PAGE_COLUMNS, every record
TAG_TIMING = "memory_hierarchy/timing"  # vector TIMING_COLUMNS, every record
TAG_RUN_INFO = "memory_hierarchy/run_info"  # json, at start and when it changes
TAG_PLACEMENT = "memory_hierarchy/placement"  # json, first step and when it changes
TAG_ESTIMATE = "memory_hierarchy/estimate"  # json, at start
TAG_CONFIG_EVENT = "memory_hierarchy/config_event"  # json, per live-tuning event
TAG_OOM = "memory_hierarchy/oom"  # json, the post-mortem of an out-of-memory failure
TAG_COLLECTIVES = "memory_hierarchy/collectives"  # vector COLLECTIVE_COLUMNS, every record
TAG_STEP_INFO = "memory_hierarchy/step_info"  # vector STEP_INFO_COLUMNS, every record
TAG_CHECKPOINT = "memory_hierarchy/checkpoint"  # json, per checkpoint save
# json, per checkpoint restore. Its own tag: a resumed job restores at exactly the step the
# previous process saved, and TensorBoard's load_fast data server keeps one value per
# (run, tag, step), so one tag for both would keep only one of them.
TAG_CHECKPOINT_RESTORE = "memory_hierarchy/checkpoint_restore"
# The checkpoint tag a record with ``op`` (``"save"`` / ``"restore"``) is written under.
CHECKPOINT_OP_TAGS = {"save": TAG_CHECKPOINT, "restore": TAG_CHECKPOINT_RESTORE}

# --- side files --------------------------------------------------------------------------
# A job's restart events, one JSON object per line, written by ``zero-runtime launch
# --logdir LOGDIR`` into LOGDIR (the same lines as its checkpoint directory's
# restarts.jsonl; zero_runtime.launch.restarts.LOGDIR_EVENTS_FILE, docs/multiworker/restarts.md):
# a file, not summaries, because the launcher outlives every worker (its last line, the
# job's goodput, comes after they exit). Read by GET /restarts for the run's directory or,
# for a multi-worker run ``LOGDIR/worker_<rank>``, its parent.
RESTARTS_FILE = "memory_hierarchy_restarts.jsonl"
# The ``kind`` of a ``resume`` event: what the group before it ended with.
RESTART_KINDS = ("restart", "preemption", "resize")

# --- standard TensorBoard scalars ---------------------------------------------------------
# Headline figures, also written as plain scalars (plugin ``scalars``, float32, one value per
# record) so TensorBoard's Scalars dashboard, tbparse and hparams tools read them without this
# plugin. Tag -> unit. The figures are those of the tensors above (same step, same values);
# a figure that was not measured (NaN) is not written at that step.
SCALAR_PREFIX = "zero/"
SCALAR_TAGS: dict[str, str] = {
    **{f"{SCALAR_PREFIX}{tier}/used_bytes": "bytes" for tier in TIERS},
    **{f"{SCALAR_PREFIX}{tier}/peak_bytes": "bytes" for tier in TIERS},
    f"{SCALAR_PREFIX}pages/in_bytes": "bytes",  # h2d + n2h: moved towards the device
    f"{SCALAR_PREFIX}pages/out_bytes": "bytes",  # d2h + h2n: moved away from the device
    f"{SCALAR_PREFIX}pages/prefetch_hit_rate": "ratio",  # hits / (hits + misses)
    f"{SCALAR_PREFIX}timing/stall_seconds": "seconds",
    f"{SCALAR_PREFIX}timing/overlap_ratio": "ratio",
    f"{SCALAR_PREFIX}timing/step_seconds": "seconds",
}


def headline_scalars(
    tiers: dict[str, dict[str, float]], pages: dict[str, float], timing: dict[str, float]
) -> dict[str, float]:
    """The :data:`SCALAR_TAGS` figures of one record, from its tensors' columns.

    Args:
        tiers: tier name (:data:`TIERS`) -> :data:`TIER_COLUMNS` -> bytes.
        pages: :data:`PAGE_COLUMNS` -> counts / bytes / seconds (missing = not measured);
            page-in and page-out sum the directions that were measured.
        timing: :data:`TIMING_COLUMNS` -> seconds / ratio (missing = not measured).

    Returns:
        scalar tag -> value in the unit of :data:`SCALAR_TAGS`; figures that are NaN
        (not measured) or undefined (a hit rate without any prefetch) are left out.
    """

    def get(d: dict[str, float], key: str) -> float:
        v = d.get(key)
        return math.nan if v is None else float(v)

    out: dict[str, float] = {}
    for tier in TIERS:
        cells = tiers.get(tier, {})
        out[f"{SCALAR_PREFIX}{tier}/used_bytes"] = get(cells, "used_bytes")
        out[f"{SCALAR_PREFIX}{tier}/peak_bytes"] = get(cells, "peak_bytes")

    def total(*keys: str) -> float:  # NaN only when no direction was measured
        measured = [v for v in (get(pages, k) for k in keys) if math.isfinite(v)]
        return sum(measured) if measured else math.nan

    out[f"{SCALAR_PREFIX}pages/in_bytes"] = total("h2d_bytes", "n2h_bytes")
    out[f"{SCALAR_PREFIX}pages/out_bytes"] = total("d2h_bytes", "h2n_bytes")
    hits, misses = get(pages, "prefetch_hits"), get(pages, "prefetch_misses")
    out[f"{SCALAR_PREFIX}pages/prefetch_hit_rate"] = (
        hits / (hits + misses) if hits + misses > 0 else math.nan
    )
    out[f"{SCALAR_PREFIX}timing/stall_seconds"] = get(timing, "stall_seconds")
    out[f"{SCALAR_PREFIX}timing/overlap_ratio"] = get(timing, "overlap_ratio")
    out[f"{SCALAR_PREFIX}timing/step_seconds"] = get(timing, "step_seconds")
    return {tag: v for tag, v in out.items() if math.isfinite(v)}


KIND_MATRIX = "matrix"
KIND_VECTOR = "vector"
KIND_JSON = "json"

# tag -> (kind, rows, columns, units)
LAYOUTS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    TAG_TIERS: (KIND_MATRIX, TIERS, TIER_COLUMNS, ("bytes",) * len(TIER_COLUMNS)),
    TAG_READINGS: (KIND_VECTOR, (), READING_COLUMNS, ("bytes",) * len(READING_COLUMNS)),
    TAG_PAGES: (
        KIND_VECTOR,
        (),
        PAGE_COLUMNS,
        tuple(
            "seconds" if c.endswith("seconds") else "bytes" if c.endswith("bytes") else "count"
            for c in PAGE_COLUMNS
        ),
    ),
    TAG_TIMING: (
        KIND_VECTOR,
        (),
        TIMING_COLUMNS,
        tuple(
            "ratio" if c.endswith("ratio") else "flag" if c == "traced" else "seconds"
            for c in TIMING_COLUMNS
        ),
    ),
    TAG_RUN_INFO: (KIND_JSON, (), (), ()),
    TAG_PLACEMENT: (KIND_JSON, (), (), ()),
    TAG_ESTIMATE: (KIND_JSON, (), (), ()),
    TAG_CONFIG_EVENT: (KIND_JSON, (), (), ()),
    TAG_OOM: (KIND_JSON, (), (), ()),
    TAG_CHECKPOINT: (KIND_JSON, (), (), ()),
    TAG_CHECKPOINT_RESTORE: (KIND_JSON, (), (), ()),
    TAG_COLLECTIVES: (
        KIND_VECTOR,
        (),
        COLLECTIVE_COLUMNS,
        tuple("bytes" if c.endswith("bytes") else "count" for c in COLLECTIVE_COLUMNS),
    ),
    TAG_STEP_INFO: (
        KIND_VECTOR,
        (),
        STEP_INFO_COLUMNS,
        ("count", "count", "flag", "flag"),
    ),
}


class UnsupportedSchemaError(ValueError):
    """A summary's metadata declares a schema version newer than this reader knows."""


def create_summary_metadata(tag: str) -> summary_pb2.SummaryMetadata:
    """Build the ``SummaryMetadata`` proto for one of the documented tags.

    Args:
        tag: one of the keys of :data:`LAYOUTS`.

    Returns:
        A ``SummaryMetadata`` with plugin name :data:`PLUGIN_NAME`, ``data_class``
        ``DATA_CLASS_TENSOR`` and the JSON content described in the module docstring.

    Raises:
        KeyError: ``tag`` is not a documented tag; the message lists the known tags.
    """
    if tag not in LAYOUTS:
        raise KeyError(f"unknown memory_hierarchy tag {tag!r}; known tags: {sorted(LAYOUTS)}")
    kind, rows, columns, units = LAYOUTS[tag]
    content = {
        "version": SCHEMA_VERSION,
        "kind": kind,
        "rows": list(rows),
        "columns": list(columns),
        "units": list(units),
    }
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=PLUGIN_NAME, content=json.dumps(content).encode("utf-8")
        ),
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    )


def parse_plugin_metadata(content: bytes) -> dict[str, Any]:
    """Parse and check the plugin-specific metadata content written by this module.

    Args:
        content: the ``plugin_data.content`` bytes of a summary (UTF-8 JSON).

    Returns:
        The decoded dict with keys ``version``, ``kind``, ``rows``, ``columns``, ``units``.

    Raises:
        UnsupportedSchemaError: the content's ``version`` is newer than
            :data:`SCHEMA_VERSION`; the message names both versions.
        ValueError: the content is not a JSON object with an integer ``version``.
    """
    try:
        parsed = json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"memory_hierarchy metadata is not UTF-8 JSON: {content[:80]!r}") from exc
    if not isinstance(parsed, dict) or not isinstance(parsed.get("version"), int):
        raise ValueError(f"memory_hierarchy metadata lacks an integer 'version': {parsed!r}")
    if parsed["version"] > SCHEMA_VERSION:
        raise UnsupportedSchemaError(
            f"memory_hierarchy summaries use schema version {parsed['version']}, but this "
            f"reader knows versions up to {SCHEMA_VERSION}; upgrade zero-infinity-tf"
        )
    return parsed
