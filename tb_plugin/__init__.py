"""The Memory Hierarchy View: a TensorBoard plugin for zero-infinity-tf.

``metadata`` is shared by the writer (``summary``) and the reader (``plugin``);
the runtime only ever imports ``summary`` and ``metadata``.
"""
