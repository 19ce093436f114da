"""GPU checks of the decode kernels on paged caches (marker `gpu`; skipped without CUDA): `qk_norm_rope_kv`
writing and `attn_split` reading a sequence's cells through its block table in a pool shared with other
sequences (tests/paged_cache.py), against the twins (`model.ops.DecodeOps`, which equal the contiguous
twins on the same cells: tests/test_paged_decode_ops.py), for every pair of cache types, beside contiguous
rows in one batch; and one captured step replayed as its sequences grow block by block."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.model.kv_cache import PLAIN_KV, KVCache, KVFormat
from strata_mgpu.model.ops import DecodeOps, kv_cells, rope_cos_sin
from strata_mgpu.model.synthetic import PRESETS
from tests.paged_cache import PagedKV, Pool, random_blocks
from tests.test_gpu import CUDA, OPS_TOL, _fresh_generator, rel_err
from tests.test_gpu_kv_q8 import Q8_KEY_TOL, TYPES, random_caches

pytestmark = pytest.mark.gpu
LAYERS = 2
SPARE_BLOCKS = 3  # a pool's blocks no sequence holds: junk the kernels must not read


@pytest.fixture(scope="module", params=[PLAIN_KV, *TYPES], ids=lambda t: f"k_{t[0].name}_v_{t[1].name}")
def typed_ops(request):
    from strata_mgpu.kernels.decode_ops import CudaDecodeOps

    return CudaDecodeOps(CUDA, kv_types=request.param), request.param


def paged_batch(spec, types, block_tokens: int, counts: list[int], plain_capacity: int, g: torch.Generator,
                spare: int = SPARE_BLOCKS, room: int = 2) -> tuple[Pool, list[PagedKV], KVCache]:
    """Sequences of `counts` blocks each (permuted, tables with `room` more entries) over one pool of
    random cells with `spare` blocks more, and a contiguous cache of random cells."""
    n_blocks = sum(counts) + spare
    pool = Pool(LAYERS, spec.n_kv_heads, spec.head_dim, n_blocks, block_tokens, KVFormat(torch.bfloat16, *types),
                CUDA, g)
    seqs = [pool.sequence(blocks, len(blocks) + room) for blocks in random_blocks(n_blocks, counts, g)]
    return pool, seqs, random_caches(spec, [plain_capacity], types, g, LAYERS)[0]


def edge_rows(seqs: list[PagedKV], plain: KVCache, split: int, g: torch.Generator
              ) -> tuple[list[PagedKV | KVCache], torch.Tensor]:
    """A row for each sequence at a block edge, a split's first key, 0 or at random, in turn, the contiguous
    cache's row among them."""
    bt = seqs[0].block_tokens
    rows: list[tuple[PagedKV | KVCache, int]] = []
    for i, kv in enumerate(seqs):
        edge = [bt - 1, bt, kv.capacity - 1, split, 0, None][i % 6]
        rows.append((kv, int(torch.randint(0, kv.capacity, (1,), generator=g, device=CUDA)) if edge is None
                     else min(edge, kv.capacity - 1)))
        if i == 0:
            rows.append((plain, int(torch.randint(0, plain.capacity, (1,), generator=g, device=CUDA))))
    return [kv for kv, _ in rows], torch.tensor([p for _, p in rows], device=CUDA)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_tokens,counts",
                         [(32, 4, 128, 64, [1, 5, 40, 313, 2, 7]), (24, 2, 64, 16, [3, 70, 1]),
                          (32, 2, 256, 32, [2, 23])])
def test_fused_attention_through_block_tables_equals_twin(typed_ops, heads, kv_heads, head_dim, block_tokens,
                                                          counts):
    """Each row against its own sequence's blocks up to its own position: across block edges and split
    boundaries, at 0 and a sequence's last cell, a 20,000-cell one's wider splits, a contiguous row beside."""
    from strata_mgpu.kernels.decode_ops import attention_split

    ops, types = typed_ops
    spec = SimpleNamespace(n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim)
    g, seed = _fresh_generator()
    _, seqs, plain = paged_batch(spec, types, block_tokens, counts, 300, g)
    kvs, positions = edge_rows(seqs, plain, attention_split(max(kv.capacity for kv in seqs)), g)
    q = torch.randn(len(kvs), heads, head_dim, device=CUDA, generator=g).to(torch.bfloat16)
    before = ops.paths["attention:cuda"]
    got, want = ops.attention(1, q, positions, kvs), DecodeOps().attention(1, q, positions, kvs)
    assert ops.paths["attention:cuda"] == before + 1, ops.paths
    assert rel_err(got, want) <= OPS_TOL, f"seed {seed}, positions {positions.tolist()}"


def _key_tol(types) -> float:
    return Q8_KEY_TOL if types[0] == Q.Q8_0 else OPS_TOL


def _check_writes(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                  before: tuple[torch.Tensor, torch.Tensor], cells: torch.Tensor, fmt: KVFormat, what: str) -> None:
    """Layer 1's `cells` written as the twin wrote them (the keys within the kernels' tolerance, the values
    the same bytes), every other cell as it was."""
    (gk, gv), (wk, wv), (bk, bv) = got, want, before
    assert rel_err(fmt.load(fmt.keys, gk[1, cells]), fmt.load(fmt.keys, wk[1, cells])) <= _key_tol(fmt.types), what
    assert torch.equal(gv[1, cells], wv[1, cells]), what
    untouched = torch.ones(gk.shape[:2], dtype=torch.bool, device=CUDA)
    untouched[1, cells] = False
    assert torch.equal(gk[untouched], bk[untouched]) and torch.equal(gv[untouched], bv[untouched]), what


def _layer_weights(spec, g):
    return SimpleNamespace(q_norm=(1 + 0.1 * torch.randn(spec.head_dim, device=CUDA, generator=g)).to(torch.bfloat16),
                           k_norm=(1 + 0.1 * torch.randn(spec.head_dim, device=CUDA, generator=g)).to(torch.bfloat16))


@pytest.mark.parametrize("preset,block_tokens,counts", [("tiny", 16, [2, 4, 1]), ("30b-a3b", 64, [3, 1, 9, 2])])
def test_fused_kv_write_through_block_tables_equals_twin(typed_ops, preset, block_tokens, counts):
    """Row b's key and value land in its position's cell of its sequence's block (layer 1 of 2), and
    nowhere else in the pool or the contiguous cache beside."""
    ops, types = typed_ops
    spec = PRESETS[preset].spec(preset)
    g, seed = _fresh_generator()
    w = _layer_weights(spec, g)
    outs = []
    for impl in (ops, DecodeOps()):
        gen = torch.Generator(device=CUDA).manual_seed(seed)  # the same pool, tables and rows for both
        pool, seqs, plain = paged_batch(spec, types, block_tokens, counts, 200, gen)
        kvs, positions = edge_rows(seqs, plain, block_tokens + 1, gen)
        q, k, v = (torch.randn(len(kvs), n * spec.head_dim, device=CUDA, generator=gen).to(torch.bfloat16)
                   for n in (spec.n_heads, spec.n_kv_heads, spec.n_kv_heads))
        cos, sin = rope_cos_sin(positions, spec, torch.bfloat16)
        before = (pool.k.clone(), pool.v.clone()), (plain.k.clone(), plain.v.clone())
        outs.append((impl.qk_norm_rope_kv(spec, w, 1, q, k, v, positions, cos, sin, kvs), kvs, pool, plain, before))
    assert ops.paths["qk_norm_rope_kv:twin"] == 0, ops.paths
    (q_got, kvs, pool, plain, (pool_before, plain_before)), (q_want, _, pool_want, plain_want, _) = outs
    assert rel_err(q_got, q_want) <= OPS_TOL, f"seed {seed}"
    paged_cells = torch.cat([kv_cells(kv, positions[i:i + 1]) for i, kv in enumerate(kvs) if kv.k is pool.k])
    plain_cells = positions[[i for i, kv in enumerate(kvs) if kv is plain]]
    _check_writes((pool.k, pool.v), (pool_want.k, pool_want.v), pool_before, paged_cells, pool.format, f"seed {seed}")
    _check_writes((plain.k, plain.v), (plain_want.k, plain_want.v), plain_before, plain_cells, plain.format,
                  f"seed {seed}")


def test_a_captured_step_follows_its_tables_as_the_sequences_grow(typed_ops):
    """The KV write and attention captured once over two paged sequences and a contiguous one; then each
    paged sequence gains a block (its table's contents written on the device, its address kept) and the
    replays write and read the new blocks as the twin does."""
    ops, types = typed_ops
    spec = PRESETS["30b-a3b"].spec("30b-a3b")
    g, seed = _fresh_generator()
    bt, grown = 16, 3  # block tokens; blocks each paged sequence gains
    pool, (a, b), plain = paged_batch(spec, types, bt, [2, 3], 8 * bt, g, spare=2 * grown, room=grown)
    free = [blk for blk in range(pool.n_blocks) if blk not in a.blocks + b.blocks]
    kvs, capacity = [a, plain, b], 8 * bt  # the splits' plan covers every position a replay reads
    w = _layer_weights(spec, g)
    n, dh = len(kvs), spec.head_dim
    q, k, v = (torch.zeros(n, h * dh, dtype=torch.bfloat16, device=CUDA)
               for h in (spec.n_heads, spec.n_kv_heads, spec.n_kv_heads))
    positions = torch.zeros(n, dtype=torch.long, device=CUDA)
    cos, sin = (torch.zeros(n, dh, dtype=torch.bfloat16, device=CUDA) for _ in range(2))

    def load(at: list[int]) -> None:
        positions.copy_(torch.tensor(at, device=CUDA))
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device=CUDA, generator=g))
        c, s = rope_cos_sin(positions, spec, torch.bfloat16)
        cos.copy_(c), sin.copy_(s)

    table = ops.kv_table(kvs)  # made eagerly: the capture finds it

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        q_out = ops.qk_norm_rope_kv(spec, w, 1, q, k, v, positions, cos, sin, kvs, table)
        return q_out, ops.attention(1, q_out, positions, kvs, table, capacity)

    twins = ops.twin_runs(("qk_norm_rope_kv", "attention"))
    load([a.capacity - 1, 5, b.capacity - 1])
    side = torch.cuda.Stream(CUDA)
    side.wait_stream(torch.cuda.current_stream(CUDA))
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream(CUDA).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, out = step()
    for grew in range(grown + 1):
        if grew:
            for kv in (a, b):
                kv.grow(free.pop())
        # a: the new block's first cell; b: its last; the contiguous row a step on
        load([a.capacity - bt if grew else a.capacity - 1, 5 + grew, b.capacity - 1])
        twin_pool = pool.copy()
        twin_kvs = [a.on(twin_pool), copy.copy(plain), b.on(twin_pool)]
        twin_kvs[1].k, twin_kvs[1].v = plain.k.clone(), plain.v.clone()
        before = (pool.k.clone(), pool.v.clone())
        graph.replay()
        q_want = DecodeOps().qk_norm_rope_kv(spec, w, 1, q, k, v, positions, cos, sin, twin_kvs)
        what = f"seed {seed}, {grew} blocks grown, positions {positions.tolist()}"
        assert rel_err(q_out, q_want) <= OPS_TOL, what
        cells = torch.cat([kv_cells(a, positions[:1]), kv_cells(b, positions[2:])])
        _check_writes((pool.k, pool.v), (twin_pool.k, twin_pool.v), before, cells, pool.format, what)
        # the replay's attention over the cells it wrote, against the twin's over the same
        assert rel_err(out, DecodeOps().attention(1, q_out, positions, kvs)) <= OPS_TOL, what
    assert ops.twin_runs(("qk_norm_rope_kv", "attention")) == twins, ops.paths  # the kernels ran, and were captured
