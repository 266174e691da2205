"""A Keras optimizer *instance* built inside ``strategy.scope()`` is partitioned.

``keras.optimizers.Adam(...)`` (every Keras guide's form, and Keras-Hub's own compile)
becomes ``zero_runtime.optim.Adam`` when its first variable is created in the scope
(zero_runtime/optim/adopt.py), keeping every hyperparameter it was given; so do the
other optimizers with a partitioned form and a user's subclass that does not change the
update. A class the runtime cannot partition refuses to build where the config asks for
partitioning, naming itself and the supported classes; it runs as stock Keras where the
strategy runs plain data parallelism (stage 0, or below ``mirrored_fallback_bytes``,
recorded as ``fallback_mirrored``). Parity of each partitioned update with Keras's own:
tests/test_optim_elementwise.py, tests/test_stage2.py, tests/test_parity_matrix.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers.mirrored import Mirrored

import zero_runtime
import zero_runtime.optim
from zero_runtime.optim import adopt
from zero_runtime.optim.partitioned import PARTITIONED_FOR_KERAS, _PartitionedUpdate

X = np.random.RandomState(0).normal(size=(16, 6)).astype("float32")
Y = np.random.RandomState(1).normal(size=(16, 3)).astype("float32")

INSTANCES = {
    "Adam": lambda: keras.optimizers.Adam(0.01, beta_1=0.8, clipnorm=1.0),
    "AdamW": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "SGD": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "RMSprop": lambda: keras.optimizers.RMSprop(0.01, centered=True),
    "Adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "Adamax": lambda: keras.optimizers.Adamax(0.01),
    "Nadam": lambda: keras.optimizers.Nadam(0.01),
    "Lion": lambda: keras.optimizers.Lion(0.001),
}


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])


def _strategy(stage: int, **extra) -> zero_runtime.ZeroInfinityStrategy:
    config = {"stage": stage, "offload_optimizer": "cpu", "mirrored_fallback_bytes": 0, **extra}
    return zero_runtime.ZeroInfinityStrategy(config, num_cpu_replicas=2)


@pytest.fixture(scope="module")
def stage1():
    strategy = _strategy(1)
    yield strategy
    strategy.close()


@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_instance_in_scope_is_partitioned_and_keeps_its_hyperparameters(stage1, name):
    stock = INSTANCES[name]().get_config()  # outside the scope: Keras's own class
    with stage1.scope():
        model = _model()
        opt = INSTANCES[name]()
        model.compile(optimizer=opt, loss="mse")
    assert type(opt) is PARTITIONED_FOR_KERAS[getattr(keras.optimizers, name)]
    config = opt.get_config()
    for key in ("learning_rate", "beta_1", "momentum", "nesterov", "weight_decay", "clipnorm"):
        if key in stock:
            assert config[key] == stock[key], key
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert int(opt.iterations.numpy()) == 2
    rows = stage1.runtime.placement()["variables"]
    paths = {v.path for v in model.trainable_variables}
    ours = [r for r in rows if r["name"] in paths]
    assert len(ours) == len(paths) and all("ZeRO-1" in r["partitioning"] for r in ours), ours
    assert all(r["optimizer_tier"] == "host" for r in ours)


def test_names_and_get_resolve_to_partitioned_classes(stage1):
    with stage1.scope():
        for name in ("rmsprop", "adagrad", "adamax", "nadam", "lion", "adam", "sgd"):
            assert isinstance(keras.optimizers.get(name), _PartitionedUpdate), name


def test_unsupported_class_is_refused_at_build_naming_it(stage1):
    with stage1.scope():
        model = _model()
        opt = keras.optimizers.Ftrl()
        model.compile(optimizer=opt, loss="mse")
    with pytest.raises(NotImplementedError) as err:
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    msg = str(err.value)
    assert "keras.optimizers.Ftrl" in msg and "no partitioned update" in msg
    assert "ZeRO stage 1" in msg and "Adam" in msg and "Lion" in msg


def test_user_subclass_with_its_own_update_is_refused(stage1):
    class MyAdam(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            return super().update_step(gradient, variable, learning_rate)

    with stage1.scope():
        opt = MyAdam(0.01)
        model = _model()
    assert isinstance(opt, MyAdam)
    with pytest.raises(NotImplementedError, match=r"MyAdam cannot be partitioned: it subclasses"):
        opt.build(model.trainable_variables)


def test_user_subclass_without_its_own_update_is_partitioned(stage1):
    class TaggedAdam(keras.optimizers.Adam):
        def get_config(self):
            return {**super().get_config(), "tag": None}

    with stage1.scope():
        opt = TaggedAdam(0.01)
        model = _model()
        model.compile(optimizer=opt, loss="mse")
    assert isinstance(opt, TaggedAdam) and isinstance(opt, zero_runtime.optim.Adam)
    assert opt.get_config()["tag"] is None
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert opt.zero_state.stage == 1


def test_loss_scale_wrapper_is_left_and_its_inner_adopted(stage1):
    with stage1.scope():
        lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))
    assert type(lso) is keras.optimizers.LossScaleOptimizer
    assert isinstance(lso.inner_optimizer, zero_runtime.optim.Adam)


def test_unsupported_class_runs_stock_where_the_strategy_is_plain_data_parallel():
    """Stage 0, and stage 1 below mirrored_fallback_bytes: stock Keras, recorded."""
    for stage, fallback in ((0, 0), (1, 1 << 30)):
        strategy = _strategy(stage, mirrored_fallback_bytes=fallback)
        try:
            with strategy.scope():
                model = _model()
                model.compile(optimizer=keras.optimizers.Ftrl(0.01), loss="mse")
            model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
            assert int(model.optimizer.iterations.numpy()) == 2
            assert strategy.runtime.fallback_mirrored is True  # said in every step record
        finally:
            strategy.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
        lambda: keras.optimizers.SGD(0.05, momentum=0.9, weight_decay=0.1),
    ],
    ids=["AdamW", "SGD"],
)
def test_weight_decay_with_host_states_is_bitwise_mirrored(stage1, cpu_devices, make):
    """Decoupled weight decay applied by the host update (offload_optimizer='cpu') in
    the order TensorFlow computes Keras's inside the step (kernels.weight_decay): the
    weights are bitwise those of MirroredStrategy with Keras's own optimizer."""
    weights = []
    for strategy in (stage1, Mirrored(cpu_devices)):
        with strategy.scope():
            model = _model()
            model.compile(optimizer=make(), loss="mse")
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    assert isinstance(model.optimizer, type(make()))  # the reference is Keras's own
    for got, ref in zip(*weights):
        np.testing.assert_array_equal(got, ref)


def test_placement_describes_the_current_optimizers_after_a_recompile():
    """A recompile with a new optimizer replaces the old one's placement rows (one row
    per variable, the new optimizer's); a second model's optimizer, over other
    variables, adds its own."""
    strategy = _strategy(1)
    try:
        with strategy.scope():
            model, other = _model(), _model()
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
        with strategy.scope():
            model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
            other.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
        other.fit(X, Y, batch_size=8, epochs=1, verbose=0)
        names = [r["name"] for r in strategy.runtime.placement()["variables"]]
        expected = [v.path for m in (model, other) for v in m.trainable_variables]
        assert sorted(names) == sorted(expected)
        assert strategy.runtime.accounting.optimizers == [model.optimizer, other.optimizer]
    finally:
        strategy.close()


@pytest.mark.parametrize("form", ["fit", "optimizer.build"])
def test_a_model_created_outside_the_scope_is_refused_naming_the_fix(stage1, form):
    """A model built before ``with strategy.scope():`` (its variables plain, not
    mirrored) with its optimizer inside: refused when the optimizer is built, naming the
    first variable and the fix, as MirroredStrategy refuses it (not an empty
    AssertionError from the update)."""
    model = _model()
    with stage1.scope():
        opt = keras.optimizers.Adam(0.01)
        model.compile(optimizer=opt, loss="mse")
    with pytest.raises(
        ValueError,
        match=r"created outside strategy\.scope\(\) \(first: '[\w/]*kernel'\): create "
        r"the model inside `with strategy\.scope\(\):`",
    ):
        if form == "fit":
            model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
        else:
            with stage1.scope():
                opt.build(model.trainable_variables)
    assert not opt.built


@pytest.mark.parametrize("stage", [1, 3])
def test_keras_gradient_accumulation_is_refused_naming_the_config_key(stage):
    """Keras's own gradient_accumulation_steps (whose update runs inside a tf.cond, which
    fails under MirroredStrategy too) is refused when the optimizer is built, before
    anything is sharded or trained, naming ZeroConfig(gradient_accumulation_steps=N)."""
    strategy = _strategy(stage)
    try:
        with strategy.scope():
            model = _model()
            model.compile(
                optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=2), loss="mse"
            )
        before = model.get_weights()
        with pytest.raises(
            NotImplementedError,
            match=rf"Keras's own gradient accumulation cannot run at ZeRO stage {stage}.*"
            r"ZeroConfig\(gradient_accumulation_steps=2\)",
        ):
            model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
        assert not any(type(v).__name__ == "ShardedVariable" for v in model.weights)
        for w, b in zip(model.get_weights(), before):
            np.testing.assert_array_equal(w, b)
    finally:
        strategy.close()


def test_refusal_text_for_each_reason():
    class OwnUpdateAdam(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            return super().update_step(gradient, variable, learning_rate)

    assert "overrides the update" in adopt.refusal(OwnUpdateAdam, 2)
    assert "no partitioned update" in adopt.refusal(keras.optimizers.Ftrl, 3)
    assert "ZeRO stage 3" in adopt.refusal(keras.optimizers.Ftrl, 3)
