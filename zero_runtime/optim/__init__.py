"""Partitioned Keras optimizers (ZeRO stages 1-2): ``Adam``, ``AdamW`` and ``SGD``.

Importing this package registers them with Keras's serialization, which a model saved
with one of them needs before ``keras.models.load_model`` can load it.
"""

from zero_runtime.optim.partitioned import SGD, Adam, AdamW

__all__ = ["SGD", "Adam", "AdamW"]
