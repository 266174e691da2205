"""Tests for zero_runtime.config: ZeroConfig, tunables, DeepSpeed import."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import warnings

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_runtime.config import (
    TUNABLE_KEYS,
    DeepSpeedAutoResolvedWarning,
    DeepSpeedKeyIgnoredWarning,
    Tunable,
    ZeroConfig,
    ZeroConfigError,
    ZeroConfigFileNotFoundError,
    physical_memory_bytes,
    validate_tunable_update,
)

REPO = pathlib.Path(__file__).resolve().parents[1]

# The defaults the issue (#3) specifies, key by key.
EXPECTED_DEFAULTS = {
    "stage": 1,
    "offload_optimizer": "cpu",
    "offload_param": "none",
    "nvme_path": None,
    "page_size_bytes": 4_194_304,
    "device_budget_bytes": None,
    "host_budget_bytes": None,
    "nvme_budget_bytes": None,
    "persistence_threshold": 100_000,
    "prefetch_bucket_size": 50_000_000,
    "max_live_parameters": 1_000_000_000,
    "max_reuse_distance": 1_000_000_000,
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "overlap_comm": True,
    "gradient_accumulation_steps": 1,
    "sub_group_size": 1_000_000_000,
    "pin_memory": False,
    "telemetry_every_n_steps": 1,
    "mirrored_fallback_bytes": 0,
    "collective_timeout_seconds": 60.0,
    "embedding_row_paging_threshold": 10_000_000,  # row-paged tables
    "offload_optimizer_ratio": 1.0,  # partial offload (Twin-Flow)
    "headroom_fraction": 0.1,  # device_budget_bytes="auto"
    "tile_size": None,  # memory-centric tiling (None: off, 'auto')
    "activation_checkpointing": False,  # blocks recomputed in backward
    "optimizer_host_budget_bytes": None,  # the NVMe optimizer store's host bytes
}


def test_defaults_are_the_documented_ones():
    assert ZeroConfig().to_dict() == EXPECTED_DEFAULTS
    assert ZeroConfig.keys() == tuple(EXPECTED_DEFAULTS)


def test_every_key_is_documented_in_the_docstring():
    """The docstring is the source of the generated config reference (the site's build
    checks that page lists every key: tests/test_docs_site.py)."""
    doc = ZeroConfig.__doc__ or ""
    for key in ZeroConfig.keys():
        assert f"{key}:" in doc, key
    assert set(TUNABLE_KEYS) <= set(ZeroConfig.keys())


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ZeroConfig().stage = 3  # type: ignore[misc]


# -- validation of single values --------------------------------------------------------

# (kwargs, fragments that must all appear in the message)
INVALID = [
    ({"stage": 4}, ["stage=4", "an int in [0, 3]"]),
    ({"stage": -1}, ["stage=-1", "[0, 3]"]),
    ({"stage": True}, ["stage=True", "got bool"]),
    ({"stage": 2.0}, ["stage=2.0", "got float"]),
    ({"stage": "3"}, ["stage='3'", "got str"]),
    ({"offload_optimizer": "gpu"}, ["offload_optimizer='gpu'", "'none', 'cpu', 'nvme'"]),
    ({"offload_optimizer": None}, ["offload_optimizer=None", "one of"]),
    ({"offload_param": "CPU"}, ["offload_param='CPU'", "one of 'none', 'cpu', 'nvme'"]),
    ({"nvme_path": ""}, ["nvme_path=''", "non-empty string"]),
    ({"nvme_path": 3}, ["nvme_path=3", "got int"]),
    ({"page_size_bytes": 100_000}, ["page_size_bytes=100000", "power of two"]),
    ({"page_size_bytes": 32_768}, ["page_size_bytes=32768", "[65536, 1_073_741_824]"]),
    # 1 TiB pages: accepted, stage 3 would blame a host budget never set
    ({"page_size_bytes": 2**40}, ["page_size_bytes=1099511627776", "[65536, 1_073_741_824]"]),
    ({"page_size_bytes": 2**31}, ["page_size_bytes=2147483648", "power-of-two int in"]),
    ({"device_budget_bytes": 0}, ["device_budget_bytes=0", ">= 1", "or None"]),
    ({"host_budget_bytes": -5}, ["host_budget_bytes=-5", "bytes"]),
    ({"nvme_budget_bytes": 1.5e9}, ["nvme_budget_bytes=1500000000.0", "got float"]),
    ({"persistence_threshold": -1}, ["persistence_threshold=-1", ">= 0 (elements)"]),
    ({"prefetch_bucket_size": -1}, ["prefetch_bucket_size=-1", ">= 0 (elements)"]),
    ({"max_live_parameters": 0}, ["max_live_parameters=0", ">= 1 (elements)"]),
    ({"max_reuse_distance": -3}, ["max_reuse_distance=-3", ">= 0 (elements)"]),
    ({"reduce_bucket_size": -1}, ["reduce_bucket_size=-1", "an int >= 1 (elements)"]),
    ({"allgather_bucket_size": 0}, ["allgather_bucket_size=0", ">= 1 (elements)"]),
    ({"overlap_comm": 1}, ["overlap_comm=1", "a bool", "got int"]),
    ({"overlap_comm": "true"}, ["overlap_comm='true'", "a bool"]),
    ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps=0", ">= 1"]),
    ({"gradient_accumulation_steps": False}, ["gradient_accumulation_steps=False", "bool"]),
    ({"sub_group_size": 0}, ["sub_group_size=0", ">= 1 (elements)"]),
    ({"pin_memory": 0}, ["pin_memory=0", "a bool"]),
    ({"telemetry_every_n_steps": 0}, ["telemetry_every_n_steps=0", ">= 1 (steps)"]),
    ({"mirrored_fallback_bytes": -1}, ["mirrored_fallback_bytes=-1", ">= 0 (bytes)"]),
    ({"collective_timeout_seconds": 0}, ["collective_timeout_seconds=0", "> 0 (seconds)"]),
    ({"collective_timeout_seconds": -1.0}, ["collective_timeout_seconds=-1.0", "> 0"]),
    ({"collective_timeout_seconds": math.nan}, ["collective_timeout_seconds=nan", "finite"]),
    ({"collective_timeout_seconds": math.inf}, ["collective_timeout_seconds=inf", "finite"]),
    ({"collective_timeout_seconds": True}, ["collective_timeout_seconds=True", "got bool"]),
    ({"collective_timeout_seconds": "60"}, ["collective_timeout_seconds='60'", "got str"]),
]


@pytest.mark.parametrize(("kwargs", "fragments"), INVALID)
def test_invalid_value_message_names_key_value_and_accepted(kwargs, fragments):
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    (key,) = kwargs
    assert info.value.key == key
    assert isinstance(info.value, ValueError)


def test_numbers_are_normalised():
    config = ZeroConfig(collective_timeout_seconds=5, page_size_bytes=65_536)
    assert config.collective_timeout_seconds == 5.0
    assert type(config.collective_timeout_seconds) is float
    assert config.page_size_bytes == 65_536


def test_numpy_scalars_are_accepted_as_plain_python_values():
    np = pytest.importorskip("numpy")
    config = ZeroConfig(stage=np.int64(2), overlap_comm=np.bool_(False))
    assert config.stage == 2 and type(config.stage) is int
    assert config.overlap_comm is False
    with pytest.raises(ZeroConfigError, match="got bool"):
        ZeroConfig(stage=np.bool_(True))


# -- cross-field rules ------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_param_requires_stage_3(stage, device):
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig(stage=stage, offload_param=device, nvme_path="/tmp/nvme")
    assert f"offload_param={device!r} is invalid with stage={stage}" in str(info.value)
    assert "requires stage 3" in str(info.value)
    assert ZeroConfig(stage=3, offload_param=device, nvme_path="/tmp/nvme").stage == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"offload_optimizer": "nvme"},
        {"stage": 3, "offload_optimizer": "none", "offload_param": "nvme"},
    ],
)
def test_nvme_requires_nvme_path(kwargs):
    with pytest.raises(ZeroConfigError, match=r"='nvme' requires nvme_path") as info:
        ZeroConfig(**kwargs)
    assert info.value.key == "nvme_path"
    assert ZeroConfig(**kwargs, nvme_path="/local_nvme").nvme_path == "/local_nvme"


def test_budget_must_hold_one_page():
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig(host_budget_bytes=1 << 20)  # 1 MiB < 4 MiB page
    assert "host_budget_bytes=1048576" in str(info.value)
    assert "page_size_bytes (4194304)" in str(info.value)
    small_pages = ZeroConfig(host_budget_bytes=1 << 20, page_size_bytes=1 << 16)
    assert small_pages.host_budget_bytes == 1_048_576


def test_page_size_bounds_are_accepted():
    assert ZeroConfig(page_size_bytes=1 << 16).page_size_bytes == 65_536
    assert ZeroConfig(page_size_bytes=1 << 30).page_size_bytes == 1_073_741_824


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("over", [1, 1 << 40])
def test_host_budget_above_physical_memory_is_refused_at_every_stage(stage, over):
    """Refused when the config is made, at stages 1-2 too (not only by stage 3's pool)."""
    physical = physical_memory_bytes()
    assert physical == psutil.virtual_memory().total
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig(stage=stage, host_budget_bytes=physical + over)
    message = str(info.value)
    assert f"host_budget_bytes={physical + over} is invalid" in message
    assert f"physical memory, {physical} bytes" in message
    assert f"[4194304, {physical}]" in message
    assert info.value.key == "host_budget_bytes"
    assert ZeroConfig(stage=stage, host_budget_bytes=physical).host_budget_bytes == physical
    with pytest.raises(ZeroConfigError, match="physical memory"):  # live tuning too
        validate_tunable_update(ZeroConfig(stage=stage), {"host_budget_bytes": physical + over})


# -- dict / JSON ------------------------------------------------------------------------


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_dict({"offload_optimiser": "cpu"})
    assert str(info.value) == "unknown key 'offload_optimiser'; did you mean 'offload_optimizer'?"


def test_unknown_key_without_a_near_match_lists_known_keys():
    with pytest.raises(ZeroConfigError, match="unknown key 'zzz'; known keys: stage, "):
        ZeroConfig.from_dict({"zzz": 1})


def test_from_dict_rejects_non_mapping_and_fills_defaults():
    with pytest.raises(ZeroConfigError, match="must be a mapping"):
        ZeroConfig.from_dict([("stage", 1)])  # type: ignore[arg-type]
    assert ZeroConfig.from_dict({"stage": 2}) == ZeroConfig(stage=2)


def test_json_round_trip_text_and_file(tmp_path):
    config = ZeroConfig(
        stage=3,
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path="/local_nvme",
        device_budget_bytes=1 << 30,
        collective_timeout_seconds=12.5,
    )
    text = config.to_json()
    assert json.loads(text)["device_budget_bytes"] == 1_073_741_824
    assert ZeroConfig.from_json(text) == config
    path = tmp_path / "zero.json"
    path.write_text(text, encoding="utf-8")
    assert ZeroConfig.from_json(path) == config
    assert ZeroConfig.from_json(str(path)) == config


def test_from_json_errors(tmp_path):
    with pytest.raises(ZeroConfigError, match="invalid JSON in <string>"):
        ZeroConfig.from_json("{stage: 1}")
    bad = tmp_path / "list.json"
    bad.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ZeroConfigError, match="must be an object, got list"):
        ZeroConfig.from_json(bad)
    with pytest.raises(ZeroConfigError, match="collective_timeout_seconds=nan"):
        ZeroConfig.from_json('{"collective_timeout_seconds": NaN}')
    with pytest.raises(FileNotFoundError):
        ZeroConfig.from_json(tmp_path / "missing.json")


# (loader, argument, exception type, fragments): JSON text that is not an object, and paths
# where no file exists (from_deepspeed("[1, 2]") is not a FileNotFoundError)
BAD_SOURCES = [
    ("from_deepspeed", "[1, 2]", ZeroConfigError, ["must be an object, got list", "'[1, 2]'"]),
    ("from_deepspeed", " null", ZeroConfigError, ["got NoneType", "JSON text ' null'"]),
    ("from_deepspeed", "3", ZeroConfigError, ["got int", "JSON text '3'"]),
    ("from_deepspeed", '"x"', ZeroConfigError, ["got str", "JSON text '\"x\"'"]),
    ("from_deepspeed", "[1,", ZeroConfigError, ["invalid JSON in <string>"]),
    ("from_json", "[1, 2]", ZeroConfigError, ["must be an object, got list", "'[1, 2]'"]),
    ("from_json", "true", ZeroConfigError, ["got bool", "JSON text 'true'"]),
    (
        "from_deepspeed",
        "no/such/ds_config.json",
        ZeroConfigFileNotFoundError,
        [
            "DeepSpeed config 'no/such/ds_config.json' is neither JSON text nor the path of an "
            "existing file"
        ],
    ),
    (
        "from_json",
        pathlib.Path("no/such/zero.json"),
        ZeroConfigFileNotFoundError,
        ["config 'no/such/zero.json' is neither JSON text nor the path of an existing file"],
    ),
]


@pytest.mark.parametrize(("loader", "source", "error", "fragments"), BAD_SOURCES)
def test_a_source_that_is_not_a_json_object_is_named(loader, source, error, fragments):
    with pytest.raises(error) as info:
        getattr(ZeroConfig, loader)(source)
    message = str(info.value)
    for fragment in fragments + ["expected a JSON object as text", "or the path of a JSON file"]:
        assert fragment in message, (fragment, message)
    assert type(info.value) is error  # not a bare FileNotFoundError from open()
    if error is ZeroConfigFileNotFoundError:  # catchable as either kind
        assert isinstance(info.value, FileNotFoundError)
        assert isinstance(info.value, ZeroConfigError)


def test_replace_validates_and_suggests():
    base = ZeroConfig()
    assert base.replace(stage=3, offload_param="cpu").offload_param == "cpu"
    assert base.stage == 1  # unchanged
    with pytest.raises(ZeroConfigError, match="requires stage 3"):
        base.replace(offload_param="cpu")
    with pytest.raises(ZeroConfigError, match="did you mean 'prefetch_bucket_size'"):
        base.replace(prefetch_bucket=1)


@st.composite
def valid_configs(draw) -> ZeroConfig:
    """Random valid configs, cross-field rules respected by construction."""
    stage = draw(st.integers(0, 3))
    devices = st.sampled_from(["none", "cpu", "nvme"])
    offload_param = draw(devices) if stage == 3 else "none"
    offload_optimizer = draw(devices)
    needs_path = "nvme" in (offload_param, offload_optimizer)
    nvme_path = draw(st.text(min_size=1).filter(str.strip)) if needs_path else None
    page = 1 << draw(st.integers(16, 30))
    budget = st.one_of(st.none(), st.integers(page, 1 << 50))
    host_budget = st.one_of(st.none(), st.integers(page, max(page, physical_memory_bytes())))
    elements = st.integers(0, 10**12)
    positive = st.integers(1, 10**12)
    return ZeroConfig(
        stage=stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        nvme_path=nvme_path,
        page_size_bytes=page,
        device_budget_bytes=draw(budget),
        host_budget_bytes=draw(host_budget),
        nvme_budget_bytes=draw(budget),
        persistence_threshold=draw(elements),
        prefetch_bucket_size=draw(elements),
        max_live_parameters=draw(positive),
        max_reuse_distance=draw(elements),
        reduce_bucket_size=draw(positive),
        allgather_bucket_size=draw(positive),
        overlap_comm=draw(st.booleans()),
        gradient_accumulation_steps=draw(st.integers(1, 1024)),
        sub_group_size=draw(positive),
        pin_memory=draw(st.booleans()),
        telemetry_every_n_steps=draw(st.integers(1, 10_000)),
        mirrored_fallback_bytes=draw(st.integers(0, 1 << 50)),
        collective_timeout_seconds=draw(
            st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)
        ),
    )


@settings(max_examples=60, deadline=None)
@given(valid_configs())
def test_round_trips_are_exact(config):
    assert ZeroConfig.from_dict(config.to_dict()) == config
    again = ZeroConfig.from_json(config.to_json())
    assert again == config
    assert again.to_json() == config.to_json()
    assert config.replace() == config


# -- live tuning ------------------------------------------------------------------------


def test_tunable_keys_and_bounds():
    assert set(TUNABLE_KEYS) == {
        "device_budget_bytes",
        "host_budget_bytes",
        "persistence_threshold",
        "max_live_parameters",
        "max_reuse_distance",
        "prefetch_bucket_size",
        "telemetry_every_n_steps",
    }
    defaults = ZeroConfig()
    for key, tunable in TUNABLE_KEYS.items():
        assert isinstance(tunable, Tunable) and tunable.key == key
        assert key in ZeroConfig.keys()
        assert tunable.unit in ("bytes", "elements", "steps")
        assert 0 <= tunable.minimum < tunable.maximum
        assert tunable.description
        default = getattr(defaults, key)
        assert default is None or tunable.minimum <= default <= tunable.maximum
    assert TUNABLE_KEYS["telemetry_every_n_steps"].minimum == 1
    assert TUNABLE_KEYS["device_budget_bytes"].minimum == 65_536
    assert TUNABLE_KEYS["device_budget_bytes"].maximum == 1 << 50


def test_tunable_update_applies():
    current = ZeroConfig(stage=3)
    new = validate_tunable_update(
        current, {"device_budget_bytes": 8 << 20, "persistence_threshold": 0}
    )
    assert new.device_budget_bytes == 8_388_608
    assert new.persistence_threshold == 0
    assert new.replace(device_budget_bytes=None, persistence_threshold=100_000) == current
    assert validate_tunable_update(current, {}) is current


REJECTED_UPDATES = [
    ({"stage": 2}, ["key 'stage' cannot be tuned live", "tunable keys: device_budget_bytes"]),
    ({"persistance_threshold": 5}, ["unknown key 'persistance_threshold'", "did you mean"]),
    ({"nonsense": 5}, ["unknown key 'nonsense'", "tunable keys:"]),
    ({"max_live_parameters": 0}, ["max_live_parameters=0", "[1, "]),
    ({"telemetry_every_n_steps": 2_000_000}, ["telemetry_every_n_steps=2000000", "1_000_000"]),
    ({"device_budget_bytes": 1024}, ["device_budget_bytes=1024", "[65536, "]),
    ({"prefetch_bucket_size": math.nan}, ["prefetch_bucket_size=nan", "finite"]),
    ({"host_budget_bytes": math.inf}, ["host_budget_bytes=inf", "finite"]),
    ({"max_reuse_distance": 10.0}, ["max_reuse_distance=10.0", "got float"]),
    ({"telemetry_every_n_steps": True}, ["telemetry_every_n_steps=True", "got bool"]),
    ({"persistence_threshold": "5"}, ["persistence_threshold='5'", "got str"]),
    ({"device_budget_bytes": None}, ["device_budget_bytes=None", "got None"]),
    # within the tunable's bounds but below the config's page size: the config says no.
    ({"host_budget_bytes": 1 << 20}, ["host_budget_bytes=1048576", "at least one page"]),
]


@pytest.mark.parametrize(("updates", "fragments"), REJECTED_UPDATES)
def test_tunable_update_rejections(updates, fragments):
    with pytest.raises(ZeroConfigError) as info:
        validate_tunable_update(ZeroConfig(), updates)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_tunable_update_requires_a_mapping():
    with pytest.raises(ZeroConfigError, match="must be a mapping"):
        validate_tunable_update(ZeroConfig(), [("stage", 1)])  # type: ignore[arg-type]


# -- DeepSpeed import -------------------------------------------------------------------

# DeepSpeed's ZeRO-Infinity example, verbatim from the DeepSpeed ZeRO tutorial
# (deepspeed.ai/tutorials/zero/, "Offloading to CPU and NVMe with ZeRO-Infinity").
DEEPSPEED_ZERO_INFINITY_EXAMPLE = """
{
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": true,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9,
        "offload_optimizer": {
            "device": "cpu"
         },
        "offload_param": {
            "device": "cpu"
       }
   }
}
"""

# The ZeRO-3 / ZeRO-Infinity NVMe offload example, verbatim from the Hugging Face
# Transformers DeepSpeed guide ("NVMe configuration"), which links DeepSpeed's config docs
# for the offload sections; it carries DeepSpeed's "auto" values.
DEEPSPEED_NVME_EXAMPLE = """
{
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },

    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto"
        }
    },

    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto"
        }
    },

    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": true,
            "buffer_count": 4,
            "fast_init": false
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": true,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9
        },
        "overlap_comm": true,
        "contiguous_gradients": true,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": true
    },

    "aio": {
        "block_size": 262144,
        "queue_depth": 32,
        "thread_count": 1,
        "single_submit": false,
        "overlap_events": true
    },

    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}
"""


def _load_ds(source):
    """from_deepspeed with every warning recorded: (config, {message: category})."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ZeroConfig.from_deepspeed(source)
    return config, [(str(w.message), w.category) for w in caught]


def test_deepspeed_nvme_example_loads(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(DEEPSPEED_NVME_EXAMPLE, encoding="utf-8")
    config, caught = _load_ds(path)
    assert config == ZeroConfig(
        stage=3,
        offload_optimizer="nvme",
        offload_param="nvme",
        nvme_path="/local_nvme",
        pin_memory=True,
        overlap_comm=True,
        sub_group_size=1_000_000_000,
        max_live_parameters=1_000_000_000,
        max_reuse_distance=1_000_000_000,
        # "auto" -> our defaults:
        reduce_bucket_size=500_000_000,
        prefetch_bucket_size=50_000_000,
        persistence_threshold=100_000,
        gradient_accumulation_steps=1,
    )
    ignored = {
        "fp16",
        "optimizer",
        "scheduler",
        "gradient_clipping",
        "steps_per_print",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "wall_clock_breakdown",
        "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_optimizer.fast_init",
        "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_param.buffer_size",
        "zero_optimization.offload_param.max_in_cpu",
        "aio",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    }
    auto = {
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "gradient_accumulation_steps",
    }
    ignored_seen = [m for m, c in caught if c is DeepSpeedKeyIgnoredWarning]
    auto_seen = [m for m, c in caught if c is DeepSpeedAutoResolvedWarning]
    assert len(caught) == len(ignored) + len(auto)  # exactly one warning per key
    assert {m.split("'")[1] for m in ignored_seen} == ignored
    assert {m.split("'")[1] for m in auto_seen} == auto
    assert (
        "DeepSpeed key 'zero_optimization.stage3_prefetch_bucket_size' is 'auto' (resolved by "
        "the Hugging Face Trainer from its arguments); using the ZeroConfig default "
        "prefetch_bucket_size=50000000" in auto_seen
    )
    assert issubclass(DeepSpeedAutoResolvedWarning, DeepSpeedKeyIgnoredWarning)


def test_deepspeed_zero_infinity_tutorial_example_loads():
    config, caught = _load_ds(DEEPSPEED_ZERO_INFINITY_EXAMPLE)
    assert config == ZeroConfig(
        stage=3,
        offload_optimizer="cpu",
        offload_param="cpu",
        max_live_parameters=1_000_000_000,
        max_reuse_distance=1_000_000_000,
        prefetch_bucket_size=10_000_000,
        persistence_threshold=100_000,
        reduce_bucket_size=10_000_000,
        sub_group_size=1_000_000_000,
        overlap_comm=True,  # DeepSpeed's default for stage 3
    )
    assert caught == [
        (
            "DeepSpeed key 'zero_optimization.contiguous_gradients' ignored: it has no "
            "counterpart in ZeroConfig",
            DeepSpeedKeyIgnoredWarning,
        )
    ]


def test_deepspeed_defaults_when_unset():
    config, caught = _load_ds({"train_batch_size": 8})
    assert config.stage == 0  # DeepSpeed's default: no ZeRO
    assert config.offload_optimizer == "none" and config.offload_param == "none"
    assert config.overlap_comm is False  # DeepSpeed: False below stage 3
    assert [m for m, _ in caught] == [
        "DeepSpeed key 'train_batch_size' ignored: it has no counterpart in ZeroConfig"
    ]
    assert _load_ds({"zero_optimization": {"stage": 2}})[0].overlap_comm is False
    assert _load_ds({"zero_optimization": {"stage": 3}})[0].overlap_comm is True
    assert _load_ds({"zero_optimization": True})[0].stage == 1  # legacy boolean form
    offload_without_device = {"zero_optimization": {"stage": 2, "offload_optimizer": {}}}
    assert _load_ds(offload_without_device)[0].offload_optimizer == "none"


def test_deepspeed_field_names_without_stage3_prefix_and_conflicts():
    config, _ = _load_ds({"zero_optimization": {"stage": 3, "param_persistence_threshold": 7}})
    assert config.persistence_threshold == 7
    both_same = {"stage3_max_live_parameters": 5, "max_live_parameters": 5.0}
    assert _load_ds({"zero_optimization": both_same})[0].max_live_parameters == 5
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_deepspeed(
            {"zero_optimization": {"stage3_max_live_parameters": 5, "max_live_parameters": 6}}
        )
    assert "zero_optimization.max_live_parameters=6 conflicts with " in str(info.value)


def test_deepspeed_nvme_paths_and_pin_memory():
    two_paths = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
            "offload_param": {"device": "nvme", "nvme_path": "/b"},
        }
    }
    with pytest.raises(ZeroConfigError, match="single nvme_path"):
        ZeroConfig.from_deepspeed(two_paths)
    mixed_pins = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": False, "nvme_path": "/x"},
            "offload_param": {"device": "cpu", "pin_memory": True},
        }
    }
    config, caught = _load_ds(mixed_pins)
    assert config.pin_memory is True and config.nvme_path is None
    messages = [m for m, _ in caught]
    assert any("offload_optimizer.pin_memory' ignored" in m for m in messages)
    assert any(
        "offload_optimizer.nvme_path' ignored: " in m and "not 'nvme'" in m for m in messages
    )
    no_path = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    with pytest.raises(ZeroConfigError, match="offload_param='nvme' requires nvme_path"):
        ZeroConfig.from_deepspeed(no_path)


INVALID_DEEPSPEED = [
    ({"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage='auto' cannot be resolved"),
    (
        {"zero_optimization": {"stage": 5}},
        "zero_optimization.stage=5 is invalid: expected an int in [0, 3]",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "auto"}}},
        "zero_optimization.offload_param.device='auto' cannot be resolved",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
        "zero_optimization.offload_param.device='gpu' is invalid: expected one of",
    ),
    (
        {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": "auto"},
            }
        },
        "zero_optimization.offload_param.nvme_path='auto' cannot be resolved",
    ),
    (
        {"zero_optimization": {"reduce_bucket_size": -1}},
        "zero_optimization.reduce_bucket_size=-1 is invalid: expected an int >= 1 (elements)",
    ),
    (
        {"zero_optimization": {"reduce_bucket_size": 1.5e3 + 0.5}},
        "zero_optimization.reduce_bucket_size=1500.5 is invalid",
    ),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm='yes'"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0 is invalid"),
    (
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        "(from DeepSpeed key 'zero_optimization.offload_param.device'): offload_param='cpu' "
        "is invalid with stage=2",
    ),
    ({"zero_optimization": [1]}, "zero_optimization must be an object"),
    ({"zero_optimization": {"offload_param": "cpu"}}, "zero_optimization.offload_param must be"),
]


@pytest.mark.parametrize(("ds", "fragment"), INVALID_DEEPSPEED)
def test_deepspeed_invalid_values(ds, fragment):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedKeyIgnoredWarning)
        with pytest.raises(ZeroConfigError) as info:
            ZeroConfig.from_deepspeed(ds)
    assert fragment in str(info.value)


def test_deepspeed_rejects_non_config():
    with pytest.raises(ZeroConfigError, match="must be a mapping, JSON text or a path"):
        ZeroConfig.from_deepspeed(42)  # type: ignore[arg-type]


# -- DeepSpeed: legacy keys, typos and "auto" from the hidden size ----------------------


@pytest.mark.parametrize(
    ("zero", "expected"),
    [
        ({"stage": 2, "cpu_offload": True}, ("cpu", "none")),
        ({"stage": 2, "cpu_offload": False}, ("none", "none")),
        ({"stage": 3, "cpu_offload": True, "cpu_offload_param": True}, ("cpu", "cpu")),
        ({"stage": 3, "cpu_offload_param": True}, ("none", "cpu")),
    ],
)
def test_deepspeed_legacy_cpu_offload_keys_offload(zero, expected):
    """deepspeed/runtime/zero/config.py: cpu_offload / cpu_offload_param are deprecated
    fields whose new_param_fn builds {"device": "cpu"} when true."""
    config, caught = _load_ds({"zero_optimization": zero})
    assert (config.offload_optimizer, config.offload_param) == expected
    assert config.pin_memory is False  # DeepSpeed's offload section default
    assert caught == []


def test_deepspeed_legacy_pin_memory_key_is_ignored_as_deepspeed_ignores_it():
    zero = {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}
    config, caught = _load_ds({"zero_optimization": zero})
    assert config.offload_optimizer == "cpu" and config.pin_memory is False
    assert len(caught) == 1
    message, category = caught[0]
    assert category is DeepSpeedKeyIgnoredWarning
    assert "'zero_optimization.cpu_offload_use_pin_memory' ignored" in message
    assert "no effect either" in message


@pytest.mark.parametrize(
    ("ds", "fragment"),
    [
        (
            {"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {}}},
            "zero_optimization.cpu_offload and zero_optimization.offload_optimizer are both",
        ),
        ({"zero_optimization": {"stage": 2, "cpu_offload": "yes"}}, "expected true or false"),
        (
            {"zero_optimization": {"stgae": 3}},
            "unknown DeepSpeed key 'zero_optimization.stgae'; did you mean 'stage'?",
        ),
        (
            {"zero_optimization": {"stage": 3, "offlaod_param": {"device": "cpu"}}},
            "'zero_optimization.offlaod_param'; did you mean 'offload_param'?",
        ),
        (
            {"zero_optimization": {"stage": 3, "cpu_offload_params": True}},
            "did you mean 'cpu_offload_param'?",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"pin_memroy": True}}},
            "'zero_optimization.offload_param.pin_memroy'; did you mean 'pin_memory'?",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pinned": 1}}},
            "'zero_optimization.offload_param.pinned'; accepted keys: buffer_count, "
            "buffer_size, device, max_in_cpu, nvme_path, pin_memory",
        ),
        (
            {"zero_optimization": {"stage": 3, "aio": {"block_size": 262144}}},
            "'aio' is a top-level DeepSpeed section: move it out of 'zero_optimization'",
        ),
        (
            {"zero_optimisation": {"stage": 3}},
            "unknown DeepSpeed section 'zero_optimisation'; did you mean 'zero_optimization'?",
        ),
        (
            {"zero_optimization": {"stage": 1}, "train_batch_sise": 8},
            "did you mean 'train_batch_size'?",
        ),
    ],
)
def test_deepspeed_typos_and_conflicts_are_errors(ds, fragment):
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_deepspeed(ds)
    assert fragment in str(info.value)


def test_deepspeed_unrelated_top_level_key_is_still_only_ignored():
    config, caught = _load_ds({"zero_optimization": {"stage": 1}, "my_launcher_notes": "x"})
    assert config.stage == 1
    assert caught == [
        (
            "DeepSpeed key 'my_launcher_notes' ignored: it has no counterpart in ZeroConfig",
            DeepSpeedKeyIgnoredWarning,
        )
    ]


def test_deepspeed_auto_from_hidden_size_as_the_hf_trainer():
    """transformers/integrations/deepspeed.py, trainer_config_finalize: reduce_bucket_size
    = h*h; at stage 3 stage3_prefetch_bucket_size = 0.9*h*h and
    stage3_param_persistence_threshold = 10*h."""
    zero = {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ZeroConfig.from_deepspeed({"zero_optimization": zero}, hidden_size=1024)
    assert caught == []
    assert config.reduce_bucket_size == 1024 * 1024
    assert config.prefetch_bucket_size == 943_718  # int(0.9 * 1024 * 1024)
    assert config.persistence_threshold == 10_240
    # Below stage 3 the HF Trainer fills only reduce_bucket_size; the stage-3 keys keep
    # DeepSpeed's (= our) defaults, with the "auto" warning.
    stage2 = {**zero, "stage": 2}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ZeroConfig.from_deepspeed({"zero_optimization": stage2}, hidden_size=1024)
    assert config.reduce_bucket_size == 1024 * 1024
    assert (config.prefetch_bucket_size, config.persistence_threshold) == (50_000_000, 100_000)
    assert len(caught) == 2
    with pytest.raises(ZeroConfigError, match="hidden_size=0 is invalid"):
        ZeroConfig.from_deepspeed({"zero_optimization": zero}, hidden_size=0)
