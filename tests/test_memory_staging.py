"""The recycled host staging buffers (zero_runtime/memory/staging.py): aligned blocks,
reused only once nothing reads them, TensorFlow's zero-copy hold counted, the idle limit,
and bad input."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import tensorflow as tf

from zero_runtime.memory.staging import ALIGN_BYTES, BLOCK_QUANTUM_BYTES, StagingPool

N = 3 * BLOCK_QUANTUM_BYTES // 4 + 17  # elements: a 3 MiB + 68 B request -> a 4 MiB block


def test_a_buffer_is_aligned_float32_of_the_size_asked_and_comes_back_once_garbage():
    pool = StagingPool()
    a = pool.empty(N)
    assert a.dtype == np.float32 and a.shape == (N,)
    assert a.ctypes.data % ALIGN_BYTES == 0
    assert pool.live_bytes == 4 * BLOCK_QUANTUM_BYTES and pool.allocated == 1
    address = a.ctypes.data
    del a
    gc.collect()
    assert pool.live_bytes == 0 and pool.idle_bytes == 4 * BLOCK_QUANTUM_BYTES
    b = pool.empty(N - 5)  # the same size class: the same block again
    assert b.ctypes.data == address and pool.reused == 1 and pool.allocated == 1
    assert pool.idle_bytes == 0


def test_a_view_still_read_keeps_its_block_from_reuse():
    pool = StagingPool()
    a = pool.empty(N)
    a[:] = 7.0
    tail = a.reshape(-1)[100:]
    del a
    gc.collect()
    assert pool.idle_bytes == 0 and pool.live_bytes == 4 * BLOCK_QUANTUM_BYTES
    other = pool.empty(N)  # a new block: the first is still read through ``tail``
    other[:] = -1.0
    assert np.all(tail == 7.0) and pool.allocated == 2
    del tail
    gc.collect()
    assert pool.idle_bytes == 4 * BLOCK_QUANTUM_BYTES


def test_small_requests_are_plain_arrays_and_the_idle_limit_frees_blocks_past_it():
    pool = StagingPool(idle_limit_bytes=4 * BLOCK_QUANTUM_BYTES)
    small = pool.empty(10)
    assert small.shape == (10,) and pool.live_bytes == 0 and pool.allocated == 0
    a, b = pool.empty(N), pool.empty(N)
    assert pool.peak_live_bytes == 8 * BLOCK_QUANTUM_BYTES
    del a, b
    gc.collect()
    assert pool.idle_bytes == 4 * BLOCK_QUANTUM_BYTES  # one kept, one freed
    pool.clear()
    assert pool.idle_bytes == 0


def test_copy_casts_and_flattens():
    pool = StagingPool()
    values = np.arange(2 * N, dtype=np.float64).reshape(2, N)
    out = pool.copy(values)
    assert out.dtype == np.float32 and out.shape == (2 * N,)
    np.testing.assert_array_equal(out, values.reshape(-1).astype(np.float32))


def test_tensorflow_holds_a_returned_buffer_without_a_copy_until_its_tensor_is_freed():
    """``tf.numpy_function`` shares an aligned returned array (no copy): the block stays
    live while the tensor does, a second call meanwhile gets another block, and the values
    of both are intact; freed tensors give their blocks back."""
    pool = StagingPool()
    fill = iter([1.0, 2.0])

    def host(_):
        out = pool.empty(N)
        out[:] = next(fill)
        return out

    @tf.function
    def read(x):
        return tf.numpy_function(host, [x], tf.float32, stateful=True)

    first = read(tf.constant(0.0))
    assert pool.live_bytes == 4 * BLOCK_QUANTUM_BYTES  # held by the tensor, not copied
    second = read(tf.constant(0.0))
    assert pool.allocated == 2 and pool.live_bytes == 8 * BLOCK_QUANTUM_BYTES
    assert float(tf.reduce_min(first)) == float(tf.reduce_max(first)) == 1.0
    assert float(tf.reduce_min(second)) == float(tf.reduce_max(second)) == 2.0
    del first, second
    gc.collect()
    tf.constant(0.0) + 1.0  # TF drops its references once Python runs again (delayed decref)
    gc.collect()
    assert pool.live_bytes == 0 and pool.idle_bytes == 8 * BLOCK_QUANTUM_BYTES


@pytest.mark.parametrize("bad", [-1, 2.5, "8", True])
def test_bad_sizes_are_refused_with_the_value(bad):
    with pytest.raises(ValueError, match="expected a whole number of elements"):
        StagingPool().empty(bad)
    with pytest.raises(ValueError, match="idle_limit_bytes"):
        StagingPool(idle_limit_bytes=-1)
    with pytest.raises(ValueError, match="idle_limit_bytes"):
        StagingPool(idle_limit_bytes=True)
