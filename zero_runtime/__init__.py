"""zero-infinity-tf: ZeRO-style sharding and offloading for TensorFlow / Keras 3.

Import this package before TensorFlow when you want the device tier's framework
readings on a CPU-only host: TensorFlow only keeps allocator statistics for the CPU when
its BFC allocator is selected (``TF_CPU_ALLOCATOR_USE_BFC=true``) before it is first
imported (see ``docs/events.md``). On a GPU host nothing needs to be set.

``ZeroInfinityStrategy`` is imported lazily (it imports TensorFlow), so that the
``zero-runtime`` command line starts fast.
"""

from __future__ import annotations

import os
import sys
from typing import Any

if "tensorflow" not in sys.modules:
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from zero_runtime.config import ZeroConfig, ZeroConfigError  # noqa: E402

__all__ = ["StrategyClosedError", "ZeroConfig", "ZeroConfigError", "ZeroInfinityStrategy"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "ZeroInfinityStrategy":
        from zero_runtime.strategy import ZeroInfinityStrategy

        return ZeroInfinityStrategy
    if name == "StrategyClosedError":  # a strategy used after close(): docs/zero_stages.md
        from zero_runtime.lifecycle import StrategyClosedError

        return StrategyClosedError
    if name == "checkpoint":  # sharded checkpoints (imports TensorFlow): docs/checkpoint.md
        import importlib

        return importlib.import_module("zero_runtime.checkpoint")
    raise AttributeError(f"module 'zero_runtime' has no attribute {name!r}")
