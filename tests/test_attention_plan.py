"""The decode attention kernel's launch shape (kernels.decode_ops.attention_split): pure
arithmetic, checked on the CPU for the cache sizes decode meets."""

from __future__ import annotations

import pytest

from strata_mgpu.kernels import nvrtc
from strata_mgpu.kernels.decode_ops import ATTN_DEFINES, ATTN_MIN_KEYS, ATTN_SPLITS, attention_split


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


def row_split_keys(pos: int, keys: int, splits: int) -> int:
    """decode_attention.cu's row_split_keys: a row's pos + 1 keys over all the splits, in multiples
    of the granule, at most the launch's width."""
    per = -(-(pos + 1) // splits)
    return min(keys, -(-per // ATTN_MIN_KEYS) * ATTN_MIN_KEYS)


def test_the_kernel_is_compiled_with_the_planned_granule():
    """decode_attention.cu's SPLIT_GRANULE is the define its launcher passes (it has no value of its
    own: tests/test_nvrtc_compile.py compiles it without the define and sees it refused)."""
    assert dict(ATTN_DEFINES) == {"SPLIT_GRANULE": ATTN_MIN_KEYS}
    assert f"-DSPLIT_GRANULE={ATTN_MIN_KEYS}" in nvrtc.compile_options(ATTN_DEFINES)


@pytest.mark.parametrize("capacity", [1, 31, 4096, 4097, 40960, 65536, 131072])
def test_a_rows_splits_cover_its_keys_once_and_spread_over_the_card(capacity):
    keys = attention_split(capacity)
    splits = -(-capacity // keys)
    for pos in sorted(p for p in {0, 1, 31, 32, capacity // 3, capacity // 2, capacity - 1} if p < capacity):
        w = row_split_keys(pos, keys, splits)
        used = min(splits, pos // w + 1)  # attn_combine's
        covered = [j for s in range(used) for j in range(s * w, min((s + 1) * w, pos + 1))]
        assert covered == list(range(pos + 1)), (capacity, pos)  # every key once, in the splits combined
        assert all(s * w > pos for s in range(used, splits))  # the rest write nothing to combine
        # as wide as the row needs, not as the capacity does: within a granule of an even spread
        assert w < -(-(pos + 1) // splits) + ATTN_MIN_KEYS, (capacity, pos, w)
