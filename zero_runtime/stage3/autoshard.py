"""Stage 3 through plain ``compile``/``fit``: the model is sharded by the runtime.

With ``ZeroConfig(stage=3)`` a model created and compiled inside ``strategy.scope()`` is
sharded the first time Keras builds its optimizer: ``fit``, ``train_on_batch``,
``evaluate`` and ``test_on_batch`` call ``Trainer._symbolic_build`` before they trace
anything, and that calls ``model.optimizer.build(model.trainable_variables)``. The
partitioned optimizer's ``build`` (zero_runtime/optim/partitioned.py) hands the unsharded
variables to the strategy, which finds the trainer (:func:`find_trainer`) and shards it
in place (``strategy.shard_model``). Measured with Keras 3.15.1: this is the one runtime
object Keras calls with the model's variables before the first trace; none of the
strategy's methods Keras calls (``scope``, ``run``, ``reduce``,
``experimental_distribute_dataset``) receives the model, and ``compile`` builds nothing.
No Keras class is patched: the user's model instance gets its stage-3 ``train_step`` and
``call`` as instance attributes (:func:`bind`), so ``model.fit`` on the user's own object
runs stage 3 and ``model.get_weights()``/``model.save()`` gather on demand.

A model that cannot be found or sharded stops here, before its first step, with an error
naming the layer and the reason: nothing trains under another stage than the config's.
"""

from __future__ import annotations

import sys

import keras
import tensorflow as tf
from tensorflow.python.eager import record  # is a GradientTape recording (no public API)

# Frames searched above trainer_to_shard for the trainer. Keras 3.15: autoshard_stage3,
# the optimizer's build, then ``_symbolic_build`` (or ``compile_from_config``), the 4th;
# the margin covers a LossScaleOptimizer or a decorator around build.
_MAX_FRAMES = 10

CUSTOM_LOOP_FORM = (
    "strategy.run(model.train_step, args=(batch,)) inside a tf.function, after "
    "model.compile(optimizer=..., loss=...) and strategy.shard_model(model) "
    "(docs/zero_stages.md, 'Custom training loops at stage 3')"
)


def _owns(model: keras.Model, optimizer) -> bool:
    opt = getattr(model, "optimizer", None)
    return opt is not None and (
        opt is optimizer or getattr(opt, "inner_optimizer", None) is optimizer
    )


def find_trainer(optimizer) -> keras.Model | None:
    """The ``keras.Model`` whose ``fit``/``evaluate`` is building ``optimizer`` now.

    Looks at the ``self`` of the few frames above the caller: Keras's
    ``Trainer._symbolic_build`` (or ``compile_from_config``) is the model that owns the
    optimizer (``model.optimizer is optimizer``, or its ``inner_optimizer``).

    Returns:
        The model, or None when the optimizer is built by other code (a custom loop's
        ``optimizer.build`` or ``apply_gradients``).
    """
    frame = sys._getframe(1)  # noqa: SLF001
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.Model) and _owns(owner, optimizer):
            return owner
        frame = frame.f_back
    return None


def trainer_to_shard(optimizer, variables: list) -> keras.Model:
    """The model to shard for ``optimizer``, being built over unsharded ``variables``.

    Raises:
        ValueError: the optimizer is built inside a traced function (the model was
            created outside ``strategy.scope()``, so Keras builds it in the first step)
            or by code other than Keras's ``fit``/``evaluate`` (a custom loop); the
            message names the first variable and the supported forms.
    """
    first = getattr(variables[0], "path", variables[0].name) if variables else None
    head = (
        f"stage 3: the optimizer is being built over {len(variables)} unsharded "
        f"variable(s) (first: {first!r})"
    )
    if tf.inside_function():
        raise ValueError(
            f"{head} inside a traced step: create the model inside strategy.scope(), so "
            "that fit/evaluate shard it before the first step, or call "
            "strategy.shard_model(model) first"
        )
    model = find_trainer(optimizer)
    if model is None:
        raise ValueError(
            f"{head} outside Keras's fit/evaluate. Stage 3 shards a compiled model at "
            "its first fit/train_on_batch/evaluate; a custom loop runs "
            f"{CUSTOM_LOOP_FORM}"
        )
    return model


def bind(model: keras.Model, train_step, forward, in_step=None, wrap_train_function=None) -> None:
    """Make ``model`` (the user's object) run stage 3 in place.

    Sets instance attributes, not class ones: ``train_step`` (the stage-3 step, with
    ``model``'s own optimizer, loss, loss tracker and metrics) and ``call`` (in a traced
    replica context, ``forward(inputs, training)``: the engine's block-by-block forward
    with gathers; elsewhere the model's own ``call``, reading gathered-on-demand weights),
    so Keras's ``test_step``/``predict_step`` and ``make_train_function`` pick them up.
    ``call`` under a recording ``tf.GradientTape`` in a traced replica context (a user's
    custom loop) raises ``RuntimeError`` naming the supported form, before any gather.

    Args:
        model: the sharded model (its trainable weights are ShardedVariables).
        train_step: ``data -> logs`` for ``model``.
        forward: ``(inputs, training: bool) -> outputs`` in replica context.
        in_step: ``() -> bool``, True while the engine's own step traces the model
            (its tape is the engine's, not a user's); default: never.
        wrap_train_function: ``(train_function, model) -> train_function``, applied to
            the ``train_function`` Keras makes for ``model`` (``make_train_function``
            becomes an instance attribute); default None: Keras's as is.
    """
    # The model's call as it is now: its own, or a unit's hook when the model itself owns
    # weights (zero_runtime/stage3/gather.py).
    own_call = model.__dict__.get("call") or type(model).call.__get__(model)
    takes_training = getattr(model, "_call_has_training_arg", True)

    def call(inputs, *args, training=None, **kwargs):
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1 and tf.inside_function():
            if record.could_possibly_record() and not (in_step and in_step()):
                # Refused before any collective is traced: a replica that stops half-way
                # through a traced step would leave the others' collectives waiting.
                raise RuntimeError(
                    f"model {model.name!r} runs at ZeRO stage 3: its parameters are "
                    "sharded and gathered block by block, so a tf.GradientTape over "
                    "model(x) cannot differentiate them. Train with model.fit, or in a "
                    f"custom loop with {CUSTOM_LOOP_FORM}"
                )
            return forward(inputs, training=bool(training))
        if takes_training:
            kwargs["training"] = training
        return own_call(inputs, *args, **kwargs)

    # object.__setattr__: plain attributes, not tracked by Keras (nothing to save).
    object.__setattr__(model, "train_step", train_step)
    object.__setattr__(model, "call", call)
    if wrap_train_function is not None:
        own_make = type(model).make_train_function.__get__(model)

        def make_train_function(force: bool = False):
            own_make(force)
            model.train_function = wrap_train_function(model.train_function, model)
            return model.train_function

        object.__setattr__(model, "make_train_function", make_train_function)
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:  # traced before: re-trace with these
            setattr(model, name, None)
