"""The zero-infinity-tf demo: a byte-level GPT trained on the Python standard library.

``data`` turns the standard library's own ``.py`` files (present, offline, on every machine
with Python) into a deterministic next-byte-prediction ``tf.data`` pipeline; ``model`` is a
small GPT-style decoder in plain Keras 3, a ``keras.Sequential`` of top-level blocks. Neither
module knows about sharding: the training script wraps the runtime around them.
"""
