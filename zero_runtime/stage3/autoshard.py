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
    "(docs/stages/custom-loops.md)"
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
            message names the first variable and the supported forms. Or the model is
            sharded already and some of ``variables`` are not (:func:`_refuse_unfrozen`).
    """
    first = getattr(variables[0], "path", variables[0].name) if variables else None
    head = (
        f"stage 3: the optimizer is being built over {len(variables)} unsharded "
        f"variable(s) (first: {first!r})"
    )
    if tf.inside_function():
        if find_trainer(optimizer) is None:  # a custom loop's first apply_gradients
            raise ValueError(
                f"{head} inside the traced step of a custom loop: build it before the "
                "tf.function, inside strategy.scope(), with "
                "optimizer.build(model.trainable_variables) (this shards the model)"
            )
        raise ValueError(
            f"{head} inside a traced step: create the model inside strategy.scope(), so "
            "that fit/evaluate shard it before the first step"
        )
    model = find_trainer(optimizer) or find_model_of(variables) or find_model_of(variables, True)
    if getattr(model, "_zero_stage3_sharded", False):
        _refuse_unfrozen(model, variables)
    if model is None:
        raise ValueError(
            f"{head}, and no Keras model holding them was found: build the optimizer "
            "over a model's variables (optimizer.build(model.trainable_variables)) "
            "where the model is a variable of the calling code, or call "
            "strategy.shard_model(model) first"
        )
    return model


def _refuse_unfrozen(model: keras.Model, variables: list) -> None:
    """Raise for an optimizer built over weights of a sharded ``model`` that were not
    sharded: frozen (``trainable = False``) when the model was sharded, so replicated
    (docs/stages/stage3.md, "Frozen weights"), and unfrozen since.

    Raises:
        ValueError: naming the first such weight and the fix (shard the model while
            those layers are trainable; freezing and unfreezing then work).
    """
    from zero_runtime.sharded_variable import ShardedVariable

    plain = [v for v in variables if not isinstance(v, ShardedVariable)]
    first = getattr(plain[0], "path", plain[0].name) if plain else None
    raise ValueError(
        f"stage 3: model {model.name!r} was sharded while {len(plain)} of the weights "
        f"now trainable were frozen (first: {first!r}): frozen weights stay replicated, "
        "and the sharded model cannot take them in later. Shard the model while every "
        "layer you will train is trainable: call strategy.shard_model(model) (inside "
        "strategy.scope()) before setting layer.trainable = False; freezing and "
        "unfreezing its layers afterwards work, each compile planning the optimizer "
        "over the trainable weights"
    )


def find_model_of(variables: list, sharded: bool = False) -> keras.Model | None:
    """The outermost ``keras.Model`` that holds every one of ``variables`` (a custom
    loop's ``optimizer.build(model.trainable_variables)``, or a head's variables only);
    ``sharded``: among the models stage 3 has sharded already (default: the others).

    Looks at the models the calling frames name (their locals and globals: a tutorial's
    ``model``, a GAN's ``generator``), then, if none holds them, at every live model
    (``gc``). Among those holding all the variables, the one holding the most weights
    (the whole model, not a sub-model).

    Returns:
        The model, or None.
    """
    wanted = {id(v) for v in variables}
    if not wanted:
        return None

    def best(candidates) -> keras.Model | None:
        found, seen = None, set()
        for m in candidates:
            if id(m) in seen or getattr(m, "_zero_stage3_sharded", False) != sharded:
                continue
            seen.add(id(m))
            ids = {id(v) for v in m.trainable_variables}
            if wanted <= ids and (found is None or len(m.weights) > len(found.weights)):
                found = m
        return found

    frame, named = sys._getframe(1), []  # noqa: SLF001
    while frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            named.extend(v for v in scope.values() if isinstance(v, keras.Model))
        frame = frame.f_back
    model = best(named)
    if model is None:
        import gc

        model = best(o for o in gc.get_objects() if isinstance(o, keras.Model))
    return model


def bind(
    model: keras.Model,
    train_step,
    forward,
    in_step=None,
    wrap_train_function=None,
    user_forward=None,
) -> None:
    """Make ``model`` (the user's object) run stage 3 in place.

    Sets instance attributes, not class ones: ``train_step`` (the stage-3 step, with
    ``model``'s own optimizer, loss, loss tracker and metrics) and ``call`` (in a traced
    replica context, ``forward(inputs, training)``: the engine's block-by-block forward
    with gathers; elsewhere the model's own ``call``, reading gathered-on-demand weights),
    so Keras's ``test_step``/``predict_step`` and ``make_train_function`` pick them up.
    ``call`` under a user's recording ``tf.GradientTape`` in a traced replica context (a
    custom loop) runs ``user_forward`` (the tape then differentiates the sharded
    variables: :meth:`zero_runtime.stage3.units_path.UnitsPath.user_forward`); eagerly
    it raises ``RuntimeError`` asking for a ``tf.function``.

    Args:
        model: the sharded model (its trainable weights are ShardedVariables).
        train_step: ``data -> logs`` for ``model``.
        forward: ``(inputs, training: bool) -> outputs`` in replica context.
        in_step: ``() -> bool``, True while the engine's own step traces the model
            (its tape is the engine's, not a user's); default: never.
        wrap_train_function: ``(train_function, model) -> train_function``, applied to
            the ``train_function`` Keras makes for ``model`` (``make_train_function``
            becomes an instance attribute); default None: Keras's as is.
        user_forward: ``(inputs, training: bool) -> outputs`` under a user's tape in a
            traced replica context; default None: the engine's ``forward``.
    """
    # The model's call as it is now: its own, or a unit's hook when the model itself owns
    # weights (zero_runtime/stage3/gather.py).
    own_call = model.__dict__.get("call") or type(model).call.__get__(model)
    takes_training = getattr(model, "_call_has_training_arg", True)

    def call(inputs, *args, training=None, **kwargs):
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            recording = record.could_possibly_record() and not (in_step and in_step())
            if recording and not tf.inside_function():
                raise RuntimeError(
                    f"model {model.name!r} runs at ZeRO stage 3 under a tf.GradientTape "
                    "outside a tf.function: run the step as strategy.run(train_step, ...) "
                    "inside a @tf.function (its gathers and reduce-scatters are traced)"
                )
            if recording and user_forward is not None:
                # A user's own tf.GradientTape (a custom loop): the units' gathers with
                # their backward, the tape watching each variable's gradient anchor.
                return user_forward(inputs, training=bool(training))
            if tf.inside_function():
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
