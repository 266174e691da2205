"""The local compute devices a strategy replicates over, and what the device tier is.

On a GPU host the replicas are the GPUs and the device tier is their memory. On a
CPU-only host the replicas are N logical CPU devices (TensorFlow's
``LogicalDeviceConfiguration``) and the device tier is a *budgeted stand-in*: memory on
the CPU that the runtime accounts for and caps itself. Everything that shows the device
tier must say which of the two it is (:attr:`DeviceInfo.is_standin`).
"""

from __future__ import annotations

import dataclasses
import math
import os

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """The replicas' devices and the nature of the device tier.

    Attributes:
        devices: TensorFlow device names, one per local replica (e.g. ``"/gpu:0"``).
        is_standin: True when there is no accelerator and the device tier is a budgeted
            region of host memory standing in for one.
        description: human-readable text for the view, e.g. ``"device (CPU stand-in)"``.

    The framework's allocator statistics (``tf.config.experimental.get_memory_info``) are
    read when available: on CPU they need ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before
    TensorFlow is imported (``import zero_runtime`` first does that) and exist only once
    the allocator has served a tensor.
    """

    devices: tuple[str, ...]
    is_standin: bool
    description: str

    @property
    def memory_info_device(self) -> str:
        """The device name to pass to ``tf.config.experimental.get_memory_info``."""
        return "GPU:0" if not self.is_standin else "CPU:0"


def local_devices(num_cpu_replicas: int = 2) -> DeviceInfo:
    """Choose the local replica devices, configuring logical CPUs when there is no GPU.

    Args:
        num_cpu_replicas: number of logical CPU devices to replicate over on a CPU-only
            host (default 2; ignored when GPUs are visible). Must be >= 1.

    Returns:
        A :class:`DeviceInfo`.

    Raises:
        ValueError: ``num_cpu_replicas`` < 1.
        RuntimeError: TensorFlow's runtime was initialised before the logical CPU devices
            could be configured and fewer than ``num_cpu_replicas`` exist; create the
            strategy before running any TensorFlow operation.
    """
    if not isinstance(num_cpu_replicas, int) or isinstance(num_cpu_replicas, bool):
        raise ValueError(f"num_cpu_replicas must be an int >= 1, got {num_cpu_replicas!r}")
    if num_cpu_replicas < 1:
        raise ValueError(f"num_cpu_replicas must be >= 1, got {num_cpu_replicas}")
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        names = tuple(f"/gpu:{i}" for i in range(len(gpus)))
        return DeviceInfo(names, False, "device (GPU)")
    cpus = tf.config.list_physical_devices("CPU")
    logical = None
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * num_cpu_replicas
        )
    except RuntimeError:
        logical = tf.config.list_logical_devices("CPU")
        if len(logical) < num_cpu_replicas:
            raise RuntimeError(
                f"TensorFlow is already initialised with {len(logical)} logical CPU "
                f"device(s), but {num_cpu_replicas} replicas were requested; create the "
                "ZeroInfinityStrategy before running any TensorFlow operation, or pass "
                f"num_cpu_replicas={len(logical)}"
            ) from None
    logical = tf.config.list_logical_devices("CPU")
    names = tuple(f"/cpu:{i}" for i in range(num_cpu_replicas))
    del logical
    return DeviceInfo(names, True, "device (CPU stand-in)")


def framework_memory_bytes(info: DeviceInfo) -> tuple[float, float]:
    """The framework's view of device memory: (current, peak) bytes, NaN when unavailable.

    On a GPU host this sums ``get_memory_info('GPU:i')`` over the local GPUs; on the CPU
    stand-in the logical CPU devices share one allocator, so ``CPU:0`` covers them all.
    On the CPU stand-in, ``TF_CPU_ALLOCATOR_USE_BFC`` set to a false value (``0``,
    ``false``) turns the reading off (NaN): some TensorFlow builds keep CPU allocator
    statistics without the BFC allocator (measured with tensorflow-cpu 2.21.0 on this
    machine, where the variable had no effect), and a user who switched them off gets the
    runtime's own accounting, as documented.
    """
    if info.is_standin and bfc_refused():
        return math.nan, math.nan
    names = (
        [info.memory_info_device]
        if info.is_standin
        else [f"GPU:{i}" for i in range(len(info.devices))]
    )
    current = peak = 0.0
    for name in names:
        try:
            stats = tf.config.experimental.get_memory_info(name)
        except (ValueError, RuntimeError):  # no allocator statistics on this device
            return math.nan, math.nan
        current += stats["current"]
        peak += stats["peak"]
    return current, peak


def bfc_requested() -> bool:
    """True when the CPU BFC allocator was requested through the environment."""
    return os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("1", "true")


def bfc_refused() -> bool:
    """True when the environment switches the CPU BFC allocator off explicitly
    (``TF_CPU_ALLOCATOR_USE_BFC`` is ``0`` or ``false``, any case)."""
    return os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("0", "false")
