"""Tests for zero_runtime.estimator against values worked by hand from the ZeRO paper."""

from __future__ import annotations

import ast
import pathlib

import pytest

from zero_runtime.config import ZeroConfig, ZeroConfigError
from zero_runtime.estimator import (
    OPTIMIZER_STATE_BYTES,
    TierEstimate,
    activation_bytes,
    estimate,
    estimate_for_config,
    estimate_for_model,
    optimizer_kind,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
GB = 10**9  # the paper's GB

PSI, ND = 7_500_000_000, 64  # the paper's example (Figure 1)


# -- the paper's own example ------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "exact_bytes", "paper_gb"),
    [
        (0, 120_000_000_000, 120.0),  # (2 + 2 + 12) * 7.5e9
        (1, 31_406_250_000, 31.4),  # 4 * 7.5e9 + 12 * 7.5e9 / 64
        (2, 16_640_625_000, 16.6),  # 2 * 7.5e9 + 14 * 7.5e9 / 64
        (3, 1_875_000_000, 1.9),  # 16 * 7.5e9 / 64
    ],
)
def test_paper_example_figure_1(stage, exact_bytes, paper_gb):
    result = estimate(PSI, ND, stage, precision="mixed", optimizer="adam")
    assert result.device_bytes == exact_bytes
    assert round(result.device_bytes / GB, 1) == paper_gb
    assert result.host_bytes == 0 and result.nvme_bytes == 0
    assert result.total_bytes == exact_bytes
    assert all(isinstance(v, int) for v in (result.device_bytes, result.host_bytes))


def test_paper_example_breakdown_stage_2():
    b = estimate(PSI, ND, 2).breakdown
    assert b["params"] == {
        "tier": "device",
        "bytes": 15_000_000_000,
        "bytes_per_param": 2,
        "elements": PSI,
        "divisor": 1,
    }
    assert b["grads"]["bytes"] == 234_375_000 and b["grads"]["divisor"] == 64
    assert b["optimizer_states"]["bytes"] == 1_406_250_000
    assert b["optimizer_states"]["bytes_per_param"] == 12


# -- other hand-worked combinations ------------------------------------------------------


@pytest.mark.parametrize(
    ("psi", "nd", "stage", "precision", "expected"),
    [
        # mixed, Ψ = 1e9, N_d = 8: 16e9 | 4e9 + 12e9/8 | 2e9 + 14e9/8 | 16e9/8
        (10**9, 8, 0, "mixed", 16 * 10**9),
        (10**9, 8, 1, "mixed", 5_500_000_000),
        (10**9, 8, 2, "mixed", 3_750_000_000),
        (10**9, 8, 3, "mixed", 2 * 10**9),
        # fp32 (4 + 4 + 8), Ψ = 1e9, N_d = 4: 16e9 | 8e9 + 8e9/4 | 4e9 + 12e9/4 | 16e9/4
        (10**9, 4, 0, "fp32", 16 * 10**9),
        (10**9, 4, 1, "fp32", 10 * 10**9),
        (10**9, 4, 2, "fp32", 7 * 10**9),
        (10**9, 4, 3, "fp32", 4 * 10**9),
        # fp32, the paper's Ψ and N_d: 60e9 + 60e9/64 at stage 1
        (PSI, ND, 1, "fp32", 60_000_000_000 + 937_500_000),
        # N_d = 1: partitioning changes nothing
        (1_000, 1, 3, "mixed", 16_000),
        # Ψ = 10, N_d = 3: each shard is ceil(10/3) = 4 elements -> 16 * 4 bytes
        (10, 3, 3, "mixed", 64),
        (10, 3, 1, "fp32", 80 + 8 * 4),
    ],
)
def test_hand_worked_values(psi, nd, stage, precision, expected):
    assert estimate(psi, nd, stage, precision=precision).device_bytes == expected


@pytest.mark.parametrize(
    ("optimizer", "precision", "k"),
    [
        ("adam", "mixed", 12),
        ("adamw", "mixed", 12),
        ("adam", "fp32", 8),
        ("sgd_momentum", "mixed", 8),
        ("sgd_momentum", "fp32", 4),
        ("sgd", "mixed", 4),
        ("sgd", "fp32", 0),
    ],
)
def test_optimizer_state_bytes(optimizer, precision, k):
    assert OPTIMIZER_STATE_BYTES[optimizer][precision] == k
    # stage 0, Ψ = 1000: (p + g + K) * 1000 with p = g = 2 (mixed) or 4 (fp32)
    pg = 4 if precision == "mixed" else 8
    assert estimate(1_000, 2, 0, precision=precision, optimizer=optimizer).device_bytes == (
        (pg + k) * 1_000
    )


# -- offload ----------------------------------------------------------------------------


def test_offload_stage_3_optimizer_cpu_param_nvme():
    result = estimate(PSI, ND, 3, offload_optimizer="cpu", offload_param="nvme")
    assert result.device_bytes == 234_375_000  # 2Ψ/64 gradients stay on the device
    assert result.host_bytes == 1_406_250_000  # 12Ψ/64
    assert result.nvme_bytes == 234_375_000  # 2Ψ/64
    assert result.total_bytes == 1_875_000_000  # offload moves bytes, it does not add any
    assert result.breakdown["params"]["tier"] == "nvme"
    assert result.breakdown["optimizer_states"]["tier"] == "host"


def test_offload_stage_2_optimizer_nvme():
    result = estimate(PSI, ND, 2, offload_optimizer="nvme")
    assert result.device_bytes == 15_000_000_000 + 234_375_000
    assert (result.host_bytes, result.nvme_bytes) == (0, 1_406_250_000)


def test_offload_stage_0_moves_the_whole_optimizer_state():
    result = estimate(1_000_000, 8, 0, offload_optimizer="cpu", precision="fp32")
    assert result.device_bytes == 8_000_000  # 4Ψ + 4Ψ
    assert result.host_bytes == 8_000_000  # 8Ψ, not partitioned at stage 0


def test_offload_both_to_cpu_fp32_sgd_momentum():
    result = estimate(1_000_000, 4, 3, "cpu", "cpu", precision="fp32", optimizer="sgd_momentum")
    # params 4Ψ/4 + momentum 4Ψ/4 on host; grads 4Ψ/4 on device
    assert (result.device_bytes, result.host_bytes, result.nvme_bytes) == (
        1_000_000,
        2_000_000,
        0,
    )


def test_estimate_for_config_uses_stage_and_offloads():
    config = ZeroConfig(stage=3, offload_optimizer="cpu", offload_param="cpu")
    result = estimate_for_config(PSI, ND, config)
    assert (result.device_bytes, result.host_bytes) == (234_375_000, 1_640_625_000)
    default = estimate_for_config(PSI, ND, ZeroConfig())  # stage 1, optimizer on the host
    assert default.device_bytes == 30_000_000_000
    assert default.host_bytes == 1_406_250_000


def test_estimate_for_config_ignores_offload_optimizer_at_stage_0():
    # ZeroConfig's default offload_optimizer is 'cpu'; at stage 0 the runtime keeps the
    # states on the device (docs/config.md), so the prediction must too: 16 bytes per
    # parameter on the device (4 + 4 + 8, SC20 fp32 Adam), none on the host.
    result = estimate_for_config(1000, 2, ZeroConfig(stage=0), precision="fp32")
    assert (result.device_bytes, result.host_bytes, result.nvme_bytes) == (16_000, 0, 0)


def test_tier_estimate_accessors():
    result = estimate(100, 2, 1, offload_optimizer="nvme")
    assert result.bytes_on("device") == 400 and result.bytes_on("nvme") == 600
    with pytest.raises(ValueError, match="tier='gpu' is invalid"):
        result.bytes_on("gpu")
    as_dict = result.to_dict()
    assert as_dict["total_bytes"] == 1_000
    assert set(as_dict) == {"device_bytes", "host_bytes", "nvme_bytes", "total_bytes", "breakdown"}


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"num_params": 0}, ValueError, "num_params=0 is invalid"),
        ({"num_params": True}, ValueError, "num_params=True"),
        ({"num_params": 1.5e9}, ValueError, "num_params=1500000000.0"),
        ({"num_replicas": 0}, ValueError, "num_replicas=0"),
        ({"stage": 4}, ValueError, "stage=4 is invalid"),
        ({"stage": True}, ValueError, "stage=True"),
        ({"precision": "fp16"}, ValueError, "precision='fp16' is invalid: expected one of"),
        ({"optimizer": "lamb"}, ValueError, "optimizer='lamb'"),
        ({"offload_optimizer": "gpu"}, ValueError, "offload_optimizer='gpu'"),
        ({"offload_param": "cpu"}, ZeroConfigError, "requires stage 3"),
    ],
)
def test_invalid_inputs(kwargs, error, fragment):
    args = {"num_params": 1_000, "num_replicas": 2, "stage": 1, **kwargs}
    with pytest.raises(error) as info:
        estimate(**args)
    assert fragment in str(info.value)


# -- Keras models -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def keras():
    return pytest.importorskip("keras")


@pytest.fixture(scope="module")
def model(keras):
    """Ψ = 3556: Dense(64) 1088, BatchNorm(64) 256 (128 non-trainable), Dense(32) 2080,
    Dense(4) 132. Trainable: 3428."""
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, name="d64"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(32, name="d32"),
            keras.layers.Dense(4, name="d4"),
        ]
    )


def test_model_stage_1_fp32(model):
    result = estimate_for_model(model, ZeroConfig(stage=1, offload_optimizer="none"), 2)
    assert (result.num_params, result.trainable_params) == (3_556, 3_428)
    assert (result.largest_block_params, result.largest_block_name) == (2_080, "d32")
    assert result.persistent_params == 0 and result.working_set_bytes == 0
    # params 4 * 3556 + grads 4 * 3428 + Adam fp32 8 * ceil(3428 / 2)
    assert result.tiers.device_bytes == 14_224 + 13_712 + 13_712
    assert result.tiers.host_bytes == 0


def test_model_stage_3_persistence_and_working_set(model):
    config = ZeroConfig(stage=3, offload_optimizer="none", persistence_threshold=100)
    result = estimate_for_model(model, config, 2, precision="fp32", optimizer="adam")
    # Weights under 100 elements stay replicated: biases 64 + 32 + 4, BatchNorm 4 * 64.
    assert result.persistent_params == 356
    b = result.tiers.breakdown
    assert b["params"]["bytes"] == 4 * 1_600  # 3200 partitioned elements over 2 replicas
    assert b["persistent_params"]["bytes"] == 4 * 356
    assert b["grads"]["bytes"] == 4 * 1_714  # ceil(3428 / 2)
    assert b["optimizer_states"]["bytes"] == 8 * 1_714
    # Gathered (partitioned) elements per block: [1024, 0, 2048, 128]; worst consecutive
    # pair: d32 gathered + d4 prefetched = 2176 elements, 4 bytes each.
    assert result.working_set_bytes == 8_704
    assert b["working_set"]["bytes"] == 8_704
    assert result.tiers.device_bytes == 6_400 + 1_424 + 6_856 + 13_712 + 8_704


def test_model_prefetch_bucket_caps_the_prefetched_block(model):
    config = ZeroConfig(
        stage=3,
        offload_optimizer="cpu",
        offload_param="cpu",
        persistence_threshold=100,
        prefetch_bucket_size=100,
    )
    result = estimate_for_model(model, config, 2, precision="mixed")
    assert result.working_set_bytes == 2 * (2_048 + 100)
    # mixed: params 2 * 1600 on host, Adam 12 * 1714 on host; the rest on the device
    assert result.tiers.host_bytes == 3_200 + 20_568
    assert result.tiers.device_bytes == 2 * 356 + 2 * 1_714 + 4_296


def test_model_optimizer_inferred_from_compile(keras):
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(10)])  # Ψ = 110
    config = ZeroConfig(stage=0, offload_optimizer="none")
    assert estimate_for_model(model, config, 1).tiers.device_bytes == 16 * 110  # adam
    model.compile(optimizer=keras.optimizers.SGD(momentum=0.9), loss="mse")
    assert estimate_for_model(model, config, 1).tiers.device_bytes == 12 * 110
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    assert estimate_for_model(model, config, 1).tiers.device_bytes == 8 * 110
    model.compile(optimizer=keras.optimizers.RMSprop(), loss="mse")  # K = 4: mean square
    assert estimate_for_model(model, config, 1).tiers.device_bytes == 12 * 110
    model.compile(optimizer=keras.optimizers.Adafactor(), loss="mse")  # K = 4: velocity
    assert estimate_for_model(model, config, 1).tiers.device_bytes == 12 * 110
    model.compile(optimizer=keras.optimizers.Ftrl(), loss="mse")
    with pytest.raises(ValueError, match="cannot infer the optimizer-state size of Ftrl"):
        estimate_for_model(model, config, 1)
    assert estimate_for_model(model, config, 1, optimizer="sgd").tiers.device_bytes == 880


def test_activation_bytes_are_the_tensors_kept_for_backward(keras):
    """Dense(16, relu) -> Dense(4), batch 2: the backward reads the relu output (ReluGrad
    and the second MatMul's gradient, one tensor of 2 x 16 float32 = 128 B); the input
    placeholder and the weights are not activations. With the per-unit recompute
    (stage 3) the kept inputs are the first layer's float input (2 x 8 x 4 = 64 B) while
    it recomputes its 128 B, then both inputs (64 + 128 B)."""
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)]
    )
    assert activation_bytes(model, (2, 8)) == 2 * 16 * 4
    assert activation_bytes(model, (2, 8), checkpoint_units=True) == 2 * 8 * 4 + 2 * 16 * 4
    assert activation_bytes(model, (6, 8)) == 3 * 128  # linear in the batch
    config = ZeroConfig(stage=1, offload_optimizer="none")
    with_act = estimate_for_model(model, config, 2, batch_shape=(2, 8))
    states = estimate_for_model(model, config, 2)
    assert with_act.activation_bytes == 128
    assert with_act.tiers.device_bytes == states.tiers.device_bytes + 128
    assert with_act.tiers.breakdown["activations"]["bytes"] == 128
    with pytest.raises(ValueError, match="batch_shape"):
        activation_bytes(model, (0, 8))


def test_optimizer_kind(keras):
    assert optimizer_kind(keras.optimizers.Adam()) == "adam"
    assert optimizer_kind(keras.optimizers.AdamW()) == "adamw"
    with pytest.raises(ValueError, match="amsgrad"):
        optimizer_kind(keras.optimizers.Adam(amsgrad=True))


def test_model_without_weights_is_rejected(keras):
    with pytest.raises(ValueError, match="model has no weights"):
        estimate_for_model(keras.Sequential([]), ZeroConfig(), 1)


# -- import hygiene ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "module", ["config/__init__.py", "estimator/__init__.py", "cli/__init__.py"]
)
def test_module_does_not_import_a_framework_at_import_time(module):
    tree = ast.parse((REPO / "zero_runtime" / module).read_text(encoding="utf-8"))
    top_level = set()
    for node in tree.body:  # module-level statements only; TYPE_CHECKING blocks are ifs
        if isinstance(node, ast.Import):
            top_level.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            top_level.add((node.module or "").split(".")[0])
    assert not top_level & {"tensorflow", "keras", "numpy", "tb_plugin"}


def test_tier_estimate_is_frozen():
    result = estimate(10, 1, 0)
    assert isinstance(result, TierEstimate)
    with pytest.raises(AttributeError):
        result.device_bytes = 0  # type: ignore[misc]


# -- SC21 accounting of a Keras model ---------------------------------------------------


def test_model_sc21_stage_3_working_memory_gathers_params_and_grads(model):
    config = ZeroConfig(stage=3, offload_optimizer="cpu", persistence_threshold=100)
    result = estimate_for_model(model, config, 2, precision="fp32", accounting="sc21")
    # Gathered (partitioned) elements per unit: [1024, 0, 2048, 128], all trainable; the
    # worst unit is d32: params 4 * 2048 + grads 4 * 2048 + prefetched d4 4 * 128.
    assert result.working_set_bytes == 8 * 2_048 + 4 * 128
    b = result.tiers.breakdown
    assert "grads" not in b  # under optimizer offload the gradient partition is on the host
    assert b["fp32_grads"]["tier"] == "host" and b["fp32_grads"]["bytes"] == 4 * 1_714
    assert result.tiers.device_bytes == 4 * 1_600 + 4 * 356 + 16_896
    assert result.tiers.host_bytes == 4 * 1_714 + 8 * 1_714


def test_model_page_rounding_is_per_unit_and_once_for_packed_stage3_params(model):
    config = ZeroConfig(stage=3, offload_optimizer="cpu", offload_param="cpu")
    config = config.replace(persistence_threshold=100, page_size_bytes=64 * 1024)
    result = estimate_for_model(model, config, 2, page_rounding=True, accounting="sc21")
    page = 64 * 1024
    b = result.tiers.breakdown
    # Partitioned params of units d64, bn, d32, d4: [1024, 0, 2048, 128], packed in one
    # flat space per replica (4 * 3200 / 2 bytes: one page); trainable units [1088, 128,
    # 2080, 132] -> 4 pages each term.
    assert b["params"]["bytes"] == page
    assert b["optimizer_states"]["bytes"] == 4 * page
    assert b["fp32_grads"]["bytes"] == 4 * page
    assert result.tiers.host_bytes == 9 * page


def test_build_model_abstractly_allocates_no_weights(keras):
    from tests.helpers.estimate_models import wide
    from zero_runtime.estimator import build_model_abstractly

    built = build_model_abstractly(wide)
    shapes = [tuple(v.shape) for v in built.weights]
    assert shapes == [(1_000, 200_000), (200_000,), (200_000, 10), (10,)]
    assert all(v._value is None for v in built.weights)  # deferred: never initialised
    result = estimate_for_model(built, ZeroConfig(stage=2, offload_optimizer="none"), 4)
    assert (result.num_params, result.largest_block_name) == (202_200_010, "wide")
    with pytest.raises(ValueError, match="returned int, expected a keras.Model"):
        build_model_abstractly(lambda: 3)
    with pytest.raises(ValueError, match="without weights"):
        build_model_abstractly(lambda: keras.Sequential([]))


def test_mixed_policy_counts_float32_states_and_a_cast_copy(keras):
    from tests.helpers.estimate_models import small_mixed
    from zero_runtime.estimator import build_model_abstractly, policy_precision

    built = build_model_abstractly(small_mixed)
    config = ZeroConfig(stage=1, offload_optimizer="none")
    result = estimate_for_model(built, config, 2, precision=None, accounting="sc21")
    assert (result.precision, result.compute_bytes) == ("fp32", 2)
    # float32 variables: 4 + 4 + 8 bytes per parameter (Ψ = 3432), stage 1; the working
    # memory is the bfloat16 cast of the largest unit (d32, 2080 elements).
    assert result.working_set_bytes == 2 * 2_080
    assert result.tiers.device_bytes == 8 * 3_432 + 8 * 1_716 + 4_160
    assert policy_precision(keras.DTypePolicy("mixed_float16")) == ("fp32", 2)
    with pytest.raises(ValueError, match="keeps bfloat16 variables"):
        policy_precision(keras.DTypePolicy("bfloat16"))


def test_choices_and_smallest_fit():
    from zero_runtime.estimator import CHOICES, Budgets, estimate_choices, smallest_fit

    assert len(CHOICES) == 18 and CHOICES[0] == (0, "none", "none")
    assert CHOICES[-1] == (3, "nvme", "nvme")

    def one(stage, opt, param):
        return estimate(10**9, 8, stage, opt, param, precision="mixed", accounting="sc21")

    rows = estimate_choices(one, Budgets(device_bytes=3 * 10**9, host_bytes=10**10))
    best = smallest_fit(rows)
    # No offload: stage 2 needs 2e9 + 18e9/8 = 4.25e9 > 3e9; stage 3 2.5e9 fits.
    assert (best["stage"], best["offload_optimizer"], best["offload_param"]) == (3, "none", "none")
    assert rows[2]["shortfall"] == {"device": 1_250_000_000}
    tight = estimate_choices(one, Budgets(device_bytes=10**6, host_bytes=10**6, nvme_bytes=10**6))
    assert smallest_fit(tight) is None
    # Host and NVMe budgets are per process: 4 local replicas need 4x the host bytes.
    per_process = Budgets(host_bytes=2 * 10**9, local_replicas=4)
    assert per_process.shortfall(one(3, "cpu", "none")) == {"host": 8 * 10**9 - 2 * 10**9}
    with pytest.raises(ValueError, match="device_bytes=0 is invalid"):
        Budgets(device_bytes=0)


@pytest.mark.parametrize(
    ("shape", "page", "n"),
    [((50_000, 256), 4 * 2**20, 2), ((1_000, 64), 65_536, 4), ((3, 10), 65_536, 2)],
)
def test_row_cache_bytes_is_the_engines_row_cache(shape, page, n):
    from zero_runtime.estimator import row_cache_bytes
    from zero_runtime.stage3.embedding import row_paging_budget

    budget = row_paging_budget(shape, page, n, local=1)
    assert row_cache_bytes(shape, page, n) == budget.cache_pages * page


def test_stage_3_row_paged_embedding_is_not_gathered(keras):
    from zero_runtime.estimator import build_model_abstractly, row_cache_bytes

    def factory():
        return keras.Sequential(
            [
                keras.Input((8,), dtype="int32"),
                keras.layers.Embedding(50_000, 256, name="emb"),  # 12.8M >= 10M threshold
                keras.layers.Dense(64, name="d"),  # 16_448
            ]
        )

    model = build_model_abstractly(factory)
    config = ZeroConfig(stage=3, offload_optimizer="cpu", offload_param="cpu")
    config = config.replace(persistence_threshold=0)
    result = estimate_for_model(model, config, 2, accounting="sc21")
    b = result.tiers.breakdown
    # Only 'd' is gathered (params + grads, fp32); the table stays in row pages.
    assert result.working_set_bytes == 8 * 16_448
    assert b["row_cache"]["bytes"] == row_cache_bytes((50_000, 256), 4 * 2**20, 2)
    assert b["row_cache"]["bytes"] == 2 * 4 * 2**20  # 7 row pages a shard -> the 2-page minimum
    # Below the threshold the embedding is an ordinary gathered unit.
    small = config.replace(embedding_row_paging_threshold=20_000_000)
    plain = estimate_for_model(model, small, 2, accounting="sc21")
    assert plain.working_set_bytes == 8 * 12_800_000 + 4 * 16_448
    assert "row_cache" not in plain.tiers.breakdown


def test_runtime_estimate_names_what_the_psi_only_prediction_does_not_model():
    """The demo's ZeRO-Infinity run (stage 3, both offloads on NVMe) measures about 20 MiB
    on the host where the Ψ-only figures predict 0, and NVMe above its prediction. The
    estimate event says what the Ψ-only figures leave out: the pool's host window for NVMe
    pages, page rounding, and stage 3's gathered units and update in backward."""
    from zero_runtime.runtime.accounting import not_modelled

    nvme = ZeroConfig(
        stage=3, offload_param="nvme", offload_optimizer="nvme", nvme_path="/tmp",
        page_size_bytes=262144,
    )  # fmt: skip
    gaps = not_modelled(nvme)
    assert set(gaps) == {"device", "host", "nvme"}
    assert any("host window for NVMe pages" in g for g in gaps["host"])
    assert any("256 KiB" in g and "page rounding" in g for g in gaps["nvme"])
    assert any("in-step spill" in g for g in gaps["nvme"])  # the 263% in-step peak
    assert any("update in backward" in g for g in gaps["device"])
    # A host budget set by the user replaces the window: not named then.
    assert "host" not in not_modelled(nvme.replace(host_budget_bytes=64 << 20))
    # Stages 0-2 on the device: the estimator's model is the measured one.
    assert not_modelled(ZeroConfig(stage=1)) == {}
    assert not_modelled(ZeroConfig(stage=0)) == {}
