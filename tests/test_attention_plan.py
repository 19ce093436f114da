"""The decode attention kernel's launch shape (kernels.decode_ops.attention_split): pure
arithmetic, checked on the CPU for the cache sizes decode meets."""

from __future__ import annotations

import pytest

from strata_mgpu.kernels.decode_ops import ATTN_MIN_KEYS, ATTN_SPLITS, attention_split


@pytest.mark.parametrize("capacity", [1, 32, 33, 1000, 4096, 8192, 8193, 40960, 131072, 262144])
def test_splits_cover_the_cache_in_at_most_the_planned_count(capacity):
    keys = attention_split(capacity)
    splits = -(-capacity // keys)
    assert keys % ATTN_MIN_KEYS == 0 and keys >= ATTN_MIN_KEYS
    assert splits <= ATTN_SPLITS and splits * keys >= capacity
    if keys > ATTN_MIN_KEYS:  # a wider split only where the narrower one would need more splits
        assert -(-capacity // (keys - ATTN_MIN_KEYS)) > ATTN_SPLITS
    if capacity <= ATTN_MIN_KEYS * ATTN_SPLITS:
        assert keys == ATTN_MIN_KEYS  # short caches: the narrowest splits, the most blocks
