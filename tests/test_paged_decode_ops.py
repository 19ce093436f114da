"""The decode step's KV write and attention twins (`model.ops.DecodeOps`) on paged caches: a sequence's
positions through its block table into a pool's storage shared with other sequences (tests/paged_cache.py).
On the same cells they equal the twins on a contiguous cache, bit for bit, and write nothing outside the
written positions' cells. The CUDA kernels against these twins: tests/test_gpu_paged.py."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.kernels import decode_ops as DO
from strata_mgpu.model.kv_cache import KVCache, KVFormat
from strata_mgpu.model.ops import DecodeOps, kv_cells, rope_cos_sin, sequence_cells
from strata_mgpu.model.synthetic import PRESETS
from tests.paged_cache import Pool, random_blocks

CPU = torch.device("cpu")
FORMATS = [KVFormat(torch.float32), KVFormat(torch.bfloat16), KVFormat(torch.float32, Q.Q8_0, Q.BF16),
           KVFormat(torch.bfloat16, Q.BF16, Q.Q8_0), KVFormat(torch.bfloat16, Q.Q8_0, Q.Q8_0)]
SPEC = PRESETS["tiny"].spec("tiny")  # 4 query heads over 2 KV heads of 64
LAYERS, N_BLOCKS, MAX_BLOCKS = 2, 12, 6


def random_cache(fmt: KVFormat, capacity: int, g: torch.Generator) -> KVCache:
    """A contiguous cache of random valid cells."""
    kv = KVCache(LAYERS, SPEC.n_kv_heads, SPEC.head_dim, capacity=capacity, max_length=capacity, dtype=fmt.dtype,
                 keys=fmt.keys, values=fmt.values)
    for t, cells in ((fmt.keys, kv.k), (fmt.values, kv.v)):
        cells.copy_(fmt.store(t, torch.randn(LAYERS, capacity, SPEC.n_kv_heads, SPEC.head_dim, generator=g)
                              .to(fmt.dtype)))
    return kv


def batch(fmt: KVFormat, block_tokens: int, seed: int):
    """Rows of three sequences, two paged over one pool (blocks permuted) and one contiguous, at block
    edges and random positions, a cache's rows at distinct ones: (rows' caches, the same rows'
    contiguous copies, positions, pool)."""
    g = torch.Generator().manual_seed(seed)
    pool = Pool(LAYERS, SPEC.n_kv_heads, SPEC.head_dim, N_BLOCKS, block_tokens, fmt, CPU, g)
    a, b = (pool.sequence(blocks, MAX_BLOCKS) for blocks in random_blocks(N_BLOCKS, [3, MAX_BLOCKS], g))
    plain = random_cache(fmt, 2 * block_tokens, g)
    copies = {id(a): a.contiguous(), id(b): b.contiguous(), id(plain): plain}
    bt = block_tokens
    rows = [(a, bt - 1), (b, bt), (plain, int(torch.randint(0, plain.capacity, (1,), generator=g))),
            (b, b.capacity - 1), (a, 2 * bt), (b, 0), (a, int(torch.randint(bt + 1, 2 * bt - 1, (1,), generator=g)))]
    kvs = [kv for kv, _ in rows]
    return kvs, [copies[id(kv)] for kv in kvs], torch.tensor([p for _, p in rows]), pool


CASES = [(fmt, bt, seed) for fmt in FORMATS for bt, seed in ((16, 0), (32, 1), (16, 2))]
IDS = [f"{f.describe()}-B{bt}-seed{seed}" for f, bt, seed in CASES]


@pytest.mark.parametrize("fmt,block_tokens,seed", CASES, ids=IDS)
def test_attention_twin_through_a_block_table_equals_the_contiguous_cells(fmt, block_tokens, seed):
    kvs, copies, positions, _ = batch(fmt, block_tokens, seed)
    g = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(len(kvs), SPEC.n_heads, SPEC.head_dim, generator=g).to(fmt.dtype)
    got, want = DecodeOps().attention(1, q, positions, kvs), DecodeOps().attention(1, q, positions, copies)
    assert torch.equal(got, want)
    # the table matters: the same rows reading the pool's storage as cell = position differ
    assert not torch.equal(got, DecodeOps().attention(1, q, positions, [SimpleNamespace(
        k=kv.k[:, :kv.capacity], v=kv.v[:, :kv.capacity], format=kv.format, capacity=kv.capacity, block_table=None,
        block_tokens=0) for kv in kvs]))


@pytest.mark.parametrize("fmt,block_tokens,seed", CASES, ids=IDS)
def test_kv_write_twin_through_a_block_table_equals_the_contiguous_cells(fmt, block_tokens, seed):
    kvs, copies, positions, pool = batch(fmt, block_tokens, seed)
    g = torch.Generator().manual_seed(seed + 200)
    n, dh = len(kvs), SPEC.head_dim
    w = SimpleNamespace(q_norm=(1 + 0.1 * torch.randn(dh, generator=g)).to(fmt.dtype),
                        k_norm=(1 + 0.1 * torch.randn(dh, generator=g)).to(fmt.dtype))
    q, k, v = (torch.randn(n, h * dh, generator=g).to(fmt.dtype) for h in (SPEC.n_heads, SPEC.n_kv_heads,
                                                                           SPEC.n_kv_heads))
    cos, sin = rope_cos_sin(positions, SPEC, fmt.dtype)
    before_k, before_v = pool.k.clone(), pool.v.clone()
    got = DecodeOps().qk_norm_rope_kv(SPEC, w, 1, q, k, v, positions, cos, sin, kvs)
    want = DecodeOps().qk_norm_rope_kv(SPEC, w, 1, q, k, v, positions, cos, sin, copies)
    assert torch.equal(got, want)
    written = set()
    for kv, copy in zip(kvs, copies, strict=True):
        for layer in range(LAYERS):
            cells = sequence_cells(kv, layer)
            assert torch.equal(cells[0], copy.k[layer]) and torch.equal(cells[1], copy.v[layer])
        if kv.k is pool.k:
            written |= {int(c) for c, kr in zip(kv_cells(kv, positions), kvs, strict=True) if kr is kv}
    changed = (pool.k != before_k).flatten(2).any(-1) | (pool.v != before_v).flatten(2).any(-1)  # [L, cells]
    assert not changed[0].any() and set(changed[1].nonzero().flatten().tolist()) == written


def test_cells_follow_the_table_at_block_edges():
    pool = Pool(1, 1, 32, 4, 16, KVFormat(), CPU, torch.Generator().manual_seed(0))
    kv = pool.sequence([3, 1], MAX_BLOCKS)
    assert kv_cells(kv, torch.tensor([0, 15, 16, 31])).tolist() == [48, 63, 16, 31]
    kv.grow(0)
    assert kv.capacity == 48 and kv_cells(kv, torch.tensor([32, 47])).tolist() == [0, 15]
    plain = KVCache(1, 1, 32, capacity=64, max_length=64)
    assert kv_cells(plain, torch.tensor([0, 63])).tolist() == [0, 63]


@pytest.fixture
def host_ops(monkeypatch) -> DO.CudaDecodeOps:
    """CudaDecodeOps without a device (no kernels loaded): its tables made on the host."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ops = DO.CudaDecodeOps.__new__(DO.CudaDecodeOps)
    ops.device, ops._tables = CPU, OrderedDict()
    return ops


def test_kv_table_rows_name_the_block_table_not_its_blocks(host_ops):
    """Row (k base, v base, keys' layer stride, table address, log2 B), or (..., 0, 0): kept while
    the table's contents change, a new row for another table."""
    pool = Pool(LAYERS, 2, 64, 8, 32, KVFormat(torch.bfloat16, Q.Q8_0, Q.BF16), CPU, torch.Generator().manual_seed(0))
    paged, plain = pool.sequence([4, 2], MAX_BLOCKS), KVCache(LAYERS, 2, 64, capacity=64, max_length=64)
    table = host_ops.kv_table([paged, plain])
    assert table.tolist() == [[pool.k.data_ptr(), pool.v.data_ptr(), pool.k.stride(0), paged.block_table.data_ptr(), 5],
                              [plain.k.data_ptr(), plain.v.data_ptr(), plain.k.stride(0), 0, 0]]
    paged.grow(7)
    assert host_ops.kv_table([paged, plain]) is table
    other = pool.sequence([4, 2], MAX_BLOCKS)
    assert host_ops.kv_table([other, plain])[0, 3] == other.block_table.data_ptr()


def test_tables_the_kernels_cannot_read_go_to_the_twin():
    """Block tokens a power of two >= 16 (a tile of 8 keys in one block), an int32 table covering the
    capacity on the cache's device."""
    g = torch.Generator().manual_seed(0)
    ok = DO.CudaDecodeOps._blocks_ok
    assert ok(KVCache(1, 1, 32, capacity=64, max_length=64))
    for bt, fine in ((16, True), (64, True), (8, False), (24, False)):
        assert ok(Pool(1, 1, 32, 4, bt, KVFormat(), CPU, g).sequence([1, 2], 2)) == fine, bt
    kv = Pool(1, 1, 32, 4, 16, KVFormat(), CPU, g).sequence([1, 2], 2)
    kv.block_table = kv.block_table.long()
    assert not ok(kv)
    kv.block_table = torch.tensor([1], dtype=torch.int32)  # one entry for two blocks
    assert not ok(kv)
