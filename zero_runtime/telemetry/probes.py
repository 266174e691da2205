"""Readings of memory as the framework, the GPU driver and the OS see it.

These are shown *beside* the runtime's own accounting, never mixed into it: a reading
that a host cannot provide (NVML without a GPU) is NaN (absent), not zero.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import psutil

from zero_runtime.devices import DeviceInfo, framework_memory_bytes


@dataclasses.dataclass(frozen=True)
class Readings:
    """One set of readings, bytes (NaN when the source is absent on this host).

    Attributes:
        framework_device_bytes: ``tf.config.experimental.get_memory_info(...)['current']``
            summed over the local devices.
        framework_device_peak_bytes: the same ``['peak']``.
        nvml_used_bytes: NVML ``nvmlDeviceGetMemoryInfo(handle).used`` summed over GPUs.
        nvml_total_bytes: NVML ``...total`` summed over GPUs.
        process_rss_bytes: ``psutil.Process().memory_info().rss``.
        nvme_disk_bytes: bytes of regular files under the NVMe directory.
    """

    framework_device_bytes: float
    framework_device_peak_bytes: float
    nvml_used_bytes: float
    nvml_total_bytes: float
    process_rss_bytes: float
    nvme_disk_bytes: float

    def as_dict(self) -> dict[str, float]:
        """Column name (``tb_plugin.metadata.READING_COLUMNS``) -> value.

        A shallow copy of the fields (all floats): ``dataclasses.asdict`` deep-copies
        each value, which the per-step writer paid for every record.
        """
        return dict(vars(self))


def read_probes(device: DeviceInfo, nvme_path: str | None = None) -> Readings:
    """Take one set of readings now.

    Args:
        device: the strategy's devices (decides GPU vs CPU stand-in sources).
        nvme_path: the NVMe tier's directory, or None when there is no NVMe tier.

    Returns:
        A :class:`Readings`; sources that are absent give NaN.
    """
    current, peak = framework_memory_bytes(device)
    nvml_used, nvml_total = _nvml_bytes() if not device.is_standin else (math.nan, math.nan)
    return Readings(
        framework_device_bytes=current,
        framework_device_peak_bytes=peak,
        nvml_used_bytes=nvml_used,
        nvml_total_bytes=nvml_total,
        process_rss_bytes=_rss_bytes(),
        nvme_disk_bytes=_dir_bytes(nvme_path) if nvme_path else math.nan,
    )


def _rss_bytes() -> float:
    """This process's resident set size, bytes: what ``psutil.Process().memory_info().rss``
    reports (the second field of ``/proc/self/statm`` times the page size), read with one
    ``pread`` of a file kept open (~4 us against ~14 us through psutil, on the training
    step). psutil elsewhere (no ``/proc``)."""
    try:
        fd = _proc_fd(f"/proc/{os.getpid()}/statm")
        if fd is not None:
            return float(int(os.pread(fd, 256, 0).split()[1]) * _PAGE_SIZE)
    except (OSError, ValueError, IndexError):
        pass
    return float(_process(os.getpid()).memory_info().rss)


def host_available_bytes() -> int:
    """Host memory available to new allocations, bytes: what
    ``psutil.virtual_memory().available`` reports on Linux (``MemAvailable`` of
    ``/proc/meminfo``, KiB), read with one ``pread`` of the file kept open instead of
    parsing all of it (the budget check runs this at every step boundary, on the step).
    psutil where ``/proc/meminfo`` has no ``MemAvailable`` line or cannot be read."""
    try:
        fd = _proc_fd("/proc/meminfo")
        if fd is not None:
            data = os.pread(fd, 8192, 0)
            at = data.find(b"MemAvailable:")
            if at >= 0:
                return int(data[at + 13 : data.index(b"kB", at)]) * 1024
    except (OSError, ValueError):
        pass
    return int(psutil.virtual_memory().available)


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@functools.lru_cache(maxsize=8)
def _proc_fd(path: str) -> int | None:
    """An open read-only descriptor of ``path`` under ``/proc`` (kept for the process's
    life; a per-process path names the pid, so a fork opens its own), or None when it
    cannot be opened."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


@functools.lru_cache(maxsize=4)
def _process(pid: int) -> psutil.Process:
    """One ``psutil.Process`` per pid: constructing it reads /proc (~1-3 ms here)."""
    return psutil.Process(pid)


@functools.lru_cache(maxsize=1)
def _nvml_handles() -> tuple:
    try:
        import pynvml

        pynvml.nvmlInit()
        return tuple(
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
        )
    except Exception:  # NVML absent or no driver: readings are absent, not zero
        return ()


def _nvml_bytes() -> tuple[float, float]:
    handles = _nvml_handles()
    if not handles:
        return math.nan, math.nan
    import pynvml

    used = total = 0.0
    for h in handles:
        info = pynvml.nvmlDeviceGetMemoryInfo(h)
        used += info.used
        total += info.total
    return used, total


def _dir_bytes(path: str) -> float:
    total = 0
    try:
        with os.scandir(path) as it:
            for entry in it:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
                elif entry.is_dir(follow_symlinks=False):
                    total += int(_dir_bytes(entry.path))
    except FileNotFoundError:
        return math.nan
    return float(total)
