"""Host allocator tuning for the offload tiers' staging buffers (glibc only).

Every host call of an offloaded step hands TensorFlow or an update thread a fresh NumPy
buffer (a unit's shards read for its all-gather, a gradient shard copied off the device,
a block's parameters read for the host optimizer): 0.1-16 MB each, dozens per step, freed
by another thread soon after. glibc's ``malloc`` gives the top of a heap back to the
kernel as soon as more than ``M_TOP_PAD`` bytes (default 128 KiB) are free there, so the
next buffer of that size is fresh memory again and every one of its 4 KiB pages faults
(and is zeroed by the kernel) on first touch. Measured on the step-time bench's model
(``bench/bench_step_time.py``, stage 3, parameters and Adam states on the host, 2
replicas on 2 cores): a unit's shard read cost 0.37 ms of CPU inside the
step against 0.07 ms outside it, and the step took 44 ms; with ``M_TOP_PAD`` = 16 MiB,
0.17 ms and 36 ms (Mirrored's step: 16-17 ms either way). Raising the mmap or trim
thresholds alone changed nothing.

This is the host side of what PyTorch's caching host allocator and DeepSpeed's fixed
pinned offload buffers do: keep the memory a step reuses mapped. The stage-3 host calls'
largest buffers (1 MiB and up) come from :mod:`zero_runtime.memory.staging` instead,
recycled whatever thread frees them; this tuning still serves every other allocation.
It is process-wide, so :func:`tune_host_malloc` is called only by a strategy that
offloads parameters or optimizer states (``offload_param`` / ``offload_optimizer`` not
``'none'``), once per process, and it costs at most ``M_TOP_PAD`` bytes of retained free
memory per glibc arena (at most 8 per core). ``ZERO_RUNTIME_MALLOC_TOP_PAD`` (bytes)
replaces the default :data:`DEFAULT_TOP_PAD_BYTES`; ``0`` leaves glibc's setting alone.
On a C library without ``mallopt`` (musl, macOS) nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger(__name__)

#: bytes of free memory glibc keeps at the top of a heap (``M_TOP_PAD``) once tuned.
DEFAULT_TOP_PAD_BYTES = 16 << 20
#: environment variable overriding :data:`DEFAULT_TOP_PAD_BYTES` (bytes; 0 = untouched).
ENV = "ZERO_RUNTIME_MALLOC_TOP_PAD"
#: bytes from which glibc serves a request by its own ``mmap`` (``M_MMAP_THRESHOLD``) once
#: tuned: 32 MiB, the ceiling glibc's own sliding threshold reaches on 64-bit hosts.
MMAP_THRESHOLD_BYTES = 32 << 20
_M_TOP_PAD, _M_MMAP_THRESHOLD = -2, -3  # glibc malloc.h

_lock = threading.Lock()
_applied: int | None = None


def top_pad_bytes() -> int:
    """The ``M_TOP_PAD`` bytes :func:`tune_host_malloc` sets: ``ZERO_RUNTIME_MALLOC_TOP_PAD``
    when set, else :data:`DEFAULT_TOP_PAD_BYTES`.

    Raises:
        ValueError: the variable is not a whole number of bytes in ``[0, 2**31)``.
    """
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_TOP_PAD_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value < 1 << 31:
        raise ValueError(
            f"{ENV}={raw!r}: expected a whole number of bytes in [0, 2**31) (0 leaves "
            f"glibc's malloc untouched; default {DEFAULT_TOP_PAD_BYTES})"
        )
    return value


def tune_host_malloc(reapply: bool = False) -> int:
    """Set glibc's ``M_MMAP_THRESHOLD`` to :data:`MMAP_THRESHOLD_BYTES` and ``M_TOP_PAD``
    to :func:`top_pad_bytes`, once per process.

    Args:
        reapply: set them again if an earlier call did (default False). TensorFlow's
            ``GeneratorDataset`` kernel changes malloc's settings the first time it runs
            (TF 2.21 logs "Memory patch applied: M_TRIM_THRESHOLD=128 kb"), which is
            when ``fit`` first iterates its distributed dataset, after the strategy was
            built: the settings made before it no longer hold after that (measured: 44 ms
            steps, as untuned), so the runtime reapplies them when its first step ends.

    Returns:
        The ``M_TOP_PAD`` bytes set (now or by an earlier call), or 0 when nothing was
        changed (the variable is 0, or the C library has no ``mallopt``).

    Raises:
        ValueError: from :func:`top_pad_bytes`.
    """
    global _applied
    with _lock:
        if _applied is not None and not (reapply and _applied):
            return _applied
        pad = top_pad_bytes()
        ok = pad and _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        _applied = pad if ok and _mallopt(_M_TOP_PAD, pad) else 0
        if _applied:
            log.debug("malloc M_TOP_PAD set to %d bytes for the offload tiers", pad)
        return _applied


def _mallopt(param: int, value: int) -> bool:
    """glibc ``mallopt(param, value)``; False when the C library has none or refuses."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        fn = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn(param, value) == 1
