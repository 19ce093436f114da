"""The host buffer pool (stage.host.pool): reuse, rounding, how much stays idle. On the CPU
(unpinned buffers: the pool's logic is the same)."""

from __future__ import annotations

from strata_mgpu.stage.host.pool import GRANULE, HostBufferPool


def test_the_smallest_idle_buffer_that_fits_is_taken_again():
    pool = HostBufferPool(pin=False, keep=3)
    small, large = pool.take(100), pool.take(3 * GRANULE)
    assert small.numel() == GRANULE and large.numel() == 3 * GRANULE  # rounded up to the granule
    pool.give(large)
    pool.give(small)
    again = pool.take(10)
    assert again.data_ptr() == small.data_ptr() and pool.reused == 1
    assert pool.take(2 * GRANULE).data_ptr() == large.data_ptr()
    bigger = pool.take(4 * GRANULE)  # none idle is large enough
    assert bigger.numel() == 4 * GRANULE and pool.made == 3 and pool.idle_bytes == 0


def test_at_most_keep_buffers_stay_idle_the_largest_ones():
    pool = HostBufferPool(pin=False, keep=2)
    bufs = [pool.take(n * GRANULE) for n in (1, 3, 2)]
    for b in bufs:
        pool.give(b)
    assert pool.idle_bytes == 5 * GRANULE  # the 1-granule buffer was freed
    assert pool.take(GRANULE).numel() == 2 * GRANULE


def test_idle_buffers_too_small_are_let_go_before_more_is_pinned():
    pool = HostBufferPool(pin=False, keep=2)
    pool.give(pool.take(GRANULE))
    assert pool.idle_bytes == GRANULE
    pool.take(2 * GRANULE)
    assert pool.idle_bytes == 0 and pool.made == 2 and pool.reused == 0
