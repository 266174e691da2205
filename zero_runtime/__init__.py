"""zero-infinity-tf: ZeRO-style sharding and offloading for TensorFlow / Keras 3.

Import this package before TensorFlow when you want the device tier's framework
readings on a CPU-only host: TensorFlow only keeps allocator statistics for the CPU when
its BFC allocator is selected (``TF_CPU_ALLOCATOR_USE_BFC=true``) before it is first
imported (see ``docs/events.md``). On a GPU host nothing needs to be set.

``ZeroInfinityStrategy`` is imported lazily (it imports TensorFlow), so that the
``zero-runtime`` command line starts fast.

Layering (which package may import which; docs/design/architecture.md). A module may import only
from layers *below* its own, never sideways or up; function-level imports count too.
``tests/test_layering.py`` checks this against :data:`LAYERS` (the table below is its
text) and that ``zero_runtime/`` has no import circle::

  command line   cli
  launcher       launch
  multi-worker   multiworker
  strategy       strategy
  engine         runtime, checkpoint
  stage 3        stage3
  optimizers     optim
  shards         sharded_variable
  services       memory, comm, telemetry, control, oom, estimator, capabilities, cluster_guard
  elasticity     progress, elastic
  foundations    config, devices, strategy_variants, lifecycle, oom_report, atomic_file, preemption

Only this package root may import from any layer (lazily, in ``__getattr__``). From
``tb_plugin`` the runtime imports only the data contract (``tb_plugin.metadata``) and its
writer (``tb_plugin.summary``); ``tb_plugin`` may import ``zero_runtime.control``,
``zero_runtime.config`` and the what-if simulator ``zero_runtime.memory.simulate`` (no
TensorFlow).
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

#: The layers of ``zero_runtime``, lowest first: ``(name, top-level modules and packages)``.
#: A unit may import units of lower layers only (tests/test_layering.py).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundations",
        (
            "config",
            "devices",
            "strategy_variants",
            "lifecycle",
            "oom_report",
            "atomic_file",
            "preemption",
        ),
    ),
    ("elasticity", ("progress", "elastic")),
    (
        "services",
        (
            "memory",
            "comm",
            "telemetry",
            "control",
            "oom",
            "estimator",
            "capabilities",
            "cluster_guard",
        ),
    ),
    ("shards", ("sharded_variable",)),
    ("optimizers", ("optim",)),
    ("stage 3", ("stage3",)),
    ("engine", ("runtime", "checkpoint")),
    ("strategy", ("strategy",)),
    ("multi-worker", ("multiworker",)),
    ("launcher", ("launch",)),
    ("command line", ("cli",)),
)


def __getattr__(name: str) -> Any:
    if name == "ZeroInfinityStrategy":
        # The multi-worker subclass registers itself (zero_runtime.strategy_variants) when
        # imported; importing it here lets ZeroInfinityStrategy(...) pick it.
        from zero_runtime import multiworker  # noqa: F401
        from zero_runtime.strategy import ZeroInfinityStrategy

        return ZeroInfinityStrategy
    if name == "StrategyClosedError":  # a strategy used after close(): docs/stages/index.md
        from zero_runtime.lifecycle import StrategyClosedError

        return StrategyClosedError
    if name == "checkpoint":  # sharded checkpoints (imports TensorFlow): docs/checkpoint.md
        import importlib

        return importlib.import_module("zero_runtime.checkpoint")
    raise AttributeError(f"module 'zero_runtime' has no attribute {name!r}")
