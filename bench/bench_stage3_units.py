"""Stage-3 step time of a chain and of the same layers with a residual connection, each
against MirroredStrategy, measured side by side.

One process, 2 replicas (logical CPU devices). Two models of about 2.1M float32
parameters, the model of ``bench_step_time.py`` (``_common.build_model``: embedding
2000 x 64, three Dense 768, a LayerNormalization, a Dense 10 head):

- ``chain``: that Sequential;
- ``residual``: the same layers, functional, with ``h + Dense(h)`` around the third Dense
  768. Stage 3 runs both by units (zero_runtime/stage3/gather.py).

Each model is trained under MirroredStrategy (Keras Adam on dense gradients, as the
parity references) and ZeRO stage 3 with parameters and optimizer states on the device
(``none``) and on the host (``cpu``). Every configuration is built and warmed up first
(tracing); then they are measured interleaved, ``--rounds`` rounds of ``--steps`` steps in
alternating order, so load from other processes falls on all alike. A configuration's
figure is its median step (the first step of each fit dropped); ratios are over the same
model's Mirrored median. Writes ``bench/results/stage3_units.json`` with the load average
before and after.

Usage: ``.venv/bin/python bench/bench_stage3_units.py [--rounds R] [--steps N] [--batch B]
[--note TEXT]``
"""

from __future__ import annotations

# isort: skip_file  (_common sets the environment before TensorFlow is imported)
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402  (devices, data, timer, the chain model)
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from helpers.reference_optimizers import DenseGradAdam  # noqa: E402  (_common put tests/ on the path)

import zero_runtime  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "stage3_units.json"
STAGE3 = {
    "stage3_none": {"stage": 3, "offload_param": "none", "offload_optimizer": "none"},
    "stage3_cpu": {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"},
}


def build_residual() -> keras.Model:
    """``_common.build_model``'s layers with a residual around the third Dense 768 (a DAG)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((common.SEQ,), dtype="int32")
    h = keras.layers.Embedding(common.VOCAB, 64)(tokens)  # (B, 16, 64)
    h = keras.layers.Flatten()(h)  # (B, 1024)
    h = keras.layers.Dense(768, activation="relu")(h)
    h = keras.layers.Dense(768, activation="relu")(h)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Add()([h, keras.layers.Dense(768, activation="relu")(h)])
    return keras.Model(tokens, keras.layers.Dense(10)(h))


MODELS = {"chain": common.build_model, "residual": build_residual}


def main() -> None:
    """Build every (model, configuration), measure them interleaved, write the results."""
    ap = common.interleaved_parser(__doc__.splitlines()[0], 4, 5, 32)
    ap.add_argument("--note", default="", help="context recorded in the results (e.g. load)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    ds = common.make_data(args.steps, args.batch)
    models, strategies = {}, []
    for mname, build in MODELS.items():
        mirrored = tf.distribute.MirroredStrategy(list(common.DEVICES.devices))
        models[(mname, "mirrored")] = common.build_trained(
            mirrored, lambda: DenseGradAdam(1e-3), ds, build=build
        )
        for cname, cfg in STAGE3.items():
            strategy = zero_runtime.ZeroInfinityStrategy(cfg)
            strategies.append(strategy)
            models[(mname, cname)] = common.build_trained(
                strategy, lambda: keras.optimizers.get("adam"), ds, build=build
            )
    keys = list(models)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    for r in range(args.rounds):
        for key in keys if r % 2 == 0 else reversed(keys):
            times[key] += common.time_steps(models[key], ds)
    for strategy in strategies:
        strategy.close()
    medians = {f"{m}/{c}": statistics.median(t) for (m, c), t in times.items()}
    ratios = {
        f"{m}/{c}": statistics.median(t) / medians[f"{m}/mirrored"]
        for (m, c), t in times.items()
        if c != "mirrored"
    }
    result = {
        **common.run_header(load_before),
        "context": args.note,
        "replicas": len(common.DEVICES.devices),
        "model_params": {m: b().count_params() for m, b in MODELS.items()},
        "global_batch": args.batch,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "median_step_seconds": medians,
        "ratios_vs_mirrored_same_model": ratios,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
