"""The prefix cache on the GPU (marker `gpu`; skipped without CUDA): a continuation on blocks
restored from VRAM and from pinned host RAM against the prompt computed whole, on one stage and on
two stages of one card; the engine's turns with the blocks moved to the host tier between them."""

from __future__ import annotations

import gc

import pytest
import torch

from strata_mgpu.config import EngineConfig, LayerSplit, StageSwitches
from strata_mgpu.engine.engine import Engine, RequestOutput
from strata_mgpu.engine.prefix_cache import DEVICE, HOST
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_pool import BlockTable
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.split.runner import build_split
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions
from tests.engine_runs import run_one

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
# The restored rows are the same bits the forwards wrote; what differs is the chunking (the rest of
# the prompt as one chunk against the whole prompt as one), whose bf16 GEMMs round differently.
BF16_TOL = 2e-2  # max|diff| / max|ref|, as in test_gpu.py


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module", params=["stage", "split"])
def runner(request, tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    gc.collect()
    opts = StageOptions(device=CUDA, max_vram_gib=8, chunk_size=512)
    if request.param == "stage":
        return build_stage(f, spec, opts)
    return build_split(f, spec, [opts, opts], LayerSplit((2,)))


def test_a_continuation_on_restored_blocks_equals_the_prompt_computed_whole(runner):
    """A sequence whose table starts with another's blocks, two of them through pinned host RAM and
    the last shared in part (so copied), continues as the prompt computed whole."""
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, runner.spec.vocab_size, (300,), generator=g)
    pool = runner.kv_pool(64, 1024)
    blocks = pool.blocks
    whole = runner.new_sequence(512, BlockTable(blocks, 512))
    want = runner.prefill(whole, prompt)
    first_table = BlockTable(blocks, 512)
    first = runner.new_sequence(512, first_table)
    runner.prefill(first, prompt[:260])
    shared = first_table.ids[:4]  # 256 tokens
    for i in range(2):  # two from pinned host RAM, loaded into other blocks
        data = pool.offload(shared[i])
        (moved,) = blocks.allocate(1)
        pool.load(data, moved)
        shared[i] = moved
    table = BlockTable.adopt(blocks, 512, shared)
    (own,) = blocks.allocate(1)  # 250 of the 256: the last block is written to, so a copy of its own
    pool.copy_block(table.ids[-1], own)
    table.replace_last(own)
    again = runner.new_sequence(512, table, 250)
    got = runner.prefill(again, prompt[250:])
    assert rel_err(got, want) < BF16_TOL
    step = torch.tensor([int(want.argmax())], device=CUDA)
    a, b = runner.decode([whole], step)[0], runner.decode([again], step)[0]
    assert rel_err(b, a) < BF16_TOL
    # the first sequence's rows are untouched by the second's writes
    assert rel_err(runner.prefill(first, prompt[260:]), want) < BF16_TOL


def run(engine: Engine, prompt: list[int]) -> list[RequestOutput]:
    return run_one(engine, prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))


def test_turns_restore_the_same_rows_from_vram_and_from_host_ram(runner, tiny_gguf):
    """The same turn twice, its prefix restored from VRAM and then from pinned host RAM: the same
    bits, the same chunk, so the same tokens."""
    tok = tokenizer_from_gguf(GGUFFile(tiny_gguf))
    engine = Engine(runner, tok, EngineConfig(ctx_size=1024, prefix_block_tokens=64))
    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(0, runner.spec.vocab_size, (400,), generator=g).tolist()
    run(engine, prompt)
    turn = prompt + [5, 6, 7]
    from_vram = run(engine, turn)
    assert from_vram[-1].timings.cache_n == 384
    assert engine.prefix.reclaim(engine.prefix.reclaimable) >= 6  # every cached block to the host tier
    assert engine.prefix.stats.blocks[DEVICE] == 0 and engine.prefix.stats.blocks[HOST] >= 6
    from_host = run(engine, turn)
    assert from_host[-1].timings.cache_n == 384
    assert [t for o in from_host for t in o.token_ids] == [t for o in from_vram for t in o.token_ids]


def test_the_helper_takes_a_continuation_that_fits_one_chunk(tiny_gguf):
    """Two stages of one card, fp32: the rest of a prompt after restored blocks, helped (a fixed
    share), equals it unhelped within fp32 rounding, and the helper did move rows."""
    from strata_mgpu.split.help_rule import HelpPolicy

    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    opts = StageOptions(device=CUDA, max_vram_gib=4, chunk_size=512, dtype=torch.float32,
                        switches=StageSwitches(cuda_graphs=False, resident_experts=2))
    runner = build_split(f, spec, [opts, opts], LayerSplit((2,)), help_policy=HelpPolicy())
    g = torch.Generator().manual_seed(13)
    prompt = torch.randint(0, spec.vocab_size, (400,), generator=g)
    blocks = runner.kv_pool(64, 1024).blocks
    first_table = BlockTable(blocks, 512)
    first = runner.new_sequence(512, first_table)
    runner.prefill(first, prompt[:128], whole_prompt=True)
    shared = first_table.ids[:2]  # whole blocks: the continuation writes blocks of its own
    outs = []
    for policy in (HelpPolicy(enabled=False), HelpPolicy(fixed_share=0.4)):
        runner.policy = policy
        table = BlockTable.adopt(blocks, 512, shared)
        kv = runner.new_sequence(512, table, 128)
        outs.append(runner.prefill(kv, prompt[128:], whole_prompt=True).cpu())
        table.free()
    assert rel_err(outs[1], outs[0]) <= 1e-5
    assert all(h.to_helper.bytes_moved > 0 for h in runner.helpers)
