"""The bf16 stage against the fp32 reference on shared routing (tests/test_gpu.py's
test_stage_bf16_matches_reference_on_shared_routing) over 12 prompts: each prompt's error and its
4 decode steps' (max|diff| / max|ref|), what BF16_TOL and BF16_Q8_TOL there are set from. Needs
CUDA; run from the repository root: python3 scripts/bf16_err_probe.py
"""

import sys

import torch

sys.path.insert(0, ".")

from strata_mgpu import env  # noqa: E402
from strata_mgpu.model.gguf_reader import GGUFFile  # noqa: E402
from strata_mgpu.model.runner import load_reference_runner  # noqa: E402
from strata_mgpu.model.spec import spec_from_gguf  # noqa: E402
from strata_mgpu.model.synthetic import write_model  # noqa: E402
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions  # noqa: E402
from tests.test_gpu import CUDA, _seg, _share_routing, rel_err  # noqa: E402

write_model("/tmp/small.gguf", "small", seed=3)  # the test's model
f = GGUFFile("/tmp/small.gguf")
spec = spec_from_gguf(f)
ref = load_reference_runner(f, spec)
environment = env.read_or_exit()
stage = build_stage(f, spec, StageOptions.from_env(environment, device=CUDA, max_vram_gib=8, cuda_graphs=False))
_share_routing(stage, ref)
n = stage.experts.gather_picks // spec.n_experts_used + 8
print("seed  prompt  decode steps 1-4")
for seed in range(12):
    prompt = torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    kv_r, kv_s = ref.new_sequence(n + 44), stage.new_sequence(n + 44)
    b = stage.model.logits(stage.model.forward(prompt.to(CUDA), [_seg(kv_s, n)]))
    a = ref.model.logits(ref.model.forward(prompt, [_seg(kv_r, n)]))
    errs = [rel_err(b.cpu(), a)]
    for _ in range(4):
        token = torch.tensor([int(a[-1].argmax())])
        b = stage.decode([kv_s], token)
        a = ref.decode([kv_r], token)
        errs.append(rel_err(b.cpu(), a))
    print(seed, " ".join(f"{e:.4f}" for e in errs), flush=True)
