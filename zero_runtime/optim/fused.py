"""Which host update kernels run: numba's fused ones, or NumPy's when numba is missing.

:mod:`zero_runtime.optim.kernels` asks :func:`active` at each call; with the numba backend
each kernel is one compiled pass over the tile (:mod:`zero_runtime.optim.numba_kernels`),
bitwise equal to the NumPy kernels. Measured by ``bench/bench_host_adam.py`` (2 cores
shared at load ~4): the NumPy Adam reaches 0.26-0.31 of the memory-bandwidth bound, the
fused one 0.78-0.85.

The backend is chosen once per process, at the first host update (numba's import and
its threading layer cost about a second then, its compiled kernels are cached on disk):

- ``ZERO_RUNTIME_HOST_OPTIMIZER`` unset or ``auto``: numba when it can be imported, else
  NumPy, logged as a warning naming the cause and the fix (``pip install numba``) and
  reported by :func:`backend_info` (``memory_hierarchy/run_info``'s
  ``host_optimizer``);
- ``numba``: numba or ``RuntimeError``; ``numpy``: the NumPy kernels.

Numba that imports but cannot load a thread-safe threading layer (OpenMP or TBB; the
replicas' updates launch kernels from several threads at once) raises ``RuntimeError``
naming the fix rather than falling back.

``ZERO_RUNTIME_HOST_OPTIMIZER_THREADS`` (default :data:`DEFAULT_THREADS`) sets the numba
threads of one kernel call. Measured on 2 shared cores (``bench/bench_host_adam.py``): one
thread per call reaches 0.8-0.85 of the bandwidth bound, and the replicas' updates
already run concurrently, one per core; a second thread per call costs a wake-up of up
to ~0.2 ms on loaded cores (a 256 Ki-element tile takes ~0.15 ms), which halved one
caller's rate in most rounds, and oversubscribes the cores when both replicas update.
"""

from __future__ import annotations

import logging
import os
import threading
from types import ModuleType
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: environment variable choosing the backend: ``auto`` (default), ``numba`` or ``numpy``.
BACKEND_ENV = "ZERO_RUNTIME_HOST_OPTIMIZER"
#: environment variable giving the numba threads per kernel call (default DEFAULT_THREADS).
THREADS_ENV = "ZERO_RUNTIME_HOST_OPTIMIZER_THREADS"
#: numba threads per kernel call when THREADS_ENV is unset (module docstring).
DEFAULT_THREADS = 1
#: numba's threading layers that take launches from several threads at once.
THREADSAFE_LAYERS = ("omp", "tbb")

_lock = threading.Lock()
_module: ModuleType | None = None
_info: dict[str, Any] | None = None
_threads = DEFAULT_THREADS
_set_num_threads = None  # numba.set_num_threads once numba is in use
_calling = threading.local()  # .threads: what this thread last gave numba


def _requested() -> str:
    raw = os.environ.get(BACKEND_ENV, "").strip().lower() or "auto"
    if raw not in ("auto", "numba", "numpy"):
        raise ValueError(f"{BACKEND_ENV}={raw!r}: expected 'auto', 'numba' or 'numpy'")
    return raw


def _threads_from_env(limit: int) -> int:
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return min(DEFAULT_THREADS, limit)
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= limit:
        raise ValueError(
            f"{THREADS_ENV}={raw!r}: expected a whole number of threads in [1, {limit}] "
            "(numba.config.NUMBA_NUM_THREADS; set NUMBA_NUM_THREADS for more)"
        )
    return value


def _load_numba() -> tuple[ModuleType, dict[str, Any]]:
    """Import the numba kernels and launch one through the threading layer.

    Raises:
        ImportError: numba is not installed.
        RuntimeError: no thread-safe threading layer (the fix in the message).
    """
    import numba

    from zero_runtime.optim import numba_kernels

    limit = int(numba.config.NUMBA_NUM_THREADS)
    threads = _threads_from_env(limit)
    try:
        numba_kernels.probe(np.empty(4, np.float32))
    except ValueError as exc:  # numba: "No threading layer could be loaded."
        raise RuntimeError(
            f"numba {numba.__version__} has no thread-safe threading layer ({exc}); the "
            "host optimizer needs OpenMP or TBB: install libgomp1 (apt-get install "
            f"libgomp1) or TBB (pip install tbb), or set {BACKEND_ENV}=numpy"
        ) from exc
    layer = numba.threading_layer()
    if layer not in THREADSAFE_LAYERS:
        raise RuntimeError(
            f"numba's threading layer is {layer!r}, which aborts the process when two "
            "replicas update at once; unset NUMBA_THREADING_LAYER (numba then picks "
            f"OpenMP or TBB) or set {BACKEND_ENV}=numpy"
        )
    info = {
        "backend": "numba",
        "numba_version": numba.__version__,
        "threading_layer": layer,
        "threads": threads,
    }
    return numba_kernels, info


def _use_numba(module: ModuleType, info: dict[str, Any]) -> None:
    """Make the numba kernels current (under ``_lock``)."""
    global _module, _info, _threads, _set_num_threads
    import numba

    _module, _info, _threads = module, info, info["threads"]
    _set_num_threads = numba.set_num_threads


def _resolve() -> None:
    global _module, _info, _threads
    with _lock:
        if _info is not None:
            return
        requested = _requested()
        if requested == "numpy":
            _module, _info = None, {"backend": "numpy", "reason": f"{BACKEND_ENV}=numpy"}
            return
        try:
            module, info = _load_numba()
        except ImportError as exc:
            if requested == "numba":
                raise RuntimeError(
                    f"{BACKEND_ENV}=numba but numba cannot be imported ({exc}); pip install numba"
                ) from exc
            reason = f"numba cannot be imported ({exc}); pip install numba"
            log.warning(
                "host optimizer: NumPy kernels (about 12 passes per tile, 0.3-0.6 of the "
                "memory-bandwidth bound): %s",
                reason,
            )
            _module, _info = None, {"backend": "numpy", "reason": reason}
            return
        _use_numba(module, info)
        log.info("host optimizer: numba's fused kernels (%s)", info)


def active() -> ModuleType | None:
    """The numba kernels module when the fused backend is in use, else None (NumPy).

    Resolves the backend on the first call (module docstring).

    Raises:
        ValueError: an invalid ``ZERO_RUNTIME_HOST_OPTIMIZER`` or ``..._THREADS``.
        RuntimeError: numba was required but cannot be imported, or it has no
            thread-safe threading layer.
    """
    if _info is None:
        _resolve()
    if _module is not None and getattr(_calling, "threads", 0) != _threads:
        # numba's thread count is per calling thread (NUMBA_NUM_THREADS for a new one).
        _set_num_threads(_threads)
        _calling.threads = _threads
    return _module


def threads() -> int:
    """Numba threads per kernel call (1 with the NumPy backend)."""
    active()
    return _threads


def backend_info() -> dict[str, Any]:
    """The backend in use, for run records: ``{"backend": "numba", "numba_version",
    "threading_layer", "threads"}`` or ``{"backend": "numpy", "reason"}`` (a copy).

    Raises:
        as :func:`active`.
    """
    active()
    return dict(_info)


def resolved_info() -> dict[str, Any] | None:
    """:func:`backend_info` when the backend has been chosen (a host optimizer store was
    built, or a host kernel ran), else None; never chooses it (no numba import)."""
    info = _info
    return None if info is None else dict(info)


def use(backend: str, threads: int | None = None) -> dict[str, Any]:
    """Switch the process's host kernels to ``backend`` (``"numba"`` or ``"numpy"``),
    optionally with ``threads`` numba threads per call, and return the previous
    :func:`backend_info` (pass its ``backend`` and ``threads`` back to restore it). For
    benchmarks and tests that compare the two; the runtime itself never switches.

    Raises:
        ValueError: an unknown backend, or ``threads`` outside ``[1,
            NUMBA_NUM_THREADS]``.
        ImportError: ``"numba"`` without numba installed.
        RuntimeError: as :func:`active`.
    """
    global _module, _info, _threads
    previous = backend_info()
    if backend not in ("numba", "numpy"):
        raise ValueError(f"backend must be 'numba' or 'numpy', got {backend!r}")
    with _lock:
        if backend == "numpy":
            _module, _info, _threads = None, {"backend": "numpy", "reason": "use()"}, 1
            return previous
    module, info = _load_numba()
    if threads is not None:
        import numba

        limit = int(numba.config.NUMBA_NUM_THREADS)
        if not 1 <= threads <= limit:
            raise ValueError(f"threads must be in [1, {limit}], got {threads}")
        info["threads"] = threads
    with _lock:
        _use_numba(module, info)
    return previous
