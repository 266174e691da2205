"""Process-wide TensorFlow setup for the test session; loaded before tests/conftest.py.

TensorFlow fixes its devices and its CPU allocator when it first initialises, so this
runs before anything imports TensorFlow: the BFC CPU allocator is selected (allocator
statistics for the device tier's CPU stand-in), and two logical CPU devices are
configured so that every strategy in the session has two local replicas.
"""
# isort: skip_file  (the environment must be set before TensorFlow is imported)

from __future__ import annotations

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from zero_runtime.devices import local_devices  # noqa: E402

TEST_REPLICAS = 2

_DEVICES = local_devices(TEST_REPLICAS)


@pytest.fixture(scope="session")
def cpu_devices() -> tuple[str, ...]:
    """The session's local replica devices (two logical CPUs on this host)."""
    assert len(tf.config.list_logical_devices("CPU")) >= TEST_REPLICAS
    return _DEVICES.devices
