"""Gradient clipping at ZeRO stage 3, on reduced gradient shards.

At stage 3 no replica holds a full gradient: after the backward (and after accumulation,
:mod:`zero_runtime.stage3.accumulation`) each replica holds its shard of the reduced
gradient ``G`` = the gradient of the global batch's loss (summed over replicas; Keras
scales each replica's loss by 1 / replicas). Clipping is applied to ``G``, with Keras's
formulas (``keras.src.optimizers.base_optimizer``), norms taken across shards:

- ``clipnorm`` c, per variable: ``g * c / max(||g||, c)`` (``Optimizer._clip_by_norm``),
  ``||g||^2`` = the sum over replicas of the squared norms of the variable's shards;
- ``global_clipnorm`` c: ``g * c * min(1 / ||G||, 1 / c)`` (``clip_by_global_norm``),
  ``||G||^2`` = the sum of all variables' squared norms;
- ``clipvalue`` v: ``clip(g, -v, v)`` element-wise (each element lives in one shard).

The squared norms need one all-reduce of ``[num_variables]`` float32 per step (none for
``clipvalue``); padding rows of a shard are zero and add nothing. Only one of the three is
used, in Keras's order (clipnorm, then global_clipnorm, then clipvalue).

This is the semantics of Keras on one device and of DeepSpeed / FSDP (clip the reduced
gradient). Keras 3.15 under ``MirroredStrategy`` with several replicas differs: it clips
each replica's own gradient (of its local loss / replicas) before the all-reduce
(``Optimizer._backend_apply_gradients`` clips, then the TensorFlow backend's
``_backend_update_step`` all-reduces). That cannot be reproduced at stage 3 for
``global_clipnorm`` (the scale of replica r needs the norm of r's whole unreduced gradient,
known only after every block's gradient has been reduce-scattered), so the three options
share the reduced-gradient semantics instead (docs/stages/optimizer.md).
"""

from __future__ import annotations

import tensorflow as tf

from zero_runtime import comm


def clipping_active(optimizer) -> bool:
    """True when ``optimizer`` has ``clipnorm``, ``global_clipnorm`` or ``clipvalue`` > 0."""
    return any(
        bool(getattr(optimizer, k, None)) and getattr(optimizer, k) > 0
        for k in ("clipnorm", "global_clipnorm", "clipvalue")
    )


def clip_shards(shards: list[tf.Tensor], optimizer, group) -> list[tf.Tensor]:
    """Clip a replica's reduced gradient shards as Keras clips the full gradients.

    Args:
        shards: one float32 ``[shard_elements_v]`` tensor per variable (this replica's shard
            of the reduced gradient), in any fixed order shared by all replicas.
        optimizer: a Keras optimizer; its ``clipnorm`` / ``global_clipnorm`` /
            ``clipvalue`` select the clipping (none: ``shards`` returned unchanged).
        group: the :class:`zero_runtime.comm.CollectiveGroup` of the replicas (the stage-3
            engine's), for the all-reduce of the squared norms.

    Returns:
        The clipped shards, same shapes and order.

    Raises:
        RuntimeError: called outside replica context (from the all-reduce).
    """
    if not shards or not clipping_active(optimizer):
        return shards
    clipnorm = getattr(optimizer, "clipnorm", None)
    global_clipnorm = getattr(optimizer, "global_clipnorm", None)
    if (clipnorm and clipnorm > 0) or (global_clipnorm and global_clipnorm > 0):
        local = tf.stack([tf.reduce_sum(tf.square(s)) for s in shards])  # (V,)
        sq = comm.all_reduce_sum_flat(local, group)  # (V,) squared norms of the variables
        if clipnorm and clipnorm > 0:
            c = tf.cast(clipnorm, tf.float32)
            out = []
            for k, s in enumerate(shards):
                l2sum = sq[k]
                pred = l2sum > 0  # Keras's two-tap where (no NaN for a zero gradient)
                l2norm = tf.where(pred, tf.sqrt(tf.where(pred, l2sum, 1.0)), l2sum)
                out.append(s * c / tf.maximum(l2norm, c))
            return out
        c = tf.cast(global_clipnorm, tf.float32)
        use_norm = tf.sqrt(tf.reduce_sum(sq))
        scale = c * tf.minimum(1.0 / use_norm, 1.0 / c) + (use_norm - use_norm)
        return [s * scale for s in shards]
    v = tf.cast(optimizer.clipvalue, tf.float32)
    return [tf.clip_by_value(s, -v, v) for s in shards]
