"""Reference optimizers for parity tests: Keras's own, given dense gradients.

Keras 3.15's Adam, given a ``tf.IndexedSlices`` gradient with repeated row indices (a
token that occurs twice in a batch: an untied ``Embedding``), squares each slice before
summing the repeats, so its second moment gets ``sum(g_i^2)`` instead of
``(sum g_i)^2``: not Adam on the summed gradient (``test_keras_sparse_adam_is_not_dense_adam``;
docs/parity.md, "Keras's Adam on a sparse gradient"). The partitioned optimizers (stages
1-3) implement the update of the summed dense gradient, so the references densify
first; everything else is Keras's code.
"""

from __future__ import annotations

import keras
import tensorflow as tf


def densify(grads: list) -> list:
    """Convert every ``tf.IndexedSlices`` in ``grads`` to a dense tensor."""
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


class DenseGradAdam(keras.optimizers.Adam):
    """Keras's own Adam, given the embedding gradient as a dense tensor."""

    def apply(self, grads, trainable_variables=None):
        return super().apply(densify(grads), trainable_variables)


class DenseGradAdamW(keras.optimizers.AdamW):
    """Keras's own AdamW given dense gradients (see :class:`DenseGradAdam`)."""

    def apply(self, grads, trainable_variables=None):
        return super().apply(densify(grads), trainable_variables)


class DenseGradSGD(keras.optimizers.SGD):
    """Keras's SGD given dense gradients (see :class:`DenseGradAdam`)."""

    def apply(self, grads, trainable_variables=None):
        return super().apply(densify(grads), trainable_variables)
