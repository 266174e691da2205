"""``keras.applications`` families at ZeRO stage 3 against MirroredStrategy, full size,
in ``model.fit`` and in a user's ``tf.GradientTape`` loop.

The families of ``tests/helpers/applications.py`` that the test suite cannot afford at
full size on 2 cores (it trains MobileNetV2 and small configurations of the ResNet,
EfficientNet and ConvNeXt builders): MobileNetV2 (alpha 0.35), MobileNetV3Small (alpha
0.75, its head's Dropout(0.2)), EfficientNetB0 (its Dropouts of rate up to 0.2),
ResNet50 and ConvNeXtTiny, ``weights=None``, 32x32x3 images in [0, 255), 10 classes,
the default softmax head. Each comparison (family, loop) runs in a process of its own
(2 replicas on logical CPU devices): the loop under ``MirroredStrategy``, then under
``ZeroInfinityStrategy`` at stage 3 with parameters and optimizer states on the host,
each over the same ``--steps`` global batches of 8, Keras's SGD (0.05) and
``sparse_categorical_crossentropy`` on the probabilities (``from_logits=False``).

Measured (``helpers.applications.compare``, docs/parity.md's measure): the worst
per-variable ``max |w - r| / max |r|`` over the variables Mirrored moved, the worst
``max |w - r|`` over the others, the worst relative loss difference over the steps; the
bounds are 1e-5 and 1e-6. Writes ``bench/results/applications_parity.json``: the date,
``nproc``, the machine's memory, the load averages before and after, the commit, and per
comparison those figures and each strategy's wall time (mostly tracing).

Usage: ``.venv/bin/python bench/bench_applications_parity.py [--steps N] [--families A,B]
[--loops fit,tape] [--note TEXT]``
"""

from __future__ import annotations

# isort: skip_file  (_common sets the environment before TensorFlow is imported)
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402  (environment, devices, tests/ on the path)
import keras  # noqa: E402
from helpers import applications as apps  # noqa: E402
from helpers.mirrored import Mirrored  # noqa: E402

import zero_runtime  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "applications_parity.json"
FAMILIES = ("mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "resnet50", "convnext_tiny")
LOOPS = ("fit", "tape")
BATCH = 8
STAGE3 = {"stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"}


def _train(strategy, family: str, loop: str, steps: int) -> apps.Run:
    build = lambda: apps.application(family)  # noqa: E731
    data = apps.image_data(steps * BATCH)
    if loop == "fit":
        return apps.fit_run(strategy, build, data, batch=BATCH)[1]
    loss = keras.losses.SparseCategoricalCrossentropy(reduction="none")
    return apps.tape_loop(strategy, build, data, loss, batch=BATCH)[1]


def compare_one(family: str, loop: str, steps: int) -> dict:
    """One comparison in this process: ``family`` trained by ``loop`` for ``steps`` steps
    under MirroredStrategy and at stage 3. Returns its figures (module docstring)."""
    load = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    ref = _train(Mirrored(common.DEVICES.devices), family, loop, steps)
    middle = time.perf_counter()
    strategy = zero_runtime.ZeroInfinityStrategy(STAGE3)
    try:
        run = _train(strategy, family, loop, steps)
    finally:
        strategy.close()
    end = time.perf_counter()
    diff = apps.compare(run, ref)
    return {
        "family": family,
        "loop": loop,
        "steps": len(run.losses),
        "weight_elements": int(sum(w.size for w in ref.initial)),  # trainable and not
        **dataclasses.asdict(diff),
        "within_bounds": diff.within_bounds(),
        "losses_mirrored": ref.losses,
        "losses_stage3": run.losses,
        "seconds_mirrored": round(middle - start, 1),
        "seconds_stage3": round(end - middle, 1),
        "load_average_at_start": load,
    }


def _commit() -> str:
    """The checkout's commit (``git rev-parse HEAD``), or ``$BENCH_COMMIT`` outside git."""
    proc = subprocess.run(
        ["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() if proc.returncode == 0 else os.environ.get("BENCH_COMMIT", "?")


def _memory_gib() -> float:
    """The machine's memory (``MemTotal`` of ``/proc/meminfo``), GiB."""
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return round(kib / 2**20, 1)


def main() -> None:
    """Run every (family, loop) in a child process of its own; write the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="global batches of 8 (default 20)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    ap.add_argument("--loops", default=",".join(LOOPS), help="comma-separated: fit, tape")
    ap.add_argument("--note", default="", help="context recorded in the results (e.g. load)")
    ap.add_argument("--one", nargs=2, metavar=("FAMILY", "LOOP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # the child: one comparison, its figures as the last line
        print("RESULT " + json.dumps(compare_one(*args.one, args.steps)), flush=True)
        return
    load_before = os.getloadavg()
    comparisons = []
    for family in args.families.split(","):
        for loop in args.loops.split(","):
            cmd = [sys.executable, __file__, "--one", family, loop, "--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"{family} {loop} failed:\n{proc.stderr[-4000:]}")
            comparisons.append(json.loads(lines[-1][len("RESULT ") :]))
            print(json.dumps({k: comparisons[-1][k] for k in list(comparisons[-1])[:9]}))
    results = {
        **common.run_header(load_before, args.note or "one comparison per process, in turn"),
        "memory_gib": _memory_gib(),
        "commit": _commit(),
        "replicas": len(common.DEVICES.devices),
        "global_batch": BATCH,
        "stage3_config": STAGE3,
        "bounds": {"weight_rel": apps.REL, "no_grad_abs": apps.NO_GRAD_ABS, "loss_rel": apps.REL},
        "comparisons": comparisons,
    }
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
