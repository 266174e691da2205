"""Recycled host staging buffers for the offload tiers' host calls.

Every host call of an offloaded stage-3 step hands TensorFlow or an update thread a
buffer of 0.1-16 MB: a unit's shards read for its all-gather, a tile's column piece, a
gradient shard copied off the device, a block's parameters read for the host optimizer.
Allocated fresh with ``np.empty`` each time, such a buffer is often new memory to the
kernel, so every 4 KiB page of it faults and is zeroed on first touch, and TensorFlow
copies a returned array that is not 64-byte aligned into its own tensor.
:mod:`zero_runtime.memory.host_malloc` keeps more of glibc's freed memory mapped
(``M_TOP_PAD``, ``M_MMAP_THRESHOLD``), but a buffer freed by another thread than the one
that takes the next (TensorFlow's executors, the update threads) lands in another arena,
and one past the mmap threshold is unmapped on free. Measured with ``perf`` on the
1B-parameter step of ``bench/bench_max_model.py`` (k = 22, that tuning in
effect): 10 CPU-seconds of page faults inside copies into fresh NumPy buffers and 2
CPU-seconds of TensorFlow copying returned arrays, of about 118 busy CPU-seconds per step
on 2 cores.

A :class:`StagingPool` keeps such buffers mapped and hands them out again, as PyTorch's
caching host allocator and DeepSpeed's fixed pinned offload buffers do:

* :meth:`StagingPool.empty` returns a 64-byte aligned float32 array cut from a block of a
  size class (the request rounded up to :data:`BLOCK_QUANTUM_BYTES`); a free block of that
  class is reused, else one is allocated.
* The block comes back to its class's free list when the array and every view of it are
  garbage (``weakref.finalize`` on the ctypes object the array is made over), whoever
  drops the last: the update thread, or TensorFlow, which takes an aligned array returned
  by ``tf.numpy_function`` without a copy and drops it when its tensor is freed (TF 2.21,
  measured: ``tests/test_memory_staging.py``).
  Nothing can reuse a block while anything still reads it.
* Free blocks are kept up to ``idle_limit_bytes`` in all (default
  :data:`DEFAULT_IDLE_LIMIT_BYTES`); a block coming back past that is freed for real.
  Requests under :data:`BLOCK_QUANTUM_BYTES` are plain ``np.empty`` (malloc's own bins
  serve them without faults).

The pool's bytes are host memory: live blocks are what the call sites held before as
fresh arrays; idle blocks are at most ``idle_limit_bytes`` more
(:attr:`StagingPool.idle_bytes`). On a CPU-only host a buffer TensorFlow takes without a
copy stays host memory: the budgeted stand-in device (TensorFlow's BFC allocator) no
longer counts a host read's output, only what the step makes of it (the all-gather's
result onwards); on a GPU TensorFlow copies it to the device as before.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

#: alignment of every block (bytes): TensorFlow's ``EIGEN_MAX_ALIGN_BYTES`` on AVX-512
#: builds, below which it copies an array it is handed instead of sharing it.
ALIGN_BYTES = 64
#: size-class granularity (bytes); requests below it are plain ``np.empty``.
BLOCK_QUANTUM_BYTES = 1 << 20
#: default bytes of free blocks a pool keeps for reuse.
DEFAULT_IDLE_LIMIT_BYTES = 256 << 20


class StagingPool:
    """Aligned float32 host buffers, recycled once garbage (module docstring).

    Args:
        idle_limit_bytes: most bytes of free blocks kept for reuse (default
            :data:`DEFAULT_IDLE_LIMIT_BYTES`); 0 keeps none (every block freed when its
            array dies).

    Raises:
        ValueError: ``idle_limit_bytes`` negative or not an int.

    Thread-safe: any thread may take a buffer, any thread may drop it.
    """

    def __init__(self, idle_limit_bytes: int = DEFAULT_IDLE_LIMIT_BYTES) -> None:
        if (
            isinstance(idle_limit_bytes, bool)
            or not isinstance(idle_limit_bytes, int)
            or idle_limit_bytes < 0
        ):
            raise ValueError(
                f"idle_limit_bytes={idle_limit_bytes!r}: expected a whole number of bytes >= 0"
            )
        self.idle_limit_bytes = idle_limit_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        # Reentrant: a garbage collection run while the lock is held (an allocation in
        # ``_give_back``) may finalize another buffer on this thread.
        self._lock = threading.RLock()
        self.idle_bytes = 0  #: bytes of free blocks kept
        self.live_bytes = 0  #: bytes of blocks handed out and not yet garbage
        self.peak_live_bytes = 0  #: the most :attr:`live_bytes` so far
        self.reused = 0  #: requests served by a free block
        self.allocated = 0  #: blocks allocated

    def empty(self, n: int) -> np.ndarray:
        """An uninitialised float32 ``[n]`` array, 64-byte aligned when ``4 * n`` is at
        least :data:`BLOCK_QUANTUM_BYTES` (then cut from a recycled block).

        Args:
            n: elements (int >= 0).

        Raises:
            ValueError: ``n`` negative or not an int.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n={n!r}: expected a whole number of elements >= 0")
        n = int(n)
        nbytes = 4 * n
        if nbytes < BLOCK_QUANTUM_BYTES:
            return np.empty(n, np.float32)
        size = -(-nbytes // BLOCK_QUANTUM_BYTES) * BLOCK_QUANTUM_BYTES
        with self._lock:
            free = self._free.get(size)
            block = free.pop() if free else None
            if block is not None:
                self.idle_bytes -= size
                self.reused += 1
            else:
                self.allocated += 1
            self.live_bytes += size
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        if block is None:
            raw = np.empty(size + ALIGN_BYTES, np.uint8)
            off = (-raw.ctypes.data) % ALIGN_BYTES
            block = raw[off : off + size]
        # The array is made over a ctypes object of its own (``handle``), not over the
        # block: NumPy points a view of a view at the first base that owns the memory or
        # is not an array, so every view made of ``out`` (a reshape, a slice) holds
        # ``handle`` and the block comes back only when the last of them is garbage.
        handle = (ctypes.c_char * nbytes).from_buffer(block)
        out = np.frombuffer(handle, np.float32)
        weakref.finalize(handle, self._give_back, block, size).atexit = False
        return out

    def copy(self, values: np.ndarray) -> np.ndarray:
        """``values`` (any shape, cast to float32) copied into a buffer of :meth:`empty`,
        flat: float32 ``[values.size]``."""
        flat = np.asarray(values).reshape(-1)
        out = self.empty(flat.size)
        np.copyto(out, flat, casting="unsafe")
        return out

    def _give_back(self, block: np.ndarray, size: int) -> None:
        with self._lock:
            self.live_bytes -= size
            if self.idle_bytes + size <= self.idle_limit_bytes:
                self._free.setdefault(size, []).append(block)
                self.idle_bytes += size

    def clear(self) -> None:
        """Free every idle block (live ones come back as usual, then kept or freed by the
        idle limit)."""
        with self._lock:
            self._free.clear()
            self.idle_bytes = 0


#: the process's pool, used by the stage-3 host calls.
POOL = StagingPool()


def empty(n: int) -> np.ndarray:
    """:meth:`StagingPool.empty` of the process's :data:`POOL`."""
    return POOL.empty(n)


def copy(values: np.ndarray) -> np.ndarray:
    """:meth:`StagingPool.copy` of the process's :data:`POOL`."""
    return POOL.copy(values)
