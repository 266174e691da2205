"""zero-infinity-tf: ZeRO-style sharding and offloading for TensorFlow / Keras 3.

Import this package before TensorFlow when you want the device tier's framework
readings on a CPU-only host: TensorFlow only keeps allocator statistics for the CPU when
its BFC allocator is selected (``TF_CPU_ALLOCATOR_USE_BFC=true``) before it is first
imported (see ``docs/telemetry.md``). On a GPU host nothing needs to be set.
"""

from __future__ import annotations

import os
import sys

if "tensorflow" not in sys.modules:
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from zero_runtime.strategy import ZeroInfinityStrategy  # noqa: E402

__all__ = ["ZeroInfinityStrategy"]
__version__ = "0.1.0"
