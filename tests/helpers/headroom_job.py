"""A stage-3 run with ``device_budget_bytes='auto'`` under a capped allocator, for
tests/test_headroom.py::test_auto_holds_the_headroom_in_a_run_that_pages::

    python tests/helpers/headroom_job.py OUT.json WORKDIR [CAPACITY_MIB] [BUDGET]

The process caps TensorFlow's BFC CPU allocator at ``CAPACITY_MIB`` (default
``CAPACITY_MIB`` below) through ``TF_CPU_BFC_MEM_LIMIT_IN_MB``, the CPU stand-in's real
capacity, and trains a model with a row-paged embedding table (13.5 MiB of row pages,
cached on the device tier as far as the budget allows) at stage 3 with parameters and
optimizer states on NVMe files under WORKDIR and ``device_budget_bytes=BUDGET`` (default
'auto', headroom 0.25). It
writes ``{"capacity_bytes", "headroom_fraction", "warmup_steps", "peaks": [per-step
allocator peak, bytes], "budgets": [...], "page_moves", "first_loss", "final_loss",
"events": [config events], "auto_events", "floor_bytes": the controller's lowest budget
(the stage-3 engine's device plan, ``Stage3Engine.min_device_budget``)}``. An int BUDGET
(bytes) runs without the controller, to calibrate.
"""

# isort: skip_file  (the environment must be set before TensorFlow is imported)
from __future__ import annotations

import json
import os
import sys

CAPACITY_MIB = 18
CAPACITY = int(sys.argv[3]) if len(sys.argv) > 3 else CAPACITY_MIB
os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(CAPACITY)
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("ZERO_RUNTIME_PROFILE_EVERY", "0")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import zero_runtime  # noqa: E402
from zero_runtime.devices import local_devices  # noqa: E402

VOCAB, WIDTH, SEQ = 110_000, 32, 32  # 216 row pages of 512 rows (64 KiB): 13.5 MiB
STEPS = 60  # 52 steps after warm-up: the 95% share is measured on enough steps to mean it
HEADROOM = 0.25
WARMUP = 8


def main(out_path: str, workdir: str, budget: str) -> None:
    """Train and write the record (see the module docstring)."""
    local_devices(2)
    nvme = os.path.join(workdir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    strategy = zero_runtime.ZeroInfinityStrategy(
        {
            "stage": 3,
            "offload_param": "nvme",
            "offload_optimizer": "nvme",
            "nvme_path": nvme,
            "page_size_bytes": 65536,
            "device_budget_bytes": budget if budget == "auto" else int(budget),
            "headroom_fraction": HEADROOM,
            "embedding_row_paging_threshold": 1_000_000,
        },
        logdir=os.path.join(workdir, "run"),
    )
    with strategy.zero_init():  # the table is made on the host, never whole on the device
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((SEQ,), dtype="int32"),
                # A constant initializer: no temporaries the size of the table under the cap.
                keras.layers.Embedding(VOCAB, WIDTH, embeddings_initializer="ones"),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(64),
            ]
        )
    with strategy.scope():
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, VOCAB, size=(8 * STEPS, SEQ)).astype("int32")
    labels = tokens[:, 0] % 64
    ds = tf.data.Dataset.from_tensor_slices((tokens, labels)).batch(8)
    losses: list[float] = []
    record_loss = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"]))
    )
    model.fit(ds, verbose=0, callbacks=[record_loss])
    records = strategy.runtime.recorder.last()
    history = strategy.runtime.control.history if strategy.runtime.control else []
    events = [o.to_dict() for o in history]
    record = {
        "capacity_bytes": CAPACITY << 20,
        "headroom_fraction": HEADROOM,
        "warmup_steps": WARMUP,
        "peaks": [r.readings.framework_device_peak_bytes for r in records],
        "budgets": [r.tiers["device"].capacity_bytes for r in records],
        "page_moves": sum(
            r.pages.get(k, 0) for r in records for k in ("h2d_pages", "d2h_pages", "n2h_pages")
        ),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "events": events,
        "auto_events": sum(e["source"] == "auto" for e in events),
        "floor_bytes": strategy.runtime.headroom.min_budget,
    }
    strategy.close()
    with open(out_path, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[4] if len(sys.argv) > 4 else "auto")
