"""The constrained-decoding mask on a GPU stage (marker `gpu`; skipped without CUDA): one row under
a JSON-schema grammar among free rows, in batches the stage's decode graphs replay, answers JSON
that validates, every token one its grammar allowed after the tokens before it; the free rows run
to their max_tokens beside it. On the tiny preset always, and on the file STRATA_GPU_MODEL names
(scripts/gpu_session.sh's 30B-A3B-shaped model) at --max-vram 16 and 40."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest
import torch

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.engine import Engine, RequestOutput
from strata_mgpu.engine.grammar import GrammarCompiler
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.server.grammars import text_grammar
from tests.engine_runs import run_all
from tests.test_agents_engine import SCHEMA
from tests.test_gpu import stage_on_its_own_budget

pytestmark = pytest.mark.gpu
BATCH = 8  # the default largest decode graph (STRATA_DECODE_GRAPH_BATCH)
BIG_MODEL = os.environ.get("STRATA_GPU_MODEL")


def models() -> list:
    cases = [pytest.param("tiny", 8.0, id="tiny")]
    if BIG_MODEL:
        cases += [pytest.param(BIG_MODEL, gib, id=f"{Path(BIG_MODEL).stem}-{gib:g}GiB") for gib in (16.0, 40.0)]
    return cases


def tokens_of(out: list[RequestOutput]) -> list[int]:
    return [t for o in out for t in o.token_ids]


@pytest.mark.parametrize(("model", "budget_gib"), models())
def test_one_constrained_row_among_free_rows_validates_in_graph_replayed_batches(tiny_gguf, model, budget_gib):
    f = GGUFFile(tiny_gguf if model == "tiny" else model)
    spec = spec_from_gguf(f)
    tok = tokenizer_from_gguf(f)
    stage, _ = stage_on_its_own_budget(f, spec, budget_gib)
    grammar = GrammarCompiler(tok, spec.vocab_size).compile(text_grammar(SCHEMA))
    prompts = [tok.encode(f"Row {i} of the batch:") for i in range(BATCH)]
    for temperature in (0.0, 0.9):  # greedy, and sampled
        constrained = SamplingParams(max_tokens=160, temperature=temperature, seed=7, grammar=grammar)
        free = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True) for i in range(BATCH - 1)]
        engine = Engine(stage, tok, EngineConfig(ctx_size=512, max_running=BATCH, prefix_cache=False))
        outs = run_all(engine, list(zip(prompts, [constrained, *free], strict=True)))
        answer = "".join(o.text for o in outs[0])
        jsonschema.validate(json.loads(answer), SCHEMA)
        assert outs[0][-1].finish_reason == "stop"
        replay = grammar.matcher()
        assert all(replay.accept(t) for t in tokens_of(outs[0])) and replay.done
        for out in outs[1:]:
            assert len(tokens_of(out)) == 24 and out[-1].finish_reason == "length"
        assert BATCH in stage.graphs.captured, "the batch of 8 never replayed its graph"
    del stage
    torch.cuda.empty_cache()
