"""ZeRO stage 3: sharded parameters, run block by block (chains, :mod:`.engine`) or unit
by unit (any other model, :mod:`.gather`).

Public API::

    with strategy.scope():                       # ZeroInfinityStrategy(stage=3, ...)
        model = build_model()                    # any Keras model, unchanged
        sharded = zero_runtime.stage3.ShardedModel(model)   # or strategy.shard_model(model)
        sharded.compile(optimizer="adam", loss=...)
    sharded.fit(dataset)                         # Keras fit, the stage-3 train step

``ShardedModel.train_step`` also runs inside ``strategy.run`` for custom loops.
"""

from zero_runtime.stage3.block_plan import BlockPlan
from zero_runtime.stage3.engine import Stage3Engine
from zero_runtime.stage3.model import ShardedModel

__all__ = ["BlockPlan", "ShardedModel", "Stage3Engine"]
