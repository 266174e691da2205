"""One epoch of ``model.fit`` that records every batch's loss (the parity tests' measure)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf


def fit_losses(model: keras.Model, x: np.ndarray, y: np.ndarray, batch: int) -> list[float]:
    """Train ``model`` (compiled) one epoch on ``(x, y)`` in order, batches of ``batch``
    (the global batch); returns the loss Keras logged after each batch."""
    losses: list[float] = []
    cb = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"]))
    )
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    model.fit(ds, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    return losses
