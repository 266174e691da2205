"""ZeRO stage 3: sharded parameters, gathered unit by unit in the model's own call
(:mod:`.engine`, :mod:`.gather`), for any Keras model and every training form (``fit``,
``train_step`` in ``strategy.run``, a user's own ``tf.GradientTape``).

Public API::

    with strategy.scope():                       # ZeroInfinityStrategy(stage=3, ...)
        model = build_model()                    # any Keras model, unchanged
        sharded = zero_runtime.stage3.ShardedModel(model)   # or strategy.shard_model(model)
        sharded.compile(optimizer="adam", loss=...)
    sharded.fit(dataset)                         # Keras fit, the stage-3 train step

``ShardedModel.train_step`` also runs inside ``strategy.run`` for custom loops.
"""

from zero_runtime.stage3.engine import Stage3Engine
from zero_runtime.stage3.model import ShardedModel

__all__ = ["ShardedModel", "Stage3Engine"]
