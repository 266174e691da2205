"""TensorFlow's custom-training-loop tutorial, unchanged but for the strategy line.

The loop (https://www.tensorflow.org/tutorials/distribute/custom_training): a model and a
``keras.optimizers.Adam`` *instance* built inside ``strategy.scope()``,
``optimizer.build(model.trainable_variables)``, a ``tf.function`` that calls
``strategy.run(train_step)`` and ``strategy.reduce``, and a ``train_step`` that takes
``tape.gradient`` under its own ``tf.GradientTape`` and calls
``optimizer.apply_gradients``. It runs under ``tf.distribute.MirroredStrategy`` (the
reference, 2 logical CPUs) and under ``ZeroInfinityStrategy`` at stages 1, 2 and 3
(``offload_param`` none / cpu / nvme), on models nobody here wrote (a tied-head GPT with
residuals, a BatchNormalization convnet, a subclassed model), with both ways of
distributing a dataset, and with the usual variations (a frozen body, a GAN's two models
and optimizers, gradient accumulation in the loop, a persistent tape with a gradient over
the input). Parity as in docs/parity.md: stages 1-2 bitwise, stage 3 within 1e-5 relative
(a weight with no gradient in exact arithmetic within 1e-6 absolute). Every ZeRO run also
checks that it ran the stage it was given: the placement table names ZeRO partitioning for
every trainable variable.
"""

from __future__ import annotations

import contextlib
import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import any_models as am
from helpers.mirrored import Mirrored

import zero_runtime

GLOBAL = 8
STEPS = 20
BOUND = 1e-5
NOISE_ONLY = ("key/bias",)  # zero gradient in exact arithmetic (softmax shift)


# -- models -------------------------------------------------------------------------------
def residual() -> keras.Model:
    keras.utils.set_random_seed(1)
    inp = keras.Input((12,))
    h = keras.layers.Dense(32, activation="relu")(inp)
    h = keras.layers.Add()([h, keras.layers.Dense(32)(h)])
    return keras.Model(inp, keras.layers.Dense(5)(h))


def convnet() -> keras.Model:
    keras.utils.set_random_seed(2)
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(5)(h))


class Subclassed(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.a = keras.layers.Dense(16, activation="tanh")
        self.b = keras.layers.Dense(16)
        self.out = keras.layers.Dense(5)

    def call(self, x):
        h = self.a(x)
        return self.out(h + self.b(h))


def subclassed() -> keras.Model:
    keras.utils.set_random_seed(3)
    m = Subclassed()
    m(np.zeros((1, 12), np.float32))
    return m


def data(kind: str, n: int = GLOBAL * STEPS // 2) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    if kind == "gpt":
        x, y = am.gpt_data()
        reps = -(-n // len(x))
        return np.tile(x, (reps, 1))[:n], np.tile(y, (reps, 1))[:n]
    shape = (8, 8, 3) if kind == "convnet" else (12,)
    return rng.normal(size=(n, *shape)).astype("float32"), rng.randint(0, 5, n).astype("int64")


MODELS = {"residual": residual, "convnet": convnet, "subclassed": subclassed, "gpt": am.gpt}


# -- the tutorial loop --------------------------------------------------------------------
def tutorial_loop(
    strategy,
    build,
    kind: str,
    opt_fn=lambda: keras.optimizers.Adam(1e-2),
    dist: str = "dataset",
    epochs: int = 2,
):
    """The tutorial's loop under ``strategy``; returns (losses, weights, model)."""
    x, y = data(kind)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
    if dist == "dataset":
        dist_ds = strategy.experimental_distribute_dataset(ds)
    else:

        def dataset_fn(ctx):
            per_replica = ctx.get_per_replica_batch_size(GLOBAL)
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica)

        dist_ds = strategy.distribute_datasets_from_function(dataset_fn)

    with strategy.scope():
        model = build()
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        optimizer = opt_fn()
        optimizer.build(model.trainable_variables)

    def compute_loss(labels, predictions):
        per_example_loss = loss_object(labels, predictions)
        if per_example_loss.shape.rank > 1:  # the GPT: per token
            per_example_loss = tf.reduce_mean(per_example_loss, axis=-1)
        return tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL)

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    losses = []
    for _ in range(epochs):
        for batch in dist_ds:
            losses.append(float(distributed_train_step(batch)))
    # By position (layer names count up across models built in one process); the path
    # without its layer name's counter tells the noise-only variables.
    weights = {
        (i, re.sub(r"_\d+(?=/|$)", "", v.path)): np.asarray(v.numpy())
        for i, v in enumerate(model.weights)
    }
    return np.array(losses), weights, model


@functools.cache
def mirrored(name: str, opt: str = "adam", dist: str = "dataset"):
    strategy = Mirrored(("/cpu:0", "/cpu:1"))
    losses, weights, _ = tutorial_loop(strategy, MODELS[name], name, OPTS[opt], dist)
    return losses, weights


OPTS = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}


def zero_strategy(stage: int, param: str = "none", opt: str = "cpu", tmp_path=None, **extra):
    config = dict(
        stage=stage,
        offload_optimizer=opt,
        mirrored_fallback_bytes=0,
        page_size_bytes=65536,
        collective_timeout_seconds=60,
        **extra,
    )
    if stage == 3:
        config["offload_param"] = param
    if "nvme" in (param, opt):
        config["nvme_path"] = str(tmp_path)
    return zero_runtime.ZeroInfinityStrategy(zero_runtime.ZeroConfig(**config), num_cpu_replicas=2)


def assert_parity(stage: int, got, ref) -> None:
    losses, weights = got
    ref_losses, ref_weights = ref
    assert weights.keys() == ref_weights.keys()
    if stage < 3:
        np.testing.assert_array_equal(losses, ref_losses)
        for k in ref_weights:
            np.testing.assert_array_equal(weights[k], ref_weights[k], err_msg=k)
        return
    np.testing.assert_allclose(losses, ref_losses, rtol=BOUND)
    for k, r in ref_weights.items():
        diff = float(np.max(np.abs(weights[k] - r), initial=0.0))
        if any(k[1].endswith(n) for n in NOISE_ONLY):
            assert diff <= 1e-6, (k, diff)
        else:
            assert diff <= BOUND * max(float(np.max(np.abs(r), initial=0.0)), 1e-3), (k, diff)


def assert_zero_placement(strategy, stage: int, model) -> None:
    rows = {r["name"]: r for r in strategy.runtime.placement()["variables"]}
    tag = f"ZeRO-{stage}"
    for v in model.trainable_variables:
        row = next((r for n, r in rows.items() if v.path.endswith(n) or n.endswith(v.path)), None)
        assert row is not None, (v.path, sorted(rows))
        assert tag in row["partitioning"], (v.path, row)


# -- the loop at every stage and tier -----------------------------------------------------
@pytest.mark.parametrize(
    ("name", "stage", "param", "opt", "dist"),
    [
        ("residual", 1, "none", "none", "dataset"),
        ("residual", 2, "none", "cpu", "function"),
        ("residual", 3, "none", "none", "dataset"),
        ("residual", 3, "cpu", "cpu", "function"),
        ("residual", 3, "nvme", "nvme", "dataset"),
        ("convnet", 2, "none", "cpu", "dataset"),
        ("convnet", 3, "cpu", "cpu", "dataset"),
        ("subclassed", 1, "none", "cpu", "dataset"),
        ("subclassed", 3, "cpu", "none", "dataset"),
    ],
)
def test_tutorial_loop_parity(name, stage, param, opt, dist, tmp_path):
    strategy = zero_strategy(stage, param, opt, tmp_path)
    try:
        losses, weights, model = tutorial_loop(strategy, MODELS[name], name, dist=dist)
        assert_zero_placement(strategy, stage, model)
    finally:
        strategy.close()
    assert_parity(stage, (losses, weights), mirrored(name, "adam", dist))


def test_tied_gpt_loop_stage3(tmp_path):
    """A residual transformer whose head reads the embedding table, SGD with momentum."""
    strategy = zero_strategy(3, "cpu", "cpu", tmp_path)
    try:
        got = tutorial_loop(strategy, am.gpt, "gpt", OPTS["sgd"])
        assert_zero_placement(strategy, 3, got[2])
    finally:
        strategy.close()
    assert_parity(3, got[:2], mirrored("gpt", "sgd"))


# -- variations of the loop -----------------------------------------------------------------
def _run(strategy, build, step_fn, opt_fn, epochs: int = 1, kind: str = "residual"):
    """A loop whose train step is ``step_fn(model, optimizer, compute_loss, batch)``."""
    x, y = data(kind)
    dist_ds = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
    )
    with strategy.scope():
        model = build()
        optimizer = opt_fn(model)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def compute_loss(labels, logits, global_batch=GLOBAL):
        return tf.nn.compute_average_loss(
            loss_object(labels, logits), global_batch_size=global_batch
        )

    @tf.function
    def step(batch):
        out = strategy.run(
            functools.partial(step_fn, model, optimizer, compute_loss), args=(batch,)
        )
        return tf.nest.map_structure(
            lambda t: strategy.reduce(tf.distribute.ReduceOp.SUM, t, axis=None), out
        )

    outs = [step(b) for _ in range(epochs) for b in dist_ds]
    weights = [np.asarray(v.numpy()) for v in model.weights]
    return tf.nest.map_structure(lambda *t: np.stack([np.asarray(a) for a in t]), *outs), weights


def _frozen_body(model, optimizer, compute_loss, batch):
    x, y = batch
    head = model.layers[-1].trainable_variables
    with tf.GradientTape() as tape:
        loss = compute_loss(y, model(x, training=True))
    optimizer.apply_gradients(zip(tape.gradient(loss, head), head))
    return loss


def _persistent(model, optimizer, compute_loss, batch):
    x, y = batch
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        loss = compute_loss(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    dx = tape.gradient(loss, x)  # a non-variable source, from the same tape
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss, tf.reduce_sum(tf.abs(dx))


ACCUM = 2


def _accumulated(model, optimizer, compute_loss, batch):
    """Gradients of ACCUM micro-batches summed, then one apply_gradients."""
    x, y = batch
    per = tf.shape(x)[0] // ACCUM
    total, acc = 0.0, None
    for i in range(ACCUM):
        xi, yi = x[i * per : (i + 1) * per], y[i * per : (i + 1) * per]
        with tf.GradientTape() as tape:
            loss = compute_loss(yi, model(xi, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
        total += loss
    optimizer.apply_gradients(zip(acc, model.trainable_variables))
    return total


def _plain(model, optimizer, compute_loss, batch):
    x, y = batch
    with tf.GradientTape() as tape:
        loss = compute_loss(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


def _built_adam(vars_of):
    def make(model):
        opt = keras.optimizers.Adam(1e-2)
        opt.build(vars_of(model))
        return opt

    return make


def _compare(stage: int, got, ref) -> None:
    (outs, weights), (ref_outs, ref_weights) = got, ref
    for a, b in zip(tf.nest.flatten(outs), tf.nest.flatten(ref_outs)):
        if stage < 3:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=BOUND)
    for w, r in zip(weights, ref_weights):
        if stage < 3:
            np.testing.assert_array_equal(w, r)
        else:
            assert np.max(np.abs(w - r)) <= BOUND * max(np.max(np.abs(r)), 1e-3)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize(
    ("step_fn", "vars_of"),
    [
        (_frozen_body, lambda m: m.layers[-1].trainable_variables),
        (_persistent, lambda m: m.trainable_variables),
    ],
    ids=["frozen_body", "persistent_tape"],
)
def test_loop_variations(stage, step_fn, vars_of, tmp_path):
    """A tape over the head only (the optimizer built over the head's variables), and a
    persistent tape that also differentiates the input: equal to MirroredStrategy's."""
    ref = _run(Mirrored(("/cpu:0", "/cpu:1")), residual, step_fn, _built_adam(vars_of))
    strategy = zero_strategy(stage, "cpu", "cpu", tmp_path)
    try:
        got = _run(strategy, residual, step_fn, _built_adam(vars_of))
    finally:
        strategy.close()
    _compare(stage, got, ref)


def test_accumulation_in_loop_equals_big_batch(tmp_path):
    """Stage 3: ACCUM micro-batches' gradients summed in the loop, then one
    apply_gradients, equal one step on the whole batch (MirroredStrategy's)."""
    ref = _run(
        Mirrored(("/cpu:0", "/cpu:1")),
        residual,
        _plain,
        _built_adam(lambda m: m.trainable_variables),
    )
    strategy = zero_strategy(3, "cpu", "cpu", tmp_path)
    try:
        got = _run(strategy, residual, _accumulated, _built_adam(lambda m: m.trainable_variables))
    finally:
        strategy.close()
    _compare(3, got, ref)


def _run_with_vars_read_before_build(strategy):
    """``_run`` of a loop that reads ``train_vars = model.trainable_variables`` before
    ``optimizer.build`` (which shards the model at stage 3) and uses them in
    ``tape.gradient`` and ``apply_gradients``; also returns those variables' values."""
    held = {}

    def make(model):
        held["vars"] = model.trainable_variables
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(held["vars"])
        return optimizer

    def step_fn(model, optimizer, compute_loss, batch):
        x, y = batch
        train_vars = held["vars"]
        with tf.GradientTape() as tape:
            loss = compute_loss(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, train_vars), train_vars))
        return loss

    got = _run(strategy, residual, step_fn, make)
    return got, [np.asarray(v.numpy()) for v in held["vars"]]


def test_variables_read_before_the_build_stand_for_their_shards(tmp_path):
    """Stage 3: the variables a loop read before optimizer.build sharded the model stand
    for their sharded variables (the tape's gradient shard, the update, whole reads):
    trains as under MirroredStrategy."""
    ref, _ = _run_with_vars_read_before_build(Mirrored(("/cpu:0", "/cpu:1")))
    strategy = zero_strategy(3, "cpu", "cpu", tmp_path)
    try:
        got, held = _run_with_vars_read_before_build(strategy)
    finally:
        strategy.close()
    _compare(3, got, ref)
    for h, w in zip(held, got[1]):
        np.testing.assert_array_equal(h, w)


def _whole_shaped_accumulator(model, optimizer, compute_loss, batch):
    """``_accumulated`` with the accumulators made by ``tf.zeros_like(v)`` (whole-shaped)."""
    x, y = batch
    per = tf.shape(x)[0] // ACCUM
    acc = [tf.zeros_like(v) for v in model.trainable_variables]
    for i in range(ACCUM):
        with tf.GradientTape() as tape:
            loss = compute_loss(y[i * per : (i + 1) * per], model(x[i * per : (i + 1) * per]))
        acc = [a + g for a, g in zip(acc, tape.gradient(loss, model.trainable_variables))]
    optimizer.apply_gradients(zip(acc, model.trainable_variables))
    return loss


def _runtime_accumulation(model, optimizer, compute_loss, batch):
    """What the refusal names: every micro-batch's gradients applied, each micro-batch's
    loss averaged over its own examples; ZeroConfig(gradient_accumulation_steps=ACCUM)
    averages them and updates once."""
    x, y = batch
    per = tf.shape(x)[0] // ACCUM
    total = 0.0
    for i in range(ACCUM):
        xi, yi = x[i * per : (i + 1) * per], y[i * per : (i + 1) * per]
        with tf.GradientTape() as tape:
            loss = compute_loss(yi, model(xi, training=True), GLOBAL // ACCUM)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        total += loss / ACCUM
    return total


def test_whole_shaped_accumulators_are_explained_and_runtime_accumulation_works(tmp_path):
    """Stage 3: accumulators made by tf.zeros_like(v) meet the tape's gradient shards;
    the step stops naming ZeroConfig(gradient_accumulation_steps=N), and that loop (an
    apply_gradients per micro-batch) equals one step on the whole batch under Mirrored."""
    make = _built_adam(lambda m: m.trainable_variables)
    strategy = zero_strategy(3, "cpu", "cpu", tmp_path)
    try:
        with pytest.raises(ValueError, match=r"ZeroConfig\(gradient_accumulation_steps=N\)"):
            _run(strategy, residual, _whole_shaped_accumulator, make)
    finally:
        strategy.close()
    ref = _run(Mirrored(("/cpu:0", "/cpu:1")), residual, _plain, make)
    strategy = zero_strategy(3, "cpu", "cpu", tmp_path, gradient_accumulation_steps=ACCUM)
    try:
        got = _run(strategy, residual, _runtime_accumulation, make)
    finally:
        strategy.close()
    _compare(3, got, ref)


def _gan_run(strategy, first: str | None = None):
    """Two models and two optimizers in one step (a GAN on 12-D points): two tapes, both
    gradients taken before either update; or, with ``first`` ("generator" or
    "discriminator"), one persistent tape and that model's update applied before the
    other model's gradient is taken."""
    x, _ = data("residual")
    dist_ds = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(x).batch(GLOBAL)
    )
    with strategy.scope():
        keras.utils.set_random_seed(5)
        generator = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(12)]
        )
        discriminator = keras.Sequential(
            [keras.Input((12,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        g_opt, d_opt = keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3)
        g_opt.build(generator.trainable_variables)
        d_opt.build(discriminator.trainable_variables)
    bce = keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")

    def train_step(real):
        noise = tf.random.stateless_normal([tf.shape(real)[0], 4], seed=[1, 2])
        if first is None:
            g_tape, d_tape = tf.GradientTape(), tf.GradientTape()
        else:  # one persistent tape for both losses
            g_tape = d_tape = tf.GradientTape(persistent=True)
        with contextlib.ExitStack() as stack:
            for tape in {id(t): t for t in (g_tape, d_tape)}.values():
                stack.enter_context(tape)
            fake = generator(noise, training=True)
            real_out = discriminator(real, training=True)
            fake_out = discriminator(fake, training=True)
            g_loss = tf.nn.compute_average_loss(
                bce(tf.ones_like(fake_out), fake_out), global_batch_size=GLOBAL
            )
            d_loss = tf.nn.compute_average_loss(
                bce(tf.ones_like(real_out), real_out) + bce(tf.zeros_like(fake_out), fake_out),
                global_batch_size=GLOBAL,
            )
        steps = [
            (g_tape, g_loss, generator, g_opt),
            (d_tape, d_loss, discriminator, d_opt),
        ]
        if first == "discriminator":
            steps.reverse()
        grads = []
        for tape, loss, model, opt in steps:
            grads.append(tape.gradient(loss, model.trainable_variables))
            if first is not None:  # this model's update before the other's gradient
                opt.apply_gradients(zip(grads[-1], model.trainable_variables))
        if first is None:
            for (_, _, model, opt), g in zip(steps, grads):
                opt.apply_gradients(zip(g, model.trainable_variables))
        return g_loss, d_loss

    @tf.function
    def step(batch):
        g, d = strategy.run(train_step, args=(batch,))
        return [strategy.reduce(tf.distribute.ReduceOp.SUM, t, axis=None) for t in (g, d)]

    losses = np.array([[float(t) for t in step(b)] for b in dist_ds])
    weights = [np.asarray(v.numpy()) for m in (generator, discriminator) for v in m.weights]
    return losses, weights


@pytest.mark.parametrize("first", [None, "generator"])
def test_gan_two_models_two_optimizers(first, tmp_path):
    """Both gradients before both updates; or a persistent tape with the generator's
    update applied before the discriminator's gradient is taken (its backward runs
    through the generator's uses without needing them): as under MirroredStrategy."""
    ref = _gan_run(Mirrored(("/cpu:0", "/cpu:1")), first)
    strategy = zero_strategy(3, "cpu", "cpu", tmp_path)
    try:
        got = _gan_run(strategy, first)
    finally:
        strategy.close()
    _compare(3, got, ref)


def test_a_gradient_through_a_model_already_updated_in_the_step_is_refused(tmp_path):
    """A persistent tape whose discriminator is updated before the generator's gradient
    is taken through it: the discriminator's backward would gather its updated shards
    (Mirrored differentiates the forward's values), so the step stops naming the fix."""
    strategy = zero_strategy(3, "cpu", "cpu", tmp_path)
    try:
        with pytest.raises(Exception, match="Take every gradient first, then apply"):
            _gan_run(strategy, "discriminator")
    finally:
        strategy.close()


# -- telemetry and whole reads around a custom loop ------------------------------------------
def test_custom_loop_records_every_step_and_reads_whole_between_steps(tmp_path):
    """Stage 3 with host parameters: the runtime records every step of the user's loop
    (found from apply_gradients, no call from the user) with the host tier holding the
    shards, and between steps a sharded variable reads and assigns as the whole tensor
    (numpy, value, tf.identity, an EMA kept by the loop, get_weights / set_weights)."""
    strategy = zero_runtime.ZeroInfinityStrategy(
        zero_runtime.ZeroConfig(
            stage=3,
            offload_param="cpu",
            offload_optimizer="cpu",
            mirrored_fallback_bytes=0,
            page_size_bytes=65536,
        ),
        logdir=str(tmp_path / "run"),
        num_cpu_replicas=2,
    )
    try:
        losses, _, model = tutorial_loop(strategy, residual, "residual", epochs=1)
        records = strategy.runtime.recorder.last()
        assert [r.step for r in records] == list(range(len(losses)))
        assert all(r.stage == 3 and not r.fallback_mirrored for r in records)
        host = records[-1].tiers["host"]
        shard_bytes = sum(4 * v.shard_elements * 2 for v in model.trainable_variables)
        assert host.param_bytes >= shard_bytes, (host, shard_bytes)

        kernel = model.trainable_variables[0]
        whole = kernel.numpy()
        assert whole.shape == tuple(kernel.shape)
        np.testing.assert_array_equal(np.asarray(kernel.value), whole)
        np.testing.assert_array_equal(tf.identity(kernel).numpy(), whole)
        np.testing.assert_array_equal(model.get_weights()[0], whole)
        ema = 0.9 * whole + 0.1 * np.ones_like(whole)  # a loop's EMA of the weights
        kernel.assign(ema)
        np.testing.assert_array_equal(kernel.numpy(), ema)
        weights = model.get_weights()
        model.set_weights([w * 0.5 for w in weights])
        np.testing.assert_array_equal(kernel.numpy(), ema * 0.5)
    finally:
        strategy.close()
    events = list((tmp_path / "run").rglob("events.out.tfevents.*"))
    assert events and max(e.stat().st_size for e in events) > 0


def regularized() -> keras.Model:
    keras.utils.set_random_seed(6)
    inp = keras.Input((12,))
    h = keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(0.05))(
        inp
    )
    return keras.Model(inp, keras.layers.Dense(5)(h))


def _with_regularization(model, optimizer, compute_loss, batch):
    """The tutorial's form: the model's weight penalties, scaled for the replicas."""
    x, y = batch
    with tf.GradientTape() as tape:
        loss = compute_loss(y, model(x, training=True))
        loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


def test_weight_regularizer_counts_at_stage3(tmp_path):
    """A kernel_regularizer's penalty is in model.losses at stage 3 too (a gathered read
    of the sharded kernel, with its gradient): equal to MirroredStrategy's."""
    make = _built_adam(lambda m: m.trainable_variables)
    ref = _run(Mirrored(("/cpu:0", "/cpu:1")), regularized, _with_regularization, make)
    strategy = zero_strategy(3, "cpu", "cpu", tmp_path)
    try:
        got = _run(strategy, regularized, _with_regularization, make)
    finally:
        strategy.close()
    _compare(3, got, ref)


def test_a_weight_constraint_is_refused_at_stage3(tmp_path):
    strategy = zero_strategy(3, "cpu", "cpu", tmp_path)
    try:
        with strategy.scope():
            inp = keras.Input((12,))
            out = keras.layers.Dense(5, kernel_constraint=keras.constraints.MaxNorm(0.3))(inp)
            model = keras.Model(inp, out)
            optimizer = keras.optimizers.Adam(1e-2)
            with pytest.raises(NotImplementedError, match=r"has a constraint \(MaxNorm\)"):
                optimizer.build(model.trainable_variables)
        assert not any(type(v).__name__ == "ShardedVariable" for v in model.weights)
    finally:
        strategy.close()


@pytest.mark.parametrize("kind", ["sharded", "tf.train.Checkpoint"])
@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_of_a_custom_loop_holds_the_optimizer(stage, kind, tmp_path):
    """A tape loop's checkpoint holds the optimizer's states: the sharded one
    (strategy.save_checkpoint(dir, model) of an uncompiled model finds the optimizer built
    over its variables) and TensorFlow's (tf.train.Checkpoint(model=..., optimizer=...),
    the states gathered from the shards). Restored, the next steps repeat exactly."""
    strategy = zero_strategy(stage, "cpu", "cpu", tmp_path)
    x, y = data("residual")
    try:
        with strategy.scope():
            model = residual()
            optimizer = keras.optimizers.Adam(1e-2)
            optimizer.build(model.trainable_variables)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

        def train_step(batch):
            xb, yb = batch
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    loss_object(yb, model(xb, training=True)), global_batch_size=GLOBAL
                )
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @tf.function
        def step(batch):
            return strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), axis=None)

        batches = list(
            strategy.experimental_distribute_dataset(
                tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
            )
        )
        for b in batches[:4]:
            step(b)
        if kind == "sharded":
            saved = strategy.save_checkpoint(str(tmp_path / "ckpt"), model)
            assert saved.step == 4
        else:
            ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)
            path = ckpt.save(str(tmp_path / "tf" / "ckpt"))
        after = [float(step(b)) for b in batches[4:8]]
        if kind == "sharded":
            strategy.load_checkpoint(str(tmp_path / "ckpt"), model)
        else:
            ckpt.restore(path).assert_existing_objects_matched()
        assert int(optimizer.iterations.numpy()) == 4
        again = [float(step(b)) for b in batches[4:8]]
    finally:
        strategy.close()
    assert again == after


def test_a_loop_without_optimizer_build_is_told_to_build_it(tmp_path):
    """Stage 3 shards the model when the optimizer is built; a loop that leaves the build
    to its first apply_gradients (inside the tf.function) is refused naming the fix."""
    strategy = zero_strategy(3, "cpu", "cpu", tmp_path)
    x, y = data("residual")
    try:
        with strategy.scope():
            model = residual()
            optimizer = keras.optimizers.Adam(1e-2)

        def train_step(batch):
            xb, yb = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @tf.function
        def step(batch):
            return strategy.run(train_step, args=(batch,))

        batch = next(
            iter(
                strategy.experimental_distribute_dataset(
                    tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
                )
            )
        )
        with pytest.raises(ValueError, match=r"optimizer\.build\(model\.trainable_variables\)"):
            step(batch)
    finally:
        strategy.close()
