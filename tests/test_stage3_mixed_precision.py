"""Stage 3 under a Keras mixed-precision policy (issue #16, item 3).

Under ``mixed_bfloat16`` every unit whose weights Keras casts to the compute dtype is
all-gathered in bfloat16 (half the bytes of float32; the float32 shards stay the master
weights and the optimizer updates them in float32), and the layer computes exactly as
under ``MirroredStrategy`` with the same policy: the gathered values are the float32
weights rounded to bfloat16, which is what Keras's autocast gives the layer there.
Normalization and embedding layers, which Keras keeps in float32 (``autocast=False``),
are gathered in float32. Gradients are reduce-scattered in float32 (as Mirrored
all-reduces the float32 gradients of float32 variables).

Parity is measured as in ``tests/test_stage3_any_model.py`` (``max |Δw| / max |w|`` after
training, docs/parity.md). Telemetry counts every traced collective by its real dtype
(``CollectiveGroup.step_tally``, the ``memory_hierarchy/collectives`` vector).
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest
from helpers import any_models as am
from helpers.mirrored import Mirrored

import zero_runtime

BOUND = 1e-4  # docs/parity.md, stage 3
CONFIG = am.STAGE3_HOST_CONFIG


@contextlib.contextmanager
def _policy(name: str):
    old = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(old)


def _mlp() -> keras.Model:
    """A residual MLP whose every weight autocasts (no normalization, no embedding)."""
    keras.utils.set_random_seed(21)
    i = keras.Input((8,))
    h = keras.layers.Dense(32, activation="relu", name="d0")(i)
    h = keras.layers.Add()([h, keras.layers.Dense(32, activation="tanh", name="d1")(h)])
    return keras.Model(i, keras.layers.Dense(4, name="out")(h))


def _mlp_data():
    rng = np.random.RandomState(22)
    x = rng.standard_normal((4 * am.BATCH, 8)).astype("float32")
    return x, (x[:, :4] - 0.5 * x[:, 4:]).astype("float32")


MODELS = {
    "mlp": (_mlp, _mlp_data, "mse"),
    "embed_add": (am.embed_add, am.embed_add_data, "scce"),
    "dense3d": (am.dense3d, am.dense3d_data, "scce"),  # a chain: runs by units when mixed
}


def _fit(strategy, name: str, policy: str, optimizer: str = "sgd"):
    build, data, loss = MODELS[name]
    with _policy(policy):
        with strategy.scope():
            model = build()
            model.compile(
                optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
                if loss == "scce"
                else "mse",
            )
        x, y = data()
        history = model.fit(x, y, batch_size=am.BATCH, epochs=1, verbose=0, shuffle=False)
    return model, history.history["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tier", ["none", "cpu"])
def test_mixed_bfloat16_trains_like_mirrored(cpu_devices, name, tier):
    """Under ``mixed_bfloat16``: the same losses and weights as MirroredStrategy under the
    same policy, within the stage-3 bound (measured: 0 for the chain and the MLP,
    1.5e-7 for the embedding + residual model, where the embedding's two uses are summed)."""
    ref, ref_loss = _fit(Mirrored(cpu_devices), name, "mixed_bfloat16")
    config = {**CONFIG, "offload_param": tier, "offload_optimizer": tier}
    strategy = zero_runtime.ZeroInfinityStrategy(config)
    model, loss = _fit(strategy, name, "mixed_bfloat16")
    assert _engine_of(strategy).runner is not None  # by units (a chain too, when mixed)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    worst = max(am.rel(w, r) for w, r in zip(model.get_weights(), ref.get_weights()))
    assert worst <= BOUND, (name, tier, worst)
    assert all(w.dtype == np.float32 for w in model.get_weights())  # float32 masters


def _engine_of(strategy):
    (engine,) = strategy.runtime.accounting.stage3_engines
    return engine


def test_mixed_bfloat16_halves_all_gather_bytes(cpu_devices):
    """The traced step's collectives, counted by dtype: under ``mixed_bfloat16`` the
    all-gathers of a model whose weights all autocast move exactly half the bytes of the
    float32 run, and the reduce-scatters (float32 in both) the same bytes."""
    tallies = {}
    for policy in ("float32", "mixed_bfloat16"):
        strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
        _fit(strategy, "mlp", policy)
        tallies[policy] = dict(_engine_of(strategy).group.step_tally)
    f32, b16 = tallies["float32"], tallies["mixed_bfloat16"]
    # 3 units, gathered in forward and again in the backward's recompute, 2 replicas.
    assert f32["all_gather_calls"] == b16["all_gather_calls"] == 3 * 2 * 2
    elements = 8 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4  # every weight, split over 2 shards
    assert f32["all_gather_bytes"] == 4 * elements * 2  # forward + recompute, 2 replicas
    assert b16["all_gather_bytes"] == f32["all_gather_bytes"] / 2
    rs = "reduce_scatter_bytes" if "reduce_scatter_bytes" in f32 else "all_reduce_bytes"
    assert f32[rs] == b16[rs] > 0


def test_embedding_and_norm_gather_in_float32(cpu_devices):
    """Layers Keras keeps in float32 under a mixed policy (Embedding, LayerNormalization:
    ``autocast=False``) are gathered in float32: the tied GPT's all-gather bytes under
    ``mixed_bfloat16`` lie strictly between half and all of its float32 bytes, and the
    first step's loss is Mirrored's."""
    gathered = {}
    for policy in ("float32", "mixed_bfloat16"):
        with _policy(policy):
            strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
            with strategy.scope():
                model = am.gpt()
                model.compile(
                    optimizer="sgd",
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                )
            x, y = am.gpt_data()
            loss = model.train_on_batch(x[: am.BATCH], y[: am.BATCH])
            gathered[policy] = _engine_of(strategy).group.step_tally["all_gather_bytes"]
            if policy == "mixed_bfloat16":
                with Mirrored(cpu_devices).scope():
                    ref = am.gpt()
                    ref.compile(
                        optimizer="sgd",
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    )
                assert loss == pytest.approx(ref.train_on_batch(x[: am.BATCH], y[: am.BATCH]))
    assert gathered["float32"] / 2 < gathered["mixed_bfloat16"] < gathered["float32"]
    assert keras.mixed_precision.global_policy().name == "float32"  # restored


def test_mixed_float16_is_refused_naming_the_way_out(cpu_devices):
    """``mixed_float16`` (Keras wraps the optimizer in a LossScaleOptimizer): stage 3 does
    not scale losses yet and says so at the first step, naming ``mixed_bfloat16``."""
    with pytest.raises(NotImplementedError, match="mixed_bfloat16"):
        _fit(zero_runtime.ZeroInfinityStrategy(CONFIG), "mlp", "mixed_float16")
    assert keras.mixed_precision.global_policy().name == "float32"
