"""A training-and-saving loop to be killed with SIGKILL (tests/test_fault_checkpoint.py).

    python tests/helpers/kill_job.py ROOT NVME STEPS

Stage 2 with the optimizer states on NVMe (``NVME``), 2 replicas, the tiny model of
:mod:`checkpoint_job`: prints ``ready``, then for each step ``s`` prints ``train s``,
trains global batch ``s``, prints ``save s+1``, saves a checkpoint under ``ROOT``
(``max_to_keep=2``) and prints ``saved s+1``; ``done`` at the end. The parent kills it at
a random time and resumes from ``ROOT/latest``; the last line printed says where the kill
landed (in a step, or in a save).
"""

# isort: skip_file  (the environment must be set before TensorFlow is imported)
from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zero_runtime.devices import local_devices  # noqa: E402

local_devices(2)

from helpers import checkpoint_job as job  # noqa: E402
from zero_runtime.checkpoint import CheckpointManager  # noqa: E402


def main(root: str, nvme: str, steps: int) -> int:
    strategy = job.strategy_for(2, "nvme", nvme)
    model = job.build(strategy)
    manager = CheckpointManager(root, model, strategy, max_to_keep=2)
    print("ready", flush=True)
    for s in range(steps):
        print(f"train {s}", flush=True)
        job.train(model, s, 1)
        print(f"save {s + 1}", flush=True)
        manager.save()
        print(f"saved {s + 1}", flush=True)
    print("done", flush=True)
    job.close(strategy, model)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
