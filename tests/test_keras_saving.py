"""``model.save`` / ``keras.models.load_model`` of a partitioned optimizer
(zero_runtime/optim/keras_saving.py): the ``.keras`` file holds the whole Adam state in the
stock layout under the stock class name.

- Stages 1-3 on 2 replicas: fit 3 steps, ``model.save``, fit 3 more (the uninterrupted
  run); ``load_model`` inside the strategy's scope, fit the same 3 steps: equal to the
  uninterrupted run (bitwise at stages 1-2, 1e-5 relative at stage 3).
- A process that never imports zero_runtime loads each file: a stock
  ``keras.optimizers.Adam`` whose variables equal the state gathered here (via the stores'
  ``slot_values``, not the saving code's gather), and 3 more steps there match the
  uninterrupted run within 1e-5.
- ``model.load_weights`` into a compiled, unbuilt model (Keras loads before the build):
  the state is held and scattered at the build; a file of the old format (class
  ``zero_runtime>Adam``, no moments) loads with a warning, inside and outside a strategy.
- A gather above the host-memory limit is refused, naming ``strategy.save_checkpoint``,
  and leaves no file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest

import zero_runtime
from zero_runtime.optim import keras_saving

#: (stage, offload_optimizer): device and host states at stages 1-2, host at stage 3.
CASES = [(1, "none"), (1, "cpu"), (2, "none"), (2, "cpu"), (3, "cpu")]
STEPS = 3
BATCH = 8
FEATURES, HIDDEN, CLASSES = 6, 12, 4


def _data():
    rng = np.random.RandomState(7)
    x = rng.randn(2 * STEPS * BATCH, FEATURES).astype("float32")
    y = np.tanh(x @ rng.randn(FEATURES, CLASSES)).astype("float32")
    return x, y


def _strategy(stage: int, offload: str):
    extra = {"offload_param": "cpu", "persistence_threshold": 10} if stage == 3 else {}
    if stage < 3:
        extra["reduce_bucket_size"] = 50  # several buckets, each padded
    config = zero_runtime.ZeroConfig(
        stage=stage, offload_optimizer=offload, mirrored_fallback_bytes=0, **extra
    )
    return zero_runtime.ZeroInfinityStrategy(config, num_cpu_replicas=2)


def _model(strategy, make_optimizer=None):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(HIDDEN, activation="tanh"),
                keras.layers.Dense(CLASSES),
            ]
        )
        optimizer = make_optimizer() if make_optimizer else keras.optimizers.Adam(1e-2)
        model.compile(optimizer=optimizer, loss="mse")
    return model


def _fit(model, part: int) -> list[float]:
    x, y = _data()
    lo, hi = part * STEPS * BATCH, (part + 1) * STEPS * BATCH
    history = model.fit(x[lo:hi], y[lo:hi], batch_size=BATCH, shuffle=False, verbose=0)
    return history.history["loss"]


def _stock_state(optimizer) -> list[np.ndarray]:
    """The stock Adam's variables (iterations, lr, m_0, v_0, m_1, ...) built from the
    stores' ``slot_values`` (layout.unshard), independently of keras_saving's gather."""
    zs = optimizer.zero_state
    out = [np.asarray(v.numpy()) for v in optimizer.variables]
    slots = {s: zs.store.slot_values(s) for s in zs.store.slot_names}
    offset = 0
    for v, b_size in zip(optimizer._trainable_variables, zs.layout.sizes):
        shape = tuple(int(d) for d in v.shape)
        dim = int(getattr(v, "shard_dim", 0)) if zs.stage == 3 else 0
        moved = (shape[dim], *shape[:dim], *shape[dim + 1 :])
        for s in zs.store.slot_names:
            flat = slots[s][offset : offset + int(np.prod(shape))]
            out.append(np.moveaxis(flat.reshape(moved), 0, dim))
        offset += b_size  # stage 3: each bucket is padded to N * rows
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per case: the file saved after 3 steps, the gathered state at the save, the
    uninterrupted run's next losses and weights, and the loaded model's."""
    out = {}
    for stage, offload in CASES:
        base = tmp_path_factory.mktemp(f"s{stage}{offload}")
        path = str(base / "m.keras")
        strategy = _strategy(stage, offload)
        model = _model(strategy)
        _fit(model, 0)
        state = _stock_state(model.optimizer)
        model.save(path)
        losses = _fit(model, 1)
        weights = [w.copy() for w in model.get_weights()]
        with strategy.scope():
            loaded = keras.models.load_model(path)
        rec = {
            "path": path,
            "state": state,
            "losses": losses,
            "weights": weights,
            "loaded_class": type(loaded.optimizer),
            "loaded_partitioned": loaded.optimizer.zero_state.stage,
        }
        rec["loaded_losses"] = _fit(loaded, 1)
        rec["loaded_weights"] = loaded.get_weights()
        if (stage, offload) == (1, "cpu"):  # load_weights before the optimizer is built
            fresh = _model(strategy)
            fresh.load_weights(path)
            rec["held"] = fresh.optimizer._keras_held_state is not None
            rec["held_losses"] = _fit(fresh, 1)
        for m in (model, loaded):
            if hasattr(m, "close"):
                m.close()
        strategy.close()
        out[(stage, offload)] = rec
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{o}" for s, o in CASES])
def test_load_model_in_scope_continues_like_the_uninterrupted_run(runs, case):
    rec = runs[case]
    assert issubclass(rec["loaded_class"], zero_runtime.optim.Adam)
    assert rec["loaded_partitioned"] == case[0]
    if case[0] < 3:
        assert rec["loaded_losses"] == rec["losses"]
        for a, b in zip(rec["loaded_weights"], rec["weights"]):
            np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(rec["loaded_losses"], rec["losses"], rtol=1e-5)
        for a, b in zip(rec["loaded_weights"], rec["weights"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_file_names_the_stock_class_and_holds_the_stock_layout(runs):
    with zipfile.ZipFile(runs[(2, "cpu")]["path"]) as zf:
        config = json.loads(zf.read("config.json"))
        with zf.open("model.weights.h5") as f, h5py.File(f) as h5:
            keys = sorted(h5["optimizer/vars"].keys(), key=int)
    opt = config["compile_config"]["optimizer"]
    assert (opt["module"], opt["class_name"], opt["registered_name"]) == (
        "keras.optimizers",
        "Adam",
        None,
    )
    assert keys == [str(i) for i in range(2 + 2 * 4)]  # iterations, lr, (m, v) x 4


_PLAIN = textwrap.dedent(
    """
    import json, sys
    import numpy as np, keras
    x, y, out = np.load(sys.argv[1]), np.load(sys.argv[2]), {}
    for path in sys.argv[5:]:
        model = keras.models.load_model(path)
        opt = model.optimizer
        state = [np.asarray(v.numpy()).tolist() for v in opt.variables]
        model.fit(x, y, batch_size=int(sys.argv[4]), shuffle=False, verbose=0)
        out[path] = {"class": type(opt).__module__ + "." + type(opt).__name__,
                     "stock": type(opt) is keras.optimizers.Adam, "state": state,
                     "weights": [w.tolist() for w in model.get_weights()],
                     "zero_runtime": "zero_runtime" in sys.modules}
    json.dump(out, open(sys.argv[3], "w"))
    """
)


def test_plain_keras_loads_a_stock_adam_with_the_gathered_state(runs, tmp_path):
    x, y = _data()
    lo, hi = STEPS * BATCH, 2 * STEPS * BATCH
    np.save(tmp_path / "x.npy", x[lo:hi])
    np.save(tmp_path / "y.npy", y[lo:hi])
    script = tmp_path / "plain.py"
    script.write_text(_PLAIN)
    paths = [runs[c]["path"] for c in CASES]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    out_file = tmp_path / "out.json"
    subprocess.run(
        [sys.executable, str(script), str(tmp_path / "x.npy"), str(tmp_path / "y.npy"),
         str(out_file), str(BATCH), *paths],
        check=True, env=env, cwd=str(tmp_path), timeout=240,
    )  # fmt: skip
    out = json.loads(out_file.read_text())
    for case in CASES:
        rec, got = runs[case], out[runs[case]["path"]]
        assert got["stock"] and not got["zero_runtime"], got["class"]
        assert len(got["state"]) == len(rec["state"])
        for saved, expected in zip(got["state"], rec["state"]):
            np.testing.assert_array_equal(np.asarray(saved, np.float32), expected)
        for a, b in zip(got["weights"], rec["weights"]):  # 1 device vs 2 replicas
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)


def test_load_weights_before_build_holds_the_state_until_the_shards_exist(runs):
    rec = runs[(1, "cpu")]
    assert rec["held"]
    assert rec["held_losses"] == rec["losses"]


def _old_format(path: str, out: str) -> None:
    """Rewrite ``path`` as the previous code wrote it: class ``zero_runtime>Adam`` and
    only ``iterations`` and ``learning_rate`` in the optimizer's variables."""
    with zipfile.ZipFile(path) as zf:
        files = {n: zf.read(n) for n in zf.namelist()}
    config = json.loads(files["config.json"])
    config["compile_config"]["optimizer"].update(
        module="zero_runtime.optim.partitioned", registered_name="zero_runtime>Adam"
    )
    files["config.json"] = json.dumps(config).encode()
    h5_path = out + ".h5"
    with open(h5_path, "wb") as f:
        f.write(files["model.weights.h5"])
    with h5py.File(h5_path, "a") as h5:
        group = h5["optimizer/vars"]
        for key in [k for k in group.keys() if int(k) >= 2]:
            del group[key]
    with open(h5_path, "rb") as f:
        files["model.weights.h5"] = f.read()
    with zipfile.ZipFile(out, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)


def test_old_format_loads_inside_and_outside_a_strategy(runs, tmp_path):
    old = str(tmp_path / "old.keras")
    _old_format(runs[(1, "cpu")]["path"], old)
    strategy = _strategy(1, "cpu")
    try:
        with strategy.scope(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = keras.models.load_model(old)
        assert isinstance(model.optimizer, zero_runtime.optim.Adam)
        assert int(model.optimizer.iterations.numpy()) == STEPS
        assert any("start from zero" in str(w.message) for w in caught)
        store = model.optimizer.zero_state.store
        assert not any(store.read_shard(r, s).any() for r in (0, 1) for s in store.slot_names)
    finally:
        strategy.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outside = keras.models.load_model(old)  # no ZeroInfinityStrategy: stock Keras
    assert isinstance(outside.optimizer, zero_runtime.optim.Adam)
    assert outside.optimizer.fallback_mirrored
    assert int(outside.optimizer.iterations.numpy()) == STEPS
    stock = keras.models.load_model(runs[(1, "cpu")]["path"])  # new format, outside
    assert type(stock.optimizer) is keras.optimizers.Adam
    for saved, expected in zip(stock.optimizer.variables, runs[(1, "cpu")]["state"]):
        np.testing.assert_array_equal(saved.numpy(), expected)


def test_a_gather_above_the_limit_is_refused_and_leaves_no_file(tmp_path, monkeypatch):
    strategy = _strategy(2, "cpu")
    try:
        model = _model(strategy)
        _fit(model, 0)
        path = str(tmp_path / "big.keras")
        monkeypatch.setenv(keras_saving.GATHER_SHARE_ENV, "1e-12")
        with pytest.raises(keras_saving.KerasSaveRefusedError) as info:
            model.save(path)
        assert "strategy.save_checkpoint(" in str(info.value)
        assert info.value.bytes_needed > info.value.bytes_limit
        assert info.value.removed == path
        assert not os.path.exists(path)
        assert os.listdir(tmp_path) == []
        monkeypatch.delenv(keras_saving.GATHER_SHARE_ENV)
        model.save(path)  # within the default limit: saved
        assert zipfile.is_zipfile(path)
    finally:
        strategy.close()


def test_ema_averages_are_saved_in_the_stock_order(tmp_path):
    """The stock layout comes from the stock class built on stand-ins: with ``use_ema``
    the 4 EMA averages (a partitioned slot, gathered from the shards) sit between the
    learning rate and the moments, as the stock optimizer's ``_model_variables_moving_average``."""
    strategy = _strategy(2, "cpu")
    try:
        model = _model(strategy, lambda: keras.optimizers.Adam(1e-2, use_ema=True))
        _fit(model, 0)
        zs = model.optimizer.zero_state
        flat = zs.layout.unshard([zs.store.read_shard(r, "average") for r in range(2)])
        ends = np.cumsum(zs.layout.sizes)
        averages = [
            flat[end - size : end].reshape(shape)
            for end, size, shape in zip(ends, zs.layout.sizes, zs.layout.shapes)
        ]
        path = str(tmp_path / "ema.keras")
        model.save(path)
        losses = _fit(model, 1)
        with zipfile.ZipFile(path) as zf, zf.open("model.weights.h5") as f, h5py.File(f) as h5:
            saved = {k: np.asarray(v) for k, v in h5["optimizer/vars"].items()}
        assert len(saved) == 2 + 4 + 2 * 4
        for k, average in enumerate(averages):
            np.testing.assert_array_equal(saved[str(2 + k)], average)
        with strategy.scope():
            loaded = keras.models.load_model(path)
        assert _fit(loaded, 1) == losses
    finally:
        strategy.close()
