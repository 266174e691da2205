"""Model factories for ``zero-runtime estimate --model tests.helpers.estimate_models:NAME``.

Each returns a built ``keras.Model`` from ``keras.Input`` shapes only, so the estimator can
call it without allocating weights (``estimator.build_model_abstractly``).
"""

from __future__ import annotations

import keras


def wide() -> keras.Model:
    """Ψ = 200_002_010: Dense(1000 -> 200_000) 200_200_000 (800 MB of float32 if it were
    allocated) and Dense(200_000 -> 10) 2_000_010."""
    return keras.Sequential(
        [
            keras.Input((1_000,)),
            keras.layers.Dense(200_000, name="wide"),
            keras.layers.Dense(10, name="head"),
        ]
    )


def small_mixed() -> keras.Model:
    """Ψ = 3_432 under ``mixed_bfloat16``: Dense(16 -> 64) 1_088, Dense(64 -> 32) 2_080,
    Dense(32 -> 8) 264 (float32 variables, bfloat16 compute)."""
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, name="d64", dtype="mixed_bfloat16"),
            keras.layers.Dense(32, name="d32", dtype="mixed_bfloat16"),
            keras.layers.Dense(8, name="d8", dtype="mixed_bfloat16"),
        ],
        name="small_mixed",
    )


def not_a_model() -> int:
    """Returns an int: the CLI must reject it."""
    return 3


def compiled_sgd() -> keras.Model:
    """Ψ = 110 (Dense(10 -> 10)), compiled with SGD(momentum=0.9): ``compile`` creates a
    variable Keras cannot defer, so the CLI must refuse it with a clear message."""
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(10, name="d")])
    model.compile(optimizer=keras.optimizers.SGD(momentum=0.9), loss="mse")
    return model
