"""The decode attention kernel's launch shape (kernels.decode_ops.attention_split): pure
arithmetic, checked on the CPU for the shapes of the models we serve."""

from __future__ import annotations

import pytest

from strata_mgpu.kernels.decode_ops import (
    ATTN_MIN_KEYS,
    ATTN_SHARED_BYTES,
    ATTN_SPLITS,
    attention_shared_bytes,
    attention_split,
)


@pytest.mark.parametrize("group,head_dim", [(2, 64), (8, 128), (16, 128), (16, 256)])  # tiny, 30B-A3B, 235B-A22B
@pytest.mark.parametrize("capacity", [1, 64, 65, 1000, 8192, 8193, 40960, 131072, 262144])
def test_splits_cover_the_cache_within_shared_memory(group, head_dim, capacity):
    keys = attention_split(capacity, group, head_dim)
    splits = -(-capacity // keys)
    assert keys % ATTN_MIN_KEYS == 0 and keys >= ATTN_MIN_KEYS
    assert attention_shared_bytes(group, head_dim, keys) <= ATTN_SHARED_BYTES
    wider = attention_shared_bytes(group, head_dim, keys + ATTN_MIN_KEYS) <= ATTN_SHARED_BYTES
    assert splits <= ATTN_SPLITS or not wider  # more splits only where shared memory caps the width
    if capacity <= ATTN_MIN_KEYS * ATTN_SPLITS:
        assert keys == ATTN_MIN_KEYS  # short caches: the narrowest splits, the most blocks


def test_a_group_too_wide_for_shared_memory_gets_no_split():
    assert attention_split(1024, 64, 256) == 0  # the op then runs its twin
