"""Stage 3, activation checkpointing of blocks on the units path
(zero_runtime/stage3/checkpointing.py).

With ``activation_checkpointing=True`` every outermost block (a layer, not a model,
holding layers that own weights) keeps only its inputs from the forward and runs again in
backward. Shown here:

- exactness: the demo GPT (``TokenAndPositionEmbedding`` and ``TransformerBlock`` layers,
  attention, LayerNormalization, MLP, residuals) trains two epochs with Adam, parameters
  and optimizer states on the host (the update during backward) and on the device (the
  update after the backward), with tiles: losses and weights bitwise those without
  checkpointing at this size (a deeper one rounds the gradient sums of a block's input
  differently: the memory test); which layers are blocks;
- state: a block holding a ``BatchNormalization`` updates its moving statistics once per
  step (the recompute's updates are discarded): bitwise those without checkpointing, and
  within docs/parity.md's stage-3 bound of MirroredStrategy's;
- refusals: a block with a ``Dropout`` of rate > 0 names the block and the dropout;
- memory: in a fresh process (BFC allocator) a 16-block GPT's training step peaks lower
  with checkpointing (tests/helpers/ckpt_peak_job.py).
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
from helpers import any_models as am
from helpers.jobs import run_json_jobs
from helpers.mirrored import Mirrored

import zero_runtime
from demo.model import GPTConfig, build_gpt

CONFIG = am.STAGE3_HOST_CONFIG
DEVICE_CONFIG = {**CONFIG, "offload_param": "none", "offload_optimizer": "none"}
GPT = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2, d_ff=64)
JOB = os.path.join(os.path.dirname(__file__), "helpers", "ckpt_peak_job.py")


def _tokens() -> np.ndarray:
    return np.random.RandomState(0).randint(0, GPT.vocab_size, (16, GPT.seq_len + 1))


def _fit_gpt(config: dict) -> tuple[list, list, list]:
    strategy = zero_runtime.ZeroInfinityStrategy(config)
    try:
        with strategy.scope():
            model = build_gpt(GPT, seed=0)
            model.compile(
                optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        x = _tokens().astype("int32")
        hist = model.fit(x[:, :-1], x[:, 1:], batch_size=8, epochs=2, verbose=0, shuffle=False)
        engine = strategy.runtime.accounting.stage3_engines[0]
        blocks = [b.layer.name for b in engine.units.blocks]
        tiled = sorted(p.kernel.path for p in engine.tile_plans.values())
        return hist.history["loss"], model.get_weights(), (blocks, tiled)
    finally:
        strategy.close()


@pytest.mark.parametrize(
    "config",
    [CONFIG, {**CONFIG, "tile_size": 1100}, DEVICE_CONFIG],
    ids=["host", "host_tiled", "device"],
)
def test_checkpointed_gpt_trains_bitwise_like_without(config, cpu_devices):
    loss0, w0, (blocks0, tiled0) = _fit_gpt(config)
    loss1, w1, (blocks1, tiled1) = _fit_gpt({**config, "activation_checkpointing": True})
    assert blocks0 == []
    assert blocks1 == ["embedding", "block_0", "block_1"]
    assert tiled1 == tiled0
    # tile_size 1100 elements: the MLP kernels (32 x 64), the token embedding and the
    # LM head (2048 each) run as tiles, the attention's 32 x 32 kernels do not (300 tiled
    # every kernel into 4-7 tiles and took four times as long, for the same check).
    assert bool(tiled1) == ("tile_size" in config)
    assert loss1 == loss0
    assert len(w1) == len(w0)
    for a, b in zip(w1, w0):
        np.testing.assert_array_equal(a, b)


class NormBlock(keras.layers.Layer):
    """``x + Dense(BatchNorm(Dense(x)))``: a block holding a BatchNormalization."""

    def __init__(self, width: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(width, activation="relu", name="inner")
        self.norm = keras.layers.BatchNormalization(name="norm")
        self.outer = keras.layers.Dense(width, name="outer")

    def call(self, x, training=None):
        return x + self.outer(self.norm(self.inner(x), training=training))


def _norm_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    i = keras.Input((8,))
    h = NormBlock(8, name="nb0")(keras.layers.Dense(8, name="stem")(i))
    return keras.Model(i, keras.layers.Dense(1, name="head")(NormBlock(8, name="nb1")(h)))


def _fit_norm(strategy) -> list:
    rng = np.random.RandomState(1)
    x = rng.standard_normal((32, 8)).astype("float32")
    y = rng.standard_normal((32, 1)).astype("float32")
    with strategy.scope():
        model = _norm_model()
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    return model.get_weights()


def test_a_checkpointed_blocks_batchnorm_updates_once_per_step(cpu_devices):
    ref = _fit_norm(Mirrored(cpu_devices))
    out = {}
    for ck in (False, True):
        strategy = zero_runtime.ZeroInfinityStrategy({**CONFIG, "activation_checkpointing": ck})
        try:
            out[ck] = _fit_norm(strategy)
            engine = strategy.runtime.accounting.stage3_engines[0]
            blocks = [b.layer.name for b in engine.units.blocks]
        finally:
            strategy.close()
        assert blocks == (["nb0", "nb1"] if ck else [])
    for a, b in zip(out[True], out[False]):
        np.testing.assert_array_equal(a, b)
    assert max(am.rel(w, r) for w, r in zip(out[True], ref)) <= 1e-4  # docs/parity.md


class DropBlock(keras.layers.Layer):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4, name="dense")
        self.drop = keras.layers.Dropout(0.1, name="drop")

    def call(self, x, training=None):
        return self.drop(self.dense(x), training=training)


def test_a_block_that_draws_random_numbers_is_refused(cpu_devices):
    strategy = zero_runtime.ZeroInfinityStrategy({**CONFIG, "activation_checkpointing": True})
    try:
        with strategy.scope():
            i = keras.Input((4,))
            model = keras.Model(i, keras.layers.Dense(1)(DropBlock(name="db")(i)))
            model.compile(optimizer="sgd", loss="mse")
        x = np.ones((8, 4), "float32")
        with pytest.raises(NotImplementedError, match="block 'db'.*'drop' in it draws random"):
            model.fit(x, x[:, :1], batch_size=8, verbose=0)
    finally:
        strategy.close()


@pytest.mark.slow
def test_checkpointing_lowers_a_deep_gpts_step_peak(tmp_path):
    """A 16-block GPT (d_model 128, host parameters and Adam): the training step's
    allocator peak with checkpointing is below 0.4 of the peak without (measured 6.6 MB
    vs 32.2 MB, 0.21), with the same loss to float32 rounding (the block input's
    gradient, summed over its residual and normalization paths inside the recompute's
    tape, rounds differently: measured 1.1e-7 relative)."""
    jobs = [
        ([JOB, str(tmp_path / f"ck{ck}.json"), str(ck)], tmp_path / f"ck{ck}.json") for ck in (0, 1)
    ]
    rec = dict(enumerate(run_json_jobs(jobs)))
    print(rec)
    assert rec[1]["blocks"] == 17 and rec[0]["blocks"] == 0
    assert rec[1]["loss"] == pytest.approx(rec[0]["loss"], rel=1e-6)
    assert rec[1]["peak"] < 0.4 * rec[0]["peak"]
