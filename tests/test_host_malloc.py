"""The offload tiers' malloc tuning (zero_runtime/memory/host_malloc.py): with the
settings TensorFlow's dataset kernel leaves (``M_TRIM_THRESHOLD`` = 128 KiB), every fresh
multi-MB NumPy buffer page-faults; tuned, the buffers a loop reuses stay mapped. Measured
in a fresh process by its minor page faults (``getrusage``); bad settings are refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zero_runtime.memory import host_malloc

LOOP = r"""
import ctypes, ctypes.util, json, resource, sys
import numpy as np
from zero_runtime.memory import host_malloc
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD as TensorFlow's GeneratorDataset sets it


def faults_per_buffer(n=50, size=1 << 20):  # 4 MiB float32 buffers, written whole
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        a = np.empty(size, np.float32)
        a[:] = 1.0
        del a
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n


untuned = faults_per_buffer()
pad = host_malloc.tune_host_malloc()
tuned = faults_per_buffer()
print(json.dumps({"untuned": untuned, "tuned": tuned, "pad": pad}))
"""


def _run(env_pad: str | None) -> dict:
    env = None
    if env_pad is not None:
        import os

        env = {**os.environ, host_malloc.ENV: env_pad}
    out = subprocess.run(
        [sys.executable, "-c", LOOP], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_malloc_keeps_a_reused_buffer_mapped():
    r = _run(None)
    # A 4 MiB buffer is 1024 pages of 4 KiB: untuned, it faults again on every use
    # (measured 514 faults a buffer: the kernel maps some pages two at a time).
    assert r["untuned"] >= 256, r
    assert r["pad"] == host_malloc.DEFAULT_TOP_PAD_BYTES
    assert r["tuned"] < r["untuned"] / 20, r


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_zero_leaves_malloc_alone():
    r = _run("0")
    assert r["pad"] == 0 and r["tuned"] >= 256, r


@pytest.mark.parametrize("bad", ["-1", "lots", "4294967296"])
def test_a_bad_setting_is_refused_naming_it(bad, monkeypatch):
    monkeypatch.setenv(host_malloc.ENV, bad)
    with pytest.raises(ValueError, match=host_malloc.ENV) as err:
        host_malloc.top_pad_bytes()
    assert repr(bad) in str(err.value) and "2**31" in str(err.value)
