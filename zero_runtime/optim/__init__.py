"""Partitioned Keras optimizers (ZeRO stages 1-3): ``Adam``, ``AdamW``, ``SGD``
(:mod:`.partitioned`), ``RMSprop``, ``Adagrad``, ``Adamax``, ``Nadam``, ``Lion``
(:mod:`.elementwise`) and ``Adafactor`` (:mod:`.adafactor`).

Importing this package registers them with Keras's serialization, which a model saved
with one of them needs before ``keras.models.load_model`` can load it, and registers their
Keras names (``"adam"``, ``"rmsprop"``, ...) with the strategy's scope.
"""

from zero_runtime.optim.adafactor import Adafactor
from zero_runtime.optim.elementwise import Adagrad, Adamax, Lion, Nadam, RMSprop
from zero_runtime.optim.partitioned import SGD, Adam, AdamW

__all__ = ["SGD", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "Lion", "Nadam", "RMSprop"]
