"""Stage 3 under a Keras mixed-precision policy.

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
    assert _engine_of(strategy).runner is not None  # by units
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    worst = max(am.rel(w, r) for w, r in zip(model.get_weights(), ref.get_weights()))
    assert worst <= BOUND, (name, tier, worst)
    assert all(w.dtype == np.float32 for w in model.get_weights())  # float32 masters


def _engine_of(strategy):
    (engine,) = strategy.runtime.accounting.stage3_engines
    return engine


@pytest.mark.parametrize("mixed", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_policy_halves_all_gather_bytes(cpu_devices, mixed):
    """The traced step's collectives, counted by dtype: under ``mixed_bfloat16`` and
    ``mixed_float16`` the all-gathers of a model whose weights all autocast move exactly
    half the bytes of the float32 run, and the reduce-scatters (float32 in all) the same
    bytes."""
    tallies = {}
    for policy in ("float32", mixed):
        strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
        _fit(strategy, "mlp", policy)
        tallies[policy] = dict(_engine_of(strategy).group.step_tally)
    f32, b16 = tallies["float32"], tallies[mixed]
    # 3 units, gathered in forward and again in the backward's recompute, 2 replicas.
    assert f32["all_gather_calls"] == b16["all_gather_calls"] == 3 * 2 * 2
    elements = 8 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4  # every weight, split over 2 shards
    assert f32["all_gather_bytes"] == 4 * elements * 2  # forward + recompute, 2 replicas
    assert b16["all_gather_bytes"] == f32["all_gather_bytes"] / 2
    rs = "reduce_scatter_bytes" if "reduce_scatter_bytes" in f32 else "all_reduce_bytes"
    # mixed_float16 adds the loss scaling's finite flag, one float32 [1] all-reduce per
    # replica after the backward (the tally window, replica 0's forward to the last
    # replica's backward, holds replica 0's): float32 gradients otherwise, as in float32.
    extra = 4 if mixed == "mixed_float16" else 0
    assert f32[rs] + extra == b16[rs] > 0


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


@pytest.mark.parametrize("tier", ["none", "cpu"])
@pytest.mark.parametrize("name", ["mlp", "dense3d"])
def test_mixed_float16_trains_like_mirrored(cpu_devices, name, tier):
    """Under ``mixed_float16`` (Keras wraps the optimizer in a LossScaleOptimizer): the
    scaled loss is differentiated, the reduced gradient shards unscaled, and the losses,
    weights and loss scale match MirroredStrategy's under the same policy and seed
    (measured: 0 for both models and tiers)."""
    ref, ref_loss = _fit(Mirrored(cpu_devices), name, "mixed_float16", "adam")
    config = {**CONFIG, "offload_param": tier, "offload_optimizer": tier}
    strategy = zero_runtime.ZeroInfinityStrategy(config)
    model, loss = _fit(strategy, name, "mixed_float16", "adam")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    worst = max(am.rel(w, r) for w, r in zip(model.get_weights(), ref.get_weights()))
    assert worst <= BOUND, (name, tier, worst)
    assert all(w.dtype == np.float32 for w in model.get_weights())  # float32 masters
    opt, ref_opt = model.optimizer, ref.optimizer
    got = [
        int(opt.iterations.numpy()),
        float(opt.dynamic_scale.numpy()),
        int(opt.step_counter.numpy()),
    ]
    want = [
        int(ref_opt.iterations.numpy()),
        float(ref_opt.dynamic_scale.numpy()),
        int(ref_opt.step_counter.numpy()),
    ]
    assert got == want


def _overflow_run(strategy, tier_states: bool):
    """Three ``train_on_batch`` steps of the MLP under ``mixed_float16`` with Adam: finite,
    one whose targets overflow the float16 gradient on replica 1 only (its half of the
    global batch, targets 1e4: the scaled gradient passes float16's 65504), finite.

    Returns ``(model, records)``: per step the loss, the weights, the scale, the
    counter, the optimizer's iterations and (``tier_states``) its state slots."""
    with _policy("mixed_float16"):
        with strategy.scope():
            model = _mlp()
            model.compile(optimizer="adam", loss="mse")
        x, y = _mlp_data()
        records = []
        for step in range(3):
            xb, yb = (
                x[step * am.BATCH : (step + 1) * am.BATCH],
                y[step * am.BATCH : (step + 1) * am.BATCH].copy(),
            )
            if step == 1:
                yb[am.BATCH // 2 :] = 1e4  # replica 1's rows only
            loss = model.train_on_batch(xb, yb)
            opt = model.optimizer
            rec = {
                "loss": loss,
                "weights": [w.copy() for w in model.get_weights()],
                "scale": float(opt.dynamic_scale.numpy()),
                "counter": int(opt.step_counter.numpy()),
                "iterations": int(opt.iterations.numpy()),
            }
            if tier_states:
                store = opt.inner_optimizer.host_state
                rec["states"] = {
                    k: np.array(store.slot_values(k)) for k in ("momentum", "velocity")
                }
            records.append(rec)
    return model, records


@pytest.mark.parametrize("tier", ["none", "cpu"])
def test_mixed_float16_skips_a_step_overflowing_on_one_replica(cpu_devices, tier):
    """A gradient that overflows float16 on replica 1 only: every replica skips the step
    (the finite flag is all-reduced), weights and Adam states stay bitwise as they were,
    ``iterations`` stays, the scale halves and the counter resets, as under
    MirroredStrategy; the next finite step updates, and matches Mirrored's."""
    _, ref = _overflow_run(Mirrored(cpu_devices), tier_states=False)
    config = {**CONFIG, "offload_param": tier, "offload_optimizer": tier}
    _, got = _overflow_run(zero_runtime.ZeroInfinityStrategy(config), tier_states=True)
    first, skipped, after = got
    assert not any(np.isnan(r["loss"]) for r in got)
    assert [r["scale"] for r in got] == [r["scale"] for r in ref] == [2.0**15, 2.0**14, 2.0**14]
    assert [r["counter"] for r in got] == [r["counter"] for r in ref] == [1, 0, 1]
    assert [r["iterations"] for r in got] == [r["iterations"] for r in ref] == [1, 1, 2]
    for w, w0 in zip(skipped["weights"], first["weights"]):
        np.testing.assert_array_equal(w, w0)  # skipped: nothing written
    for k in ("momentum", "velocity"):
        np.testing.assert_array_equal(skipped["states"][k], first["states"][k])
        assert np.abs(after["states"][k] - first["states"][k]).max() > 0
    assert max(np.abs(w - w0).max() for w, w0 in zip(after["weights"], first["weights"])) > 0
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g["loss"], r["loss"], rtol=1e-5)
        worst = max(am.rel(w, x) for w, x in zip(g["weights"], r["weights"]))
        assert worst <= BOUND, worst
    assert keras.mixed_precision.global_policy().name == "float32"


def _fit_lso(strategy, config_scale: float, growth: int, clip: float | None = None):
    """The MLP trained one epoch under ``mixed_float16`` with an explicit
    ``LossScaleOptimizer(adam, initial_scale=config_scale, dynamic_growth_steps=growth)``
    (``global_clipnorm=clip`` on the inner Adam)."""
    with _policy("mixed_float16"):
        with strategy.scope():
            model = _mlp()
            inner = keras.optimizers.get(
                {"class_name": "adam", "config": {"global_clipnorm": clip}}
            )
            opt = keras.optimizers.LossScaleOptimizer(
                inner, initial_scale=config_scale, dynamic_growth_steps=growth
            )
            model.compile(optimizer=opt, loss="mse")
        x, y = _mlp_data()
        history = model.fit(x, y, batch_size=am.BATCH, epochs=1, verbose=0, shuffle=False)
    return model, history.history["loss"]


def test_mixed_float16_scale_grows_as_under_mirrored(cpu_devices):
    """``dynamic_growth_steps=2``: the scale doubles after every second finite step (4
    steps: 2^15 -> 2^17, counter back to 0), the weights as under MirroredStrategy."""
    ref, ref_loss = _fit_lso(Mirrored(cpu_devices), 2.0**15, 2)
    model, loss = _fit_lso(zero_runtime.ZeroInfinityStrategy(CONFIG), 2.0**15, 2)
    assert (
        float(model.optimizer.dynamic_scale.numpy())
        == float(ref.optimizer.dynamic_scale.numpy())
        == 2.0**17
    )
    assert int(model.optimizer.step_counter.numpy()) == int(ref.optimizer.step_counter.numpy()) == 0
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    worst = max(am.rel(w, r) for w, r in zip(model.get_weights(), ref.get_weights()))
    assert worst <= BOUND, worst


def test_mixed_float16_unscales_before_clipping(cpu_devices):
    """With ``global_clipnorm`` on the inner optimizer the shards are unscaled first (as
    Keras does): training with the loss scaled by 2^15 gives the weights of training with
    scale 1 (a power-of-two scale changes no float16 rounding here; measured 1.2e-7),
    and clipping was active (the unclipped run differs by 0.079)."""
    big, _ = _fit_lso(zero_runtime.ZeroInfinityStrategy(CONFIG), 2.0**15, 10**6, clip=0.05)
    one, _ = _fit_lso(zero_runtime.ZeroInfinityStrategy(CONFIG), 1.0, 10**6, clip=0.05)
    free, _ = _fit_lso(zero_runtime.ZeroInfinityStrategy(CONFIG), 1.0, 10**6)
    assert int(big.optimizer.iterations.numpy()) == 4  # no step skipped
    worst = max(am.rel(w, r) for w, r in zip(big.get_weights(), one.get_weights()))
    assert worst <= BOUND, worst
    assert max(am.rel(w, r) for w, r in zip(free.get_weights(), one.get_weights())) > 1e-2


def test_mixed_float16_with_accumulation_is_refused(cpu_devices):
    """Loss scaling with ``gradient_accumulation_steps`` > 1 is not implemented: the first
    step says so, naming what is accepted."""
    strategy = zero_runtime.ZeroInfinityStrategy({**CONFIG, "gradient_accumulation_steps": 2})
    with pytest.raises(NotImplementedError, match="gradient_accumulation_steps=1"):
        _fit(strategy, "mlp", "mixed_float16")
    assert keras.mixed_precision.global_policy().name == "float32"


def test_loss_scale_optimizer_under_the_float32_policy(cpu_devices):
    """An explicit ``LossScaleOptimizer`` under the float32 policy on a chain: the loss is
    scaled and the shards unscaled, as under MirroredStrategy (scale 2^40, no overflow in
    float32, 3 steps)."""

    def run(strategy):
        with strategy.scope():
            model = am.dense3d()
            opt = keras.optimizers.LossScaleOptimizer(
                keras.optimizers.get("adam"), initial_scale=2.0**40
            )
            model.compile(
                optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            )
        x, y = am.dense3d_data()
        history = model.fit(x, y, batch_size=am.BATCH, epochs=1, verbose=0, shuffle=False)
        return model, history.history["loss"]

    ref, ref_loss = run(Mirrored(cpu_devices))
    strategy = zero_runtime.ZeroInfinityStrategy(CONFIG)
    model, loss = run(strategy)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    worst = max(am.rel(w, r) for w, r in zip(model.get_weights(), ref.get_weights()))
    assert worst <= BOUND, worst
    assert int(model.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy()) == 3
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**40
