"""Every stage x tier on models nobody here wrote, against MirroredStrategy.

Three models (tests/helpers/any_models.py): ``keras.applications.MobileNetV3Small``
(``weights=None``, 32x32), a GPT-style functional transformer with residuals and a head
tied to the embedding table, and a 3-D ``Dense`` model fed 20 samples in batches of 8 (the
last batch has 4). Each trains one epoch with plain ``compile``/``fit`` and
``keras.optimizers.get("adam")`` under ``ZeroInfinityStrategy`` at

- stage 0;
- stages 1 and 2 with ``offload_optimizer`` none / cpu / nvme;
- stage 3 with ``offload_param`` x ``offload_optimizer`` in none / cpu / nvme,

all of them for the GPT and the 3-D model. MobileNetV3Small takes ~45 s per run on 2
loaded cores (tracing ~200 layers), so it runs stage 1 (optimizer states on the device),
stage 2 (host) and stage 3 with parameters on the host and optimizer states on NVMe, and
parameters on NVMe and optimizer states on the device: every partitioned stage and every
tier of either kind once (stage 0 is Keras's own update; the tier only changes where the
same bytes are stored; the other two models run every pair),

and is compared with one run of plain ``MirroredStrategy`` with Keras's Adam (the same
model, data and seed; trained once per model and shared by every case). Stages 0-2:
bitwise equal. Stage 3: ``max |dw| / max |w| <= 1e-4`` per variable (docs/parity.md),
except the GPT's attention key bias, whose gradient is zero in exact arithmetic (softmax
is shift-invariant): Adam turns its rounding noise into steps, and Keras itself moves it
by more than 1e-4 when only the replica count changes; that variable is bounded by
Keras's own 1-replica vs 2-replica difference (:data:`NOISE_ONLY`), within a factor
:data:`NOISE_FACTOR`: both differences are rounding noise turned into Adam steps of up to
the learning rate each, so one noise figure is no sharper a bound than twice the other
(measured in two runs: ours 3.3e-4 vs Keras's 5.8e-4, and 3.5e-4 vs 3.1e-4).

Each run also checks that it ran the stage it was given: the step record's stage, no
mirrored fallback, the optimizer store's tier, at stage 3 the parameters' tier, the
placement table (ZeRO-3 for every trainable variable, every non-trainable one "frozen") and
the device tier record counting the frozen weights (MobileNetV3Small's BatchNormalization
moving statistics).
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
from helpers import any_models as am
from helpers.mirrored import Mirrored
from helpers.reference_optimizers import DenseGradAdam

import zero_runtime
from zero_runtime.sharded_variable import ShardedVariable

BOUND = 1e-4  # docs/parity.md, stage 3
TIER = {"none": "device", "cpu": "host", "nvme": "nvme"}
TIERS = tuple(TIER)
#: variables whose gradient is zero in exact arithmetic: bounded by Keras's own noise
NOISE_ONLY = {"gpt": ("attn/key/bias",)}
#: how far a noise-only variable may differ, as a multiple of Keras's own noise
NOISE_FACTOR = 2.0
MODELS = {
    # name: (build, data, loss)
    "gpt": (am.gpt, am.gpt_data, "logits"),
    "dense3d": (am.dense3d, am.dense3d_data, "logits"),
    "mobilenet": (am.mobilenet, functools.partial(am.image_data, 2 * am.BATCH), "probs"),
    "embed_add": (am.embed_add, am.embed_add_data, "logits"),  # not in the matrix
}
STAGE12_TIERS = {  # stage -> offload_optimizer tiers
    "gpt": {1: TIERS, 2: TIERS},
    "dense3d": {1: TIERS, 2: TIERS},
    "mobilenet": {1: ("none",), 2: ("cpu",)},
}
STAGE3_PAIRS = {  # (offload_param, offload_optimizer)
    "gpt": [(p, o) for p in TIERS for o in TIERS],
    "dense3d": [(p, o) for p in TIERS for o in TIERS],
    "mobilenet": [("cpu", "nvme"), ("nvme", "none")],
}


def _fit(strategy, name: str, optimizer=None) -> keras.Model:
    """Build, compile and fit ``name`` for one epoch; ``optimizer`` (a factory) defaults
    to ``keras.optimizers.get("adam")``."""
    build, data, loss = MODELS[name]
    with strategy.scope():
        model = build()
        model.compile(
            optimizer=optimizer() if optimizer else keras.optimizers.get("adam"),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=loss == "logits"),
        )
    x, y = data()
    model.fit(x, y, batch_size=am.BATCH, epochs=1, verbose=0, shuffle=False)
    return model


@pytest.fixture(scope="module")
def reference(cpu_devices):
    """``reference(name, replicas=2) -> (paths, weights)`` after one epoch under plain
    MirroredStrategy with Keras's Adam, trained once per (model, replicas)."""

    @functools.cache
    def get(name: str, replicas: int = 2) -> tuple[list[str], list[np.ndarray]]:
        model = _fit(Mirrored(cpu_devices[:replicas]), name)
        assert not any(isinstance(v, ShardedVariable) for v in model.weights)
        assert isinstance(model.optimizer, keras.optimizers.Adam)
        return [v.path for v in model.weights], model.get_weights()

    return get


def _run(name: str, config: dict, tmp_path) -> tuple[list[str], list[np.ndarray]]:
    """Train ``name`` under ``config`` (``keras.optimizers.get("adam")``); check the stage
    and tiers it ran; its variables' paths and weights."""
    stage = config["stage"]
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            **config,
            "nvme_path": str(tmp_path),
            "page_size_bytes": 65536,
            "collective_timeout_seconds": 30,
        }
    )
    try:
        model = _fit(strategy, name)
        last = strategy.runtime.recorder.last(1)[0]
        assert last.stage == stage
        assert last.fallback_mirrored == (stage == 0)
        state = model.optimizer.zero_state
        assert state.stage == stage
        if stage:
            assert state.store.tier == TIER[config["offload_optimizer"]]
        if stage == 3:
            _check_stage3(strategy, model, config)
        return [v.path for v in model.weights], model.get_weights()
    finally:
        strategy.close()


def _check_stage3(strategy, model: keras.Model, config: dict) -> None:
    """Parameters sharded on their tier, ZeRO-3 and frozen rows in the placement table,
    the frozen bytes in the device tier record."""
    assert all(isinstance(v, ShardedVariable) for v in model.trainable_variables)
    (engine,) = strategy.runtime.accounting.stage3_engines
    assert {v.tier for v in engine.variables} == {TIER[config["offload_param"]]}
    am.check_stage3_placement(strategy, model)


def _cases():
    for name in STAGE3_PAIRS:
        if name != "mobilenet":
            yield pytest.param(name, {"stage": 0}, id=f"{name}-s0")
        for stage in (1, 2):
            for opt in STAGE12_TIERS[name][stage]:
                config = {"stage": stage, "offload_optimizer": opt}
                yield pytest.param(name, config, id=f"{name}-s{stage}-opt_{opt}")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "config"), list(_cases()))
def test_stages_0_to_2_are_bitwise_mirrored(name, config, reference, tmp_path):
    paths, weights = _run(name, config, tmp_path)
    ref_paths, ref = reference(name)
    assert paths == ref_paths
    for path, w, r in zip(paths, weights, ref):
        np.testing.assert_array_equal(w, r, err_msg=path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "offload_param", "offload_optimizer"),
    [
        pytest.param(name, p, o, id=f"{name}-param_{p}-opt_{o}")
        for name, pairs in STAGE3_PAIRS.items()
        for p, o in pairs
    ],
)
def test_stage3_is_within_1e4_of_mirrored(
    name, offload_param, offload_optimizer, reference, tmp_path
):
    config = {"stage": 3, "offload_param": offload_param, "offload_optimizer": offload_optimizer}
    paths, weights = _run(name, config, tmp_path)
    ref_paths, ref = reference(name)
    assert paths == ref_paths
    worst = {p: am.rel(w, r) for p, w, r in zip(paths, weights, ref)}
    noisy = NOISE_ONLY.get(name, ())
    checked = {p: d for p, d in worst.items() if p not in noisy}
    print(f"{name} {offload_param}/{offload_optimizer}: worst {max(worst.values()):.3g}")
    assert max(checked.values()) <= BOUND, sorted(checked.items(), key=lambda kv: -kv[1])[:4]
    if noisy:  # bounded by Keras's own difference between 1 and 2 replicas
        _, one = reference(name, 1)
        for p in noisy:
            k = paths.index(p)
            keras_noise = am.rel(one[k], ref[k])
            assert BOUND < keras_noise  # the reason for the exception, measured
            assert worst[p] <= NOISE_FACTOR * keras_noise, (p, worst[p], keras_noise)


@pytest.mark.slow
def test_an_untied_embedding_gets_adam_on_the_summed_gradient(cpu_devices, tmp_path):
    """docs/parity.md, "Keras's Adam on a sparse gradient": an untied ``Embedding``'s
    gradient reaches the optimizer as ``tf.IndexedSlices`` with repeated rows, and Keras's
    Adam then updates the second moment with the sum of the squared slices, not the square
    of their sum. Stage 0 runs Keras's update (bitwise equal to Mirrored with Keras's
    Adam); the partitioned stages run Adam on the summed gradient (bitwise equal to Keras's
    Adam given the densified gradient); the two differ, as measured in the doc."""
    mirrored = {}
    for kind, make in (("keras", None), ("dense", DenseGradAdam)):
        model = _fit(Mirrored(cpu_devices), "embed_add", make)
        mirrored[kind] = model.get_weights()
    paths = [v.path for v in model.weights]
    _, stage0 = _run("embed_add", {"stage": 0}, tmp_path)
    _, stage1 = _run("embed_add", {"stage": 1, "offload_optimizer": "cpu"}, tmp_path)
    for path, z0, z1, k, d in zip(paths, stage0, stage1, mirrored["keras"], mirrored["dense"]):
        np.testing.assert_array_equal(z0, k, err_msg=path)
        np.testing.assert_array_equal(z1, d, err_msg=path)
    gap = {p: am.rel(k, d) for p, k, d in zip(paths, mirrored["keras"], mirrored["dense"])}
    print("Keras's sparse Adam vs Adam on the summed gradient:", gap)
    assert gap["emb/embeddings"] > 1e-2 and max(gap.values()) > 0.1
