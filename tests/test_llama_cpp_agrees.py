"""llama.cpp reads the synthetic files as this project does: the same GGUF (fp32 weights, so that
neither side's quantized dots decide), the same prompt, and the plain forward's logits against
llama.cpp's CPU backend through llama-cpp-python, then greedy decoding on both.

llama-cpp-python is not a dependency (it builds llama.cpp from its sdist for minutes): these tests
run where it is installed (`pip install llama-cpp-python==0.3.36`, the version whose llama.cpp the
issues measure against) and are skipped elsewhere, CI among them. A run's figures: docs/BENCHMARKS.md,
"llama.cpp on the same files"."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_pool import BlockPool, BlockTable
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import ModelSpec, spec_from_gguf
from strata_mgpu.model.synthetic import write_model

llama_cpp = pytest.importorskip("llama_cpp")

PROMPT_TOKENS = 40
STEPS = 16
# fp32 weights on both sides; llama.cpp keeps its KV in f16 and sums in other orders (its DeltaNet scan
# in chunks of its own): 1.9e-4 at most seen
LOGIT_RTOL = 1e-3
# the file's blocks: llama.cpp's CPU dots quantize the activations to 8 bits, these dequantize the
# weights to fp32 (about 2e-2 a position); where a router's top-k is a near tie the two pick different
# experts at that position (seen: 1 to 4 of 40 positions at 0.1-0.5, their neighbours unaffected)
BLOCKS_RTOL = 5e-2
BLOCKS_MEDIAN = 3e-2


def llama_logits(path, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int], list[np.ndarray]]:
    """llama.cpp's last-row logits of the prompt [V], its greedy tokens, and each step's logits."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=64, n_threads=2, logits_all=True,
                          verbose=False)
    llm.eval(prompt)
    first = np.array(llm.scores[len(prompt) - 1], dtype=np.float64)
    tokens, step_logits, logits = [], [], first
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        llm.eval(tokens[-1:])
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        step_logits.append(logits)
    return first, tokens, step_logits


def as_llama_cpp_reads(spec: ModelSpec) -> ModelSpec:
    """The spec as llama.cpp computes it: gpt-oss's YaRN range truncated, as llama.cpp does for every
    model (ggml's corr dims floored and ceiled); ours follows the trained model's untruncated range (its
    config's `truncate: false`, transformers and OpenAI's reference), which moves a tiny model's
    logits by ~1e-1 at position 40 and nothing else (with it truncated: 4e-4 at every position)."""
    if spec.gpt_oss is None or spec.rope_scaling is None:
        return spec
    return replace(spec, rope_scaling=replace(spec.rope_scaling, truncate=True))


def our_logits(path, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int], list[np.ndarray]]:
    """The same from the fp32 reference runner."""
    f = GGUFFile(path)
    spec = as_llama_cpp_reads(spec_from_gguf(f))
    runner = load_reference_runner(f, spec)
    pool = runner.kv_pool(16, 256)
    blocks: BlockPool = pool.blocks
    kv = runner.new_sequence(256, BlockTable(blocks, 256))
    logits = runner.prefill(kv, torch.tensor(prompt))
    first = logits.double().numpy()
    tokens, step_logits = [], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = runner.decode([kv], torch.tensor(tokens[-1:]))[0]
        step_logits.append(logits.double().numpy())
    return first, tokens, step_logits


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid", "tiny-next", "tiny-gpt-oss", "tiny-glm4moe"])
def test_llama_cpp_computes_the_same_logits_and_greedy_tokens(preset, tmp_path):
    path = tmp_path / f"{preset}.gguf"
    spec = write_model(path, preset, expert_type=Q.F32, down_type=Q.F32, dense_type=Q.F32, seed=3)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, spec.vocab_size, PROMPT_TOKENS).tolist()
    want_first, want_tokens, want_steps = llama_logits(path, prompt, STEPS)
    got_first, got_tokens, got_steps = our_logits(path, prompt, STEPS)
    err = rel(got_first, want_first)
    assert err < LOGIT_RTOL, f"{preset}: prompt logits differ by {err:.2e}"
    # greedy chains part only at a near tie; up to there each step's logits agree
    same = next((i for i, (a, b) in enumerate(zip(got_tokens, want_tokens, strict=True)) if a != b), STEPS)
    for i in range(same):
        assert rel(got_steps[i], want_steps[i]) < LOGIT_RTOL, f"{preset}: step {i} differs by " \
                                                               f"{rel(got_steps[i], want_steps[i]):.2e}"
    if same < STEPS:  # a tie: the two best logits on our side within the tolerance
        top = np.sort(got_steps[same - 1] if same else got_first)[-2:]
        assert top[1] - top[0] < LOGIT_RTOL * np.abs(got_first).max(), f"{preset}: greedy parts at step {same}"


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid", "tiny-glm4moe", "tiny-gpt-oss"])
def test_llama_cpp_agrees_on_the_files_blocks_at_almost_every_position(preset, tmp_path):
    """Q4_K / Q6_K experts and Q8_0 projections as `gen-model` writes them: every prompt position's
    logits, each from a prompt of that length on our side, against llama.cpp's of one pass."""
    path = tmp_path / f"{preset}.gguf"
    spec = write_model(path, preset, seed=3)
    prompt = np.random.default_rng(5).integers(0, spec.vocab_size, PROMPT_TOKENS).tolist()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=64, n_threads=2, logits_all=True,
                          verbose=False)
    llm.eval(prompt)
    f = GGUFFile(path)
    runner = load_reference_runner(f, as_llama_cpp_reads(spec_from_gguf(f)))
    errs = []
    for n in range(1, PROMPT_TOKENS + 1):
        kv = runner.new_sequence(256, BlockTable(runner.kv_pool(16, 256).blocks, 256))
        got = runner.prefill(kv, torch.tensor(prompt[:n])).double().numpy()
        errs.append(rel(got, np.array(llm.scores[n - 1], dtype=np.float64)))
    errs_a = np.array(errs)
    assert np.median(errs_a) < BLOCKS_MEDIAN, f"{preset}: median {np.median(errs_a):.2e}"
    far = np.flatnonzero(errs_a >= BLOCKS_RTOL)
    assert len(far) <= PROMPT_TOKENS // 10, f"{preset}: positions past {BLOCKS_RTOL}: {far}"
