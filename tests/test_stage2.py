"""ZeRO stages 0-2 x optimizer tiers x optimizers: parity with MirroredStrategy + Keras,
gradient accumulation, the device-memory ratio the ZeRO accounting predicts, and the
mirrored fallback.

One small model (embedding, dense, layer norm, a frozen layer) and one data set are
shared by every case; each reference run (MirroredStrategy with Keras's own optimizer,
given dense gradients) is made once per optimizer. Parity bound: 1e-6 relative (with an
absolute floor of 1e-7 for weights that are ~0).
"""

from __future__ import annotations

import functools
import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers.mirrored import Mirrored
from helpers.reference_optimizers import DenseGradAdam, DenseGradAdamW, DenseGradSGD

import zero_runtime
from tb_plugin import metadata
from zero_runtime import estimator
from zero_runtime.optim import partitioned
from zero_runtime.optim.device_state import DeviceOptimizerState
from zero_runtime.optim.host_state import HostOptimizerState
from zero_runtime.optim.nvme_state import NvmeOptimizerState

STEPS = 20
BATCH = 16  # global batch per step
RTOL, ATOL = 1e-6, 1e-7
BUCKET = 300  # elements: the model (933 trainable params) reduces in 3 buckets


def _model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    frozen = keras.layers.Dense(10, name="frozen")
    frozen.trainable = False
    return keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(40, 6, name="embed"),  # (B, 5, 6)
            keras.layers.Flatten(),  # (B, 30)
            keras.layers.Dense(20, activation="relu", name="hidden"),
            keras.layers.LayerNormalization(name="norm"),
            frozen,
            keras.layers.Dense(3, name="head"),
        ]
    )


@functools.cache
def _data(n: int = STEPS * BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(11)
    x = rng.randint(0, 40, size=(n, 5)).astype("int32")
    y = (x.sum(axis=1) % 3).astype("int32")
    return x, y


def _kwargs(name: str) -> dict:
    """Each optimizer with the Keras features that must behave as Keras's own."""
    if name == "adam":  # learning-rate schedule + clipping by global norm
        lr = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=4, decay_rate=0.7)
        return {"learning_rate": lr, "global_clipnorm": 0.5}
    if name == "adamw":  # decoupled weight decay
        return {"learning_rate": 0.01, "weight_decay": 0.05}
    return {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True, "clipvalue": 0.05}


_Mirrored = Mirrored


REFERENCE = {"adam": DenseGradAdam, "adamw": DenseGradAdamW, "sgd": DenseGradSGD}


def _fit(strategy, make_optimizer, batch: int = BATCH, steps: int = STEPS):
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).take(steps)
    with strategy.scope():
        model = _model()
        model.compile(
            optimizer=make_optimizer(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    losses: list[float] = []
    cb = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"]))
    )
    model.fit(ds, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    return losses, model


@pytest.fixture(scope="module")
def reference(cpu_devices):
    cache: dict = {}

    def get(name: str, batch: int = BATCH, steps: int = STEPS):
        key = (name, batch, steps)
        if key not in cache:
            strategy = _Mirrored(cpu_devices)
            losses, model = _fit(strategy, lambda: REFERENCE[name](**_kwargs(name)), batch, steps)
            cache[key] = (losses, model.get_weights())
        return cache[key]

    return get


def _max_rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), ATOL / RTOL)))


CASES = [(0, "none", o) for o in ("adam", "adamw", "sgd")] + [
    (s, t, o) for s in (1, 2) for t in ("none", "cpu", "nvme") for o in ("adam", "adamw", "sgd")
]
STORE = {"none": DeviceOptimizerState, "cpu": HostOptimizerState, "nvme": NvmeOptimizerState}


@pytest.mark.parametrize(
    ("stage", "tier", "opt"), CASES, ids=[f"s{s}-{t}-{o}" for s, t, o in CASES]
)
def test_parity_with_mirrored(stage, tier, opt, reference, tmp_path):
    config = {
        "stage": stage,
        "offload_optimizer": tier,
        "reduce_bucket_size": BUCKET,
        "nvme_path": str(tmp_path),
        "sub_group_size": 250,  # several sub-groups per shard: streaming with read-ahead
        "page_size_bytes": 65536,
    }
    strategy = zero_runtime.ZeroInfinityStrategy(config)
    if stage == 0:  # plain mirrored: the stock (here: densifying) Keras optimizer
        make = lambda: REFERENCE[opt](**_kwargs(opt))  # noqa: E731
    else:
        make = lambda: partitioned.PARTITIONED_BY_NAME[opt](**_kwargs(opt))  # noqa: E731
    losses, model = _fit(strategy, make)
    weights = model.get_weights()
    ref_losses, ref_weights = reference(opt)
    if stage:
        zs = model.optimizer.zero_state
        assert zs.stage == stage
        assert isinstance(zs.store, STORE[tier])
        assert len(zs.layout.buckets) > 1
        if stage == 2:
            assert zs.group is not None and zs.group.reduce_scatter_impl == "all_to_all"
        if tier == "nvme":
            assert zs.store.num_subgroups > 1
            assert zs.store.usage()["nvme"][0] > 0  # the states were written to NVMe
    strategy.close()
    assert len(losses) == STEPS
    assert ref_losses[-1] < ref_losses[0]  # the model trained
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=0)
    worst = max(_max_rel(w, r) for w, r in zip(weights, ref_weights))
    print(f"stage={stage} tier={tier} opt={opt}: max rel weight diff {worst:.3g}")
    for w, r in zip(weights, ref_weights):
        np.testing.assert_allclose(w, r, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_equals_larger_batch(stage, reference):
    """N=4 micro-batches of 16 == one step on a batch of 64 (schedule, decay, bias steps)."""
    n = 4
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": stage,
            "offload_optimizer": "cpu",
            "gradient_accumulation_steps": n,
            "reduce_bucket_size": BUCKET,
        }
    )

    def make():
        kw = _kwargs("adamw")
        kw["learning_rate"] = keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.7)
        return partitioned.AdamW(**kw)

    _, model = _fit(strategy, make, batch=BATCH, steps=STEPS)
    strategy.close()
    ref_strategy = _Mirrored(strategy.extended.worker_devices)

    def make_ref():
        kw = _kwargs("adamw")
        kw["learning_rate"] = keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.7)
        return DenseGradAdamW(**kw)

    _, ref_model = _fit(ref_strategy, make_ref, batch=BATCH * n, steps=STEPS // n)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    assert model.optimizer.zero_state.store.updates(0) == STEPS // n
    moved = False
    for w, r, w0 in zip(model.get_weights(), ref_model.get_weights(), _model().get_weights()):
        np.testing.assert_allclose(w, r, rtol=RTOL, atol=ATOL)
        moved |= not np.allclose(w, w0)
    assert moved


def _allocator_bytes() -> int:
    return int(tf.config.experimental.get_memory_info("CPU:0")["current"])


def _big_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [keras.Input((512,)), keras.layers.Dense(1024, name="a"), keras.layers.Dense(512)]
    )


def _fit_big(strategy, make_optimizer) -> tuple[keras.Model, int]:
    """Fit the big model 4 steps; returns it and the allocator bytes still held relative
    to before the model existed."""
    rng = np.random.RandomState(0)
    x = rng.standard_normal((32, 512)).astype("float32")
    y = rng.standard_normal((32, 512)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    before = _allocator_bytes()
    with strategy.scope():
        model = _big_model()
        model.compile(optimizer=make_optimizer(), loss="mse")
    model.fit(ds, verbose=0, shuffle=False)
    return model, _allocator_bytes() - before


def _device_model_state_bytes(model: keras.Model) -> dict[str, int]:
    """Bytes of the live device buffers holding model states, over all local replicas.

    Every per-device copy of the parameters and of Keras's optimizer variables (mirrored
    variables: one buffer per replica device), the ZeRO optimizer's device state shards and
    its gradient accumulators.
    """

    def per_device(v) -> int:
        v = v.value if isinstance(v, keras.Variable) else v
        copies = getattr(v, "values", None) or (v,)
        return sum(int(np.prod(c.shape)) * c.dtype.size for c in copies)

    opt = model.optimizer
    out = {"params": sum(per_device(v) for v in model.trainable_variables)}
    slots = [v for v in opt.variables if "momentum" in v.path or "velocity" in v.path]
    out["optimizer_states"] = sum(per_device(v) for v in slots)
    out["grads"] = 0
    zs = getattr(opt, "_zero", None)
    if zs is not None:
        out["optimizer_states"] += zs.store.usage().get("device", (0, 0))[0]
        out["grads"] = zs.accumulator_bytes
    return out


def _device_terms(params: int, n: int, stage: int, offload: str) -> dict[str, int]:
    est = estimator.estimate(
        params, n, stage=stage, offload_optimizer=offload, precision="fp32", optimizer="adam"
    ).to_dict()["breakdown"]
    return {k: v["bytes"] if v["tier"] == "device" else 0 for k, v in est.items()}


def test_stage2_cpu_offload_device_bytes_match_zero_accounting():
    """Device bytes of model states held, stage 2 + cpu offload vs stage 0.

    Measured by inventory of the live device buffers (every replica's copy), not from the
    formulas. Between steps neither run holds gradients (Keras frees them; stage 0's only
    way to keep them, Keras's own ``gradient_accumulation_steps``, fails under
    MirroredStrategy with "merge_call called while defining a new graph"), so the ratio
    compared is params + optimizer states: the ZeRO accounting predicts
    4Ψ / (4Ψ + 8Ψ) = 1/3. The gradient term of stage 2 is measured with 2-step
    accumulation, where the replica keeps only its reduced shard: 4Ψ / N_d (section 5.2).
    The allocator (BFC) reading of the stage-2 run is printed beside it (it also holds
    the data pipeline's and the step's cached buffers, so it is not asserted).
    """
    s0 = zero_runtime.ZeroInfinityStrategy({"stage": 0})
    m0, _ = _fit_big(s0, lambda: keras.optimizers.Adam(1e-3))
    s0.close()
    s2 = zero_runtime.ZeroInfinityStrategy({"stage": 2, "offload_optimizer": "cpu"})
    m2, alloc2 = _fit_big(s2, lambda: "adam")
    s2.close()
    s2a = zero_runtime.ZeroInfinityStrategy(
        {"stage": 2, "offload_optimizer": "cpu", "gradient_accumulation_steps": 2}
    )
    m2a, _ = _fit_big(s2a, lambda: "adam")
    s2a.close()
    params, n = m0.count_params(), s2.num_replicas_in_sync
    held0, held2, held2a = map(_device_model_state_bytes, (m0, m2, m2a))
    t0, t2 = _device_terms(params, n, 0, "none"), _device_terms(params, n, 2, "cpu")
    predicted = (t2["params"] + t2["optimizer_states"]) / (t0["params"] + t0["optimizer_states"])
    measured = (held2["params"] + held2["optimizer_states"]) / (
        held0["params"] + held0["optimizer_states"]
    )
    print(
        f"device model-state bytes: stage0 {held0} stage2+cpu {held2} ratio {measured:.4f} "
        f"predicted {predicted:.4f}; stage-2 accumulated gradient {held2a['grads']} "
        f"predicted {n * t2['grads']}; allocator held at stage 2: {alloc2}"
    )
    assert held0["params"] == n * 4 * params and held0["optimizer_states"] == n * 8 * params
    assert predicted == pytest.approx(1 / 3, rel=1e-3)
    assert measured == pytest.approx(predicted, rel=0.10)
    assert held2a["grads"] == pytest.approx(n * t2["grads"], rel=0.10)


def test_small_model_falls_back_to_mirrored(tmp_path, reference):
    """Below mirrored_fallback_bytes: the stock Keras update, and run_info says so."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    strategy = zero_runtime.ZeroInfinityStrategy(
        {"stage": 2, "mirrored_fallback_bytes": 10**9}, logdir=str(tmp_path)
    )
    losses, model = _fit(strategy, lambda: "sgd")
    strategy.close()
    opt = model.optimizer
    assert isinstance(opt, partitioned.SGD) and opt.fallback_mirrored
    assert strategy.runtime.fallback_mirrored is True
    ref_strategy = _Mirrored(strategy.extended.worker_devices)
    ref_losses, ref_model = _fit(ref_strategy, lambda: keras.optimizers.SGD())
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for w, r in zip(model.get_weights(), ref_model.get_weights()):
        np.testing.assert_allclose(w, r, rtol=RTOL, atol=ATOL)
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    infos = [
        json.loads(tensor_util.make_ndarray(e.tensor_proto).item())
        for e in acc.Tensors(metadata.TAG_RUN_INFO)
    ]
    assert infos[0]["fallback_mirrored"] is False and infos[-1]["fallback_mirrored"] is True


def test_stage2_telemetry_counts_gradient_shard(tmp_path):
    """The tier matrix at stage 2 + NVMe: device grads = the shards, NVMe = the states."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 2,
            "offload_optimizer": "nvme",
            "nvme_path": str(tmp_path),
            "page_size_bytes": 65536,
            "sub_group_size": 250,
        },
        logdir=str(tmp_path / "logs"),
    )
    _, model = _fit(strategy, lambda: "adam", steps=3)
    layout = model.optimizer.flat_layout
    strategy.close()
    acc = EventAccumulator(str(tmp_path / "logs"), size_guidance={"tensors": 0})
    acc.Reload()
    last = tensor_util.make_ndarray(acc.Tensors(metadata.TAG_TIERS)[-1].tensor_proto)
    rows = {name: i for i, name in enumerate(metadata.TIERS)}
    cols = {name: i for i, name in enumerate(metadata.TIER_COLUMNS)}
    assert last[rows["device"], cols["grad_bytes"]] == 2 * 4 * layout.shard_size
    assert last[rows["device"], cols["optimizer_bytes"]] == 0
    # Adam: 2 slots x 2 replicas x shard, in whole 64 KiB pages, on NVMe after the step.
    pages = -(-4 * 250 // 65536)
    groups = -(-layout.shard_size // 250)
    assert last[rows["nvme"], cols["optimizer_bytes"]] == 2 * 2 * groups * pages * 65536
    placement = json.loads(
        tensor_util.make_ndarray(acc.Tensors(metadata.TAG_PLACEMENT)[0].tensor_proto).item()
    )
    assert {r["optimizer_tier"] for r in placement["variables"]} == {"nvme"}
    assert "ZeRO-2" in placement["variables"][0]["partitioning"]
    info = json.loads(
        tensor_util.make_ndarray(acc.Tensors(metadata.TAG_RUN_INFO)[-1].tensor_proto).item()
    )
    assert info["reduce_scatter_impl"] == "all_to_all"  # the implementation stage 2 ran


def test_optimizer_host_budget_bounds_the_nvme_store_and_changes_no_result(tmp_path):
    """``optimizer_host_budget_bytes`` is the NVMe optimizer store's host allowance: a
    Dense(256)'s Adam shards (32 896 elements per replica, 3 pages of 64 KiB per slot)
    under the window of one-page sub-groups stream in 3 sub-groups, the store's host peak
    (window + journal copies) stays within the allowance, and the losses equal those with
    the default allowance (the update is elementwise) bitwise."""
    from zero_runtime.optim.nvme_state import window_bytes

    page = 65536
    budget = window_bytes(page // 4, 2, 2, page)  # 4 one-page sub-groups x 2 slots x 2
    rng = np.random.RandomState(2)
    x = rng.standard_normal((48, 256)).astype("float32")
    y = rng.standard_normal((48, 256)).astype("float32")
    runs = {}
    for allowance in (None, budget):
        (tmp_path / f"nvme{allowance}").mkdir(exist_ok=True)
        strategy = zero_runtime.ZeroInfinityStrategy(
            {
                "stage": 2,
                "offload_optimizer": "nvme",
                "nvme_path": str(tmp_path / f"nvme{allowance}"),
                "page_size_bytes": page,
                "optimizer_host_budget_bytes": allowance,
            }
        )
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256)])
            model.compile(optimizer="adam", loss="mse")
        hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        store = model.optimizer.zero_state.store
        runs[allowance] = (hist.history["loss"], store.sub_group_size, store.peak_nbytes)
        scratch = sum(a.nbytes for rec in store._replicas.values() for a in rec.scratch or ())  # noqa: SLF001
        strategy.close()
    (free_losses, free_group, _), (losses, group, peak) = runs[None], runs[budget]
    print(f"sub-groups {free_group} -> {group} elements, store host peak {peak} B")
    assert free_group == 32_896 and group == page // 4
    assert 0 < peak <= budget + scratch
    assert losses == free_losses
