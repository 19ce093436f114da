"""Which decode graph serves a batch (stage.graphs.capture.bucket_for): pure arithmetic, on the CPU."""

from __future__ import annotations

import pytest

from strata_mgpu.stage.graphs.capture import bucket_for, next_pow2


@pytest.mark.parametrize("n,want", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (1000, 1024)])
def test_next_pow2(n, want):
    assert next_pow2(n) == want


@pytest.mark.parametrize("rows,largest,want", [(1, 8, 1), (3, 8, 4), (5, 8, 8), (8, 8, 8), (5, 6, 6), (3, 3, 3),
                                               (7, 64, 8), (33, 64, 64)])
def test_padded_buckets_are_powers_of_two_up_to_the_largest(rows, largest, want):
    assert bucket_for(rows, largest) == want


@pytest.mark.parametrize("rows", [1, 3, 5, 7])
def test_without_padding_each_batch_size_is_its_own_graph(rows):
    assert bucket_for(rows, 8, pad=False) == rows
