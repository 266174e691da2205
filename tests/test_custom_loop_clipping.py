"""``tf.clip_by_global_norm`` in a user's tape loop: the true global norm at stage 3.

At stage 3 the tape returns each replica's shards of the reduced gradient; the clip and
``tf.linalg.global_norm`` then take the norm of the reduced gradient over every replica's
shards (zero_runtime/stage3/shard_norm.py). The reference is ``MirroredStrategy`` running
the same loop on the reduced gradient: its replicas all-reduce the tape's gradients, clip
them with TensorFlow's function, and pass ``clipped / N`` to ``apply_gradients`` (Keras
sums the replicas' gradients again; with N = 2 the halving and doubling are exact). At
stages 0-2 the tape's gradients are each replica's own, and a loop clipping them equals
``MirroredStrategy`` bitwise.
"""

from __future__ import annotations

import functools
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers.mirrored import Mirrored
from tensorflow.python.ops import clip_ops
from test_custom_loop import BOUND, GLOBAL, _run, data, residual, zero_strategy

import zero_runtime
from zero_runtime.stage3 import shard_norm

N = 2
#: A replicated whole tensor beside the shards: ||HALF||^2 = 3 * 0.25 counted once.
HALF = (3, 0.5)
#: Clip norms: the reduced gradient's norm is above 1 at every step of the run (0.2
#: binds), and far below 1e3 (never binds).
BINDS, FREE = 0.2, 1e3


def _sgd(model, momentum: float = 0.9) -> keras.optimizers.Optimizer:
    optimizer = keras.optimizers.SGD(0.05, momentum=momentum)
    optimizer.build(model.trainable_variables)
    return optimizer


def _clip_step(clip: float, reduce_first: bool, model, optimizer, compute_loss, batch):
    """The train step with ``tf.clip_by_global_norm``.

    ``reduce_first``: the replicas all-reduce the tape's gradients before the clip and
    apply ``clipped / N`` (the reference); otherwise the tape's gradients are clipped as
    they are (stage 3: shards of the reduced gradient; Mirrored, stages 0-2: local ones).
    """
    x, y = batch
    with tf.GradientTape() as tape:
        loss = compute_loss(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    if reduce_first:  # the dense sum (an embedding's IndexedSlices would be concatenated)
        grads = [tf.convert_to_tensor(g) for g in grads]
        grads = tf.distribute.get_replica_context().all_reduce("SUM", grads)
    logged = tf.linalg.global_norm(grads)
    mixed = tf.linalg.global_norm([*grads, tf.fill([HALF[0]], HALF[1])])
    local = clip_ops.global_norm(grads)  # TensorFlow's own: this replica's tensors
    clipped, norm = tf.clip_by_global_norm(grads, clip)
    if reduce_first:
        clipped = [g / N for g in clipped]
    optimizer.apply_gradients(zip(clipped, model.trainable_variables))
    return {"loss": loss, "norm": norm, "logged": logged, "mixed": mixed, "local": local}


def _loop(strategy, clip: float, reduce_first: bool):
    """10 steps of :func:`_clip_step` under ``strategy``: ``({name: (steps,) summed over
    the replicas}, weights)``."""
    return _run(strategy, residual, functools.partial(_clip_step, clip, reduce_first), _sgd)


def token_model() -> keras.Model:
    """Tokens ``(B, 6)`` -> a 13 x 16 ``Embedding`` -> ``Dense(32, relu)`` -> logits
    ``(B, 6, 13)`` (a 13-element bias: padded shards)."""
    keras.utils.set_random_seed(7)
    inp = keras.Input((6,), dtype="int32")
    h = keras.layers.Dense(32, activation="relu")(keras.layers.Embedding(13, 16)(inp))
    return keras.Model(inp, keras.layers.Dense(13)(h))


def _token_loop(strategy, reduce_first: bool):
    """:func:`_loop` on :func:`token_model` and next-token data, plain SGD (a row-paged
    table's momentum is lazy)."""
    step = functools.partial(_clip_step, BINDS, reduce_first)
    sgd = functools.partial(_sgd, momentum=0.0)
    return _run(strategy, token_model, step, sgd, kind="gpt")


@functools.cache
def reference(clip: float):
    return _loop(Mirrored(("/cpu:0", "/cpu:1")), clip, reduce_first=True)


@pytest.mark.slow
@pytest.mark.parametrize("param", ["none", "cpu"])
@pytest.mark.parametrize("clip", [BINDS, FREE], ids=["binds", "free"])
def test_stage3_clip_by_global_norm_is_the_reduced_gradients(clip, param, tmp_path):
    """Stage 3 clips its shards by the reduced gradient's norm: losses, norms (the clip's,
    tf.linalg.global_norm's, one with a replicated whole tensor beside the shards) and
    weights equal the reference's within 1e-5 relative over 10 steps."""
    ref, ref_weights = reference(clip)
    norms = ref["norm"] / N  # the same on both replicas
    assert (norms > clip).all() if clip == BINDS else (norms < clip).all(), norms
    strategy = zero_strategy(3, param, "cpu", tmp_path)
    try:
        got, weights = _loop(strategy, clip, reduce_first=False)
    finally:
        strategy.close()
    for k in ("loss", "norm", "logged"):
        print(f"{k}: max relative difference {np.max(np.abs(got[k] / ref[k] - 1)):.2g}")
        np.testing.assert_allclose(got[k], ref[k], rtol=BOUND, err_msg=k)
    np.testing.assert_allclose(got["logged"], got["norm"], rtol=BOUND)
    whole = N * np.sqrt(norms**2 + HALF[0] * HALF[1] ** 2)  # counted once
    np.testing.assert_allclose(got["mixed"], whole, rtol=BOUND)
    assert (got["local"] < 0.95 * got["norm"]).all()  # one replica's shards: not the norm
    worst = max(np.max(np.abs(w - r)) / np.max(np.abs(r)) for w, r in zip(weights, ref_weights))
    print(f"weights: max |difference| / max |reference| {worst:.2g}")
    for w, r in zip(weights, ref_weights):
        assert np.max(np.abs(w - r)) <= BOUND * max(np.max(np.abs(r)), 1e-3)


@pytest.mark.slow
def test_a_row_paged_tables_gradient_counts_once(tmp_path):
    """A row-paged embedding table's gradient in the tape (its touched rows, ``(K, C)``,
    already all-reduced: the same on every replica) is a whole tensor beside the shards:
    counted once in the norm, clipped with them. Equal to the reference on the dense
    gradient within 1e-5."""
    ref, ref_weights = _token_loop(Mirrored(("/cpu:0", "/cpu:1")), reduce_first=True)
    assert (ref["norm"] / N > BINDS).all()
    config = zero_runtime.ZeroConfig(
        stage=3,
        offload_param="cpu",
        offload_optimizer="cpu",
        mirrored_fallback_bytes=0,
        page_size_bytes=65536,
        embedding_row_paging_threshold=13 * 16,
    )
    strategy = zero_runtime.ZeroInfinityStrategy(config, num_cpu_replicas=2)
    try:
        got, weights = _token_loop(strategy, reduce_first=False)
        (engine,) = strategy.runtime.accounting.stage3_engines
        assert len(engine.row_paged) == 1
    finally:
        strategy.close()
    for k in ("loss", "norm", "logged", "mixed"):
        np.testing.assert_allclose(got[k], ref[k], rtol=BOUND, err_msg=k)
    for w, r in zip(weights, ref_weights):
        assert np.max(np.abs(w - r)) <= BOUND * max(np.max(np.abs(r)), 1e-3)


@pytest.mark.slow
def test_stage2_clip_is_mirroreds_local_clip(tmp_path):
    """Stages 0-2 hold no shards: the installed wrappers run TensorFlow's function, and a
    loop clipping each replica's local gradient equals MirroredStrategy's bitwise."""
    shard_norm.install()
    assert tf.clip_by_global_norm is not clip_ops.clip_by_global_norm
    ref = _loop(Mirrored(("/cpu:0", "/cpu:1")), BINDS, reduce_first=False)
    strategy = zero_strategy(2, "none", "cpu", tmp_path)
    try:
        got = _loop(strategy, BINDS, reduce_first=False)
    finally:
        strategy.close()
    for k in ref[0]:
        np.testing.assert_array_equal(got[0][k], ref[0][k], err_msg=k)
    np.testing.assert_array_equal(ref[0]["norm"], ref[0]["local"])  # the local norms
    for w, r in zip(got[1], ref[1]):
        np.testing.assert_array_equal(w, r)


def test_wrappers_keep_tensorflows_signature_docstring_and_result():
    shard_norm.install()
    for ours, theirs in [
        (tf.clip_by_global_norm, clip_ops.clip_by_global_norm),
        (tf.linalg.global_norm, clip_ops.global_norm),
        (tf.compat.v1.global_norm, clip_ops.global_norm),
    ]:
        assert ours is not theirs
        assert inspect.signature(ours) == inspect.signature(theirs)
        assert ours.__doc__ == theirs.__doc__ and ours.__name__ == theirs.__name__
    ts = [tf.constant([3.0, 4.0]), None, tf.constant([[12.0]])]
    clipped, norm = tf.clip_by_global_norm(ts, 6.5)
    ref_clipped, ref_norm = clip_ops.clip_by_global_norm(ts, 6.5)
    assert float(norm) == float(ref_norm) == 13.0
    assert float(tf.linalg.global_norm(ts)) == 13.0
    for a, b in zip(clipped, ref_clipped):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(a, b)


def _bypass(grads):
    """TensorFlow's own clip (the module, past the installed wrapper)."""
    return clip_ops.clip_by_global_norm(grads, BINDS)[0]


def _reshaped(grads):
    """A norm of tensors made from the shards by an op that is not a sum or a scaling."""
    norm = tf.linalg.global_norm([tf.reshape(g, [-1, 1]) for g in grads])
    return [g * BINDS / tf.maximum(norm, BINDS) for g in grads]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "match"),
    [(_bypass, "TensorFlow's own global norm"), (_reshaped, "neither a sum of shards")],
    ids=["clip_ops_directly", "reshaped_shards"],
)
def test_a_local_norm_of_shards_is_refused(change, match, tmp_path):
    strategy = zero_strategy(3, "none", "cpu", tmp_path)
    x, y = data("residual")
    try:
        with strategy.scope():
            model = residual()
            optimizer = keras.optimizers.SGD(0.05)
            optimizer.build(model.trainable_variables)

        def train_step(batch):
            xb, yb = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True)))
            grads = change(tape.gradient(loss, model.trainable_variables))
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @tf.function
        def step(batch):
            return strategy.run(train_step, args=(batch,))

        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
        batch = next(iter(strategy.experimental_distribute_dataset(ds)))
        with pytest.raises(ValueError, match=match):
            step(batch)
    finally:
        strategy.close()
