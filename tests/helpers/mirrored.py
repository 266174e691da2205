"""Reference ``MirroredStrategy`` instances that can coexist in one test process."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import tensorflow as tf

# Plain MirroredStrategy instances all start their collective keys at the same group and
# instance keys; TensorFlow caches an instance's shape by key, so two plain references with
# different gradient shapes in one process abort ("Shape mismatch in the collective
# instance 100") and leave the process's collectives broken. Each reference gets its own
# key base, as ZeroInfinityStrategy does (zero_runtime/strategy.py).
_KEY_BASES = itertools.count(start=70_000_000, step=100_000)


class Mirrored(tf.distribute.MirroredStrategy):
    """``tf.distribute.MirroredStrategy`` over ``devices`` with a collective key base of its own.

    Args:
        devices: the replica device names, e.g. ``("/cpu:0", "/cpu:1")``.
    """

    def __init__(self, devices: Sequence[str]) -> None:
        self._collective_key_base = next(_KEY_BASES)
        super().__init__(list(devices))
