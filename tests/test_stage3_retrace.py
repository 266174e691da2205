"""Stage 3 traces its train step once per input signature, not once per epoch
(docs/design/stage3.md, "No retrace per epoch").

A chain and a non-chain model train for three epochs under plain ``compile``/``fit``,
with parameters and optimizer states on the device (``offload_param`` "none") and on the
host ("cpu"), run by units (zero_runtime/stage3/units_path.py); the chain also on the
host under an int device budget ("cpu-budget": the device plan sizes the pool,
zero_runtime/stage3/device_plan.py). Traces are counted two ways:
Python-side entries into the traced step
(stage 3: ``Stage3Engine.forward_backward``, which the train step calls;
MirroredStrategy: the model's ``train_step``), entered only while tracing, once per local
replica per trace; and
``experimental_get_tracing_count()`` summed over every ``tf.function`` reachable from
``model.train_function`` at each epoch's end, over all the distinct functions seen (so a
train function remade per epoch counts as a retrace too). MirroredStrategy on the same
model and data is the reference.

Two causes of a second trace are kept apart: with ``drop_remainder`` batches (every batch
the same shape) exactly one trace is asserted; with a smaller last batch the count must
equal MirroredStrategy's (Keras's ``reduce_retracing`` may add one relaxed-shape trace),
and it must not grow with the epochs.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers.mirrored import Mirrored
from test_stage3_step_clock import _tf_functions

import zero_runtime
from zero_runtime.stage3.engine import Stage3Engine

BATCH, STEPS, EPOCHS = 8, 4, 3
BASE = {"stage": 3, "page_size_bytes": 65536, "collective_timeout_seconds": 30}
OFFLOAD = {
    "none": {**BASE, "offload_param": "none", "offload_optimizer": "none"},
    "cpu": {**BASE, "offload_param": "cpu", "offload_optimizer": "cpu"},
    "cpu-budget": {
        **BASE,
        "offload_param": "cpu",
        "offload_optimizer": "cpu",
        "device_budget_bytes": 16 << 20,
    },
}


def _chain() -> keras.Model:
    """A chain of Dense layers (a keras.Sequential), run by units like any model."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(5),
        ]
    )


def _dag() -> keras.Model:
    """A residual DAG (not a chain): stage 3 runs it by wrapping units."""
    keras.utils.set_random_seed(0)
    x = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu")(x)
    h = keras.layers.Add()([h, keras.layers.Dense(32, activation="relu")(h)])
    return keras.Model(x, keras.layers.Dense(5)(h))


MODELS = {"chain": _chain, "dag": _dag}


def _dataset(uneven: bool) -> tf.data.Dataset:
    """``STEPS`` batches of ``BATCH`` (drop_remainder), or with ``uneven`` a last batch of
    ``BATCH - 2`` after them."""
    rng = np.random.RandomState(1)
    n = STEPS * BATCH + (BATCH - 2 if uneven else 0)
    x = rng.randn(n, 16).astype("float32")
    y = rng.randint(0, 5, (n,)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=not uneven)


class _Traces(keras.callbacks.Callback):
    """Per epoch end: the total tracing count of the ``tf.function`` objects behind
    ``model.train_function`` (summed over every distinct function seen so far)."""

    def __init__(self) -> None:
        super().__init__()
        self.functions: dict[int, tf.types.experimental.PolymorphicFunction] = {}
        self.per_epoch: list[int] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        for f in _tf_functions(self.model.train_function):
            self.functions[id(f)] = f
        self.per_epoch.append(
            sum(f.experimental_get_tracing_count() for f in self.functions.values())
        )


def _counting(fn, entries: list):
    """``fn`` that appends whether it runs inside a traced function to ``entries``."""

    def counted(*args, **kwargs):
        entries.append(tf.inside_function())
        return fn(*args, **kwargs)

    return counted


def _fit_counting(strategy, build, uneven: bool, entries: list) -> list[int]:
    """Train ``build()`` under ``strategy`` for ``EPOCHS`` epochs; ``entries`` receives the
    Python-side step entries (under MirroredStrategy: of the model's ``train_step``).

    Returns:
        the tf.function tracing totals at each epoch's end.
    """
    with strategy.scope():
        model = build()
        model.compile(
            optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    if not isinstance(strategy, zero_runtime.ZeroInfinityStrategy):
        object.__setattr__(model, "train_step", _counting(model.train_step, entries))
    traces = _Traces()
    model.fit(_dataset(uneven), epochs=EPOCHS, verbose=0, shuffle=False, callbacks=[traces])
    assert entries and all(entries), f"the step was not traced, or ran eagerly: {entries}"
    return traces.per_epoch


@pytest.fixture
def stage3_entries(monkeypatch) -> list:
    """Entries into ``Stage3Engine.forward_backward`` (True: while tracing)."""
    entries: list = []
    own = Stage3Engine.forward_backward

    def counted(self, *args, **kwargs):
        return _counting(own, entries)(self, *args, **kwargs)

    monkeypatch.setattr(Stage3Engine, "forward_backward", counted)
    return entries


@pytest.fixture(scope="module")
def mirrored_counts(cpu_devices):
    """``{(model, uneven): (train_step entries, per-epoch tracing totals)}`` under
    MirroredStrategy."""
    out = {}
    for name, build in MODELS.items():
        for uneven in (False, True):
            entries: list = []
            per_epoch = _fit_counting(Mirrored(cpu_devices), build, uneven, entries)
            out[name, uneven] = (len(entries), per_epoch)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "offload"),
    [(name, offload) for name in sorted(MODELS) for offload in ("cpu", "none")]
    + [("chain", "cpu-budget")],
)
def test_stage3_traces_its_step_once_not_per_epoch(
    name, offload, mirrored_counts, cpu_devices, stage3_entries
):
    strategy = zero_runtime.ZeroInfinityStrategy(OFFLOAD[offload])
    try:
        per_epoch = _fit_counting(strategy, MODELS[name], False, stage3_entries)
        entries = len(stage3_entries)
        engine = strategy.runtime.accounting.stage3_engines[-1]
        budget = OFFLOAD[offload].get("device_budget_bytes")
        assert budget is None or engine.device_plan.total <= budget
    finally:
        strategy.close()
    ref_entries, ref_per_epoch = mirrored_counts[name, False]
    once = len(cpu_devices)  # one trace: train_step entered once per replica
    assert (ref_entries, ref_per_epoch[0]) == (once, ref_per_epoch[-1])  # the reference
    assert entries == once, f"the step entered {entries} times in {EPOCHS} epochs of one shape"
    assert per_epoch == [per_epoch[0]] * EPOCHS, f"tracing totals per epoch grew: {per_epoch}"
    assert per_epoch[0] == ref_per_epoch[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_smaller_last_batch_traces_as_under_mirrored(name, mirrored_counts, stage3_entries):
    strategy = zero_runtime.ZeroInfinityStrategy(OFFLOAD["none"])
    try:
        per_epoch = _fit_counting(strategy, MODELS[name], True, stage3_entries)
        entries = len(stage3_entries)
    finally:
        strategy.close()
    ref_entries, ref_per_epoch = mirrored_counts[name, True]
    assert ref_per_epoch == [ref_per_epoch[0]] * EPOCHS  # the reference: not per epoch
    assert entries == ref_entries, (entries, ref_entries)
    assert per_epoch == ref_per_epoch
