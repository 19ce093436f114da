"""How well layer i's hidden state predicts layer i+1's experts, and how many picks an LFU residency
of K slots a layer would hold: what a prefetch from the previous layer's router, and the residency's
half-life, would have to go on.

    python3 -m strata_mgpu.tools.router_predict MODEL.gguf [--device cuda:0] [--max-vram 40]
        [--prompts 8] [--tokens 256] [--slots K] [--half-lives 64,256,1024,0]

Each layer's routing is recorded as the model runs the prompts (text from the package's corpus
through the file's tokenizer, or random tokens where it has none): the MoE block's normed input h_i
of layer i goes through layer i+1's router, and its top A (and top 2A) are checked against layer
i+1's own A picks of the same row ("hit": the share of the true picks predicted). The residency
columns replay the rows' picks in order through an LFU of K slots a layer with the half-life given
in rows (0: no decay) and count the picks it held. On synthetic random weights (`strata gen-model`)
the routers are random and unrelated layer to layer: the rates then say nothing of a trained model.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch

from strata_mgpu import env
from strata_mgpu.model.gguf_reader import GGUFError, GGUFFile
from strata_mgpu.model.spec import ModelSpec, spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import Stage, StageOptions

SYNTHETIC_NOTE = ("note: on synthetic random weights (strata gen-model) the routers are random and unrelated layer "
                  "to layer: these rates say nothing of a trained model")


@dataclass
class RouterRecord:
    """Per layer, every row's picks [N, A], and per layer pair, the picks predicted from the layer before
    (top A and top 2A of layer i+1's router over layer i's h)."""

    picks: list[list[torch.Tensor]]
    predicted: list[list[torch.Tensor]]


def record_routing(stage: Stage, prompts: list[torch.Tensor]) -> RouterRecord:
    spec = stage.spec
    model = stage.model
    L, A = len(stage.layers), spec.n_experts_used
    picks: list[list[torch.Tensor]] = [[] for _ in range(L)]
    predicted: list[list[torch.Tensor]] = [[] for _ in range(L)]  # [i]: layer i's picks predicted from i - 1

    def routing(i: int, h: torch.Tensor, router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = model.route(i, h, router)
        picks[i].append(experts.cpu())
        if i + 1 < L:
            nxt = model.w.layers[i + 1].router
            assert nxt is not None, "a stage's layers are MoE layers (check_layers_served)"
            logits = h.float() @ nxt.float().T  # [T, E]: layer i + 1's router over layer i's h
            predicted[i + 1].append(logits.topk(min(2 * A, spec.n_experts), dim=-1).indices.cpu())
        return weights, experts

    model.routing = routing
    try:
        for prompt in prompts:
            stage.prefill(stage.new_sequence(prompt.numel() + 1), prompt)
    finally:
        model.routing = None
    return RouterRecord(picks, predicted)


def hit_rates(record: RouterRecord, n_used: int) -> list[tuple[float, float]]:
    """Per layer i >= 1: the share of its picks in the top A, and in the top 2A, predicted from layer i - 1."""
    out = []
    for i in range(1, len(record.picks)):
        true = torch.cat(record.picks[i])  # [N, A]
        pred = torch.cat(record.predicted[i])  # [N, 2A]
        within = (true[:, :, None] == pred[:, None, :])  # [N, A, 2A]
        top_a = within[:, :, :n_used].any(-1).float().mean().item()
        top_2a = within.any(-1).float().mean().item()
        out.append((top_a, top_2a))
    return out


def lfu_hit_rate(picks: list[torch.Tensor], n_experts: int, slots: int, half_life: float) -> float:
    """Picks [N, A] of one layer replayed row by row through an LFU of `slots` (decayed counts, the
    slots re-chosen every row): the share of picks resident when made."""
    rows = torch.cat(picks).numpy()
    scores = np.zeros(n_experts)
    resident = np.zeros(n_experts, dtype=bool)
    resident[:slots] = True
    factor = 0.5 ** (1 / half_life) if half_life > 0 else 1.0
    held = 0
    for row in rows:
        held += int(resident[row].sum())
        scores *= factor
        np.add.at(scores, row, 1.0)
        resident[:] = False
        resident[np.argsort(-scores, kind="stable")[:slots]] = True
    return held / rows.size if rows.size else 0.0


def corpus_prompts(f: GGUFFile, spec: ModelSpec, n: int, tokens: int, seed: int) -> list[torch.Tensor]:
    """n prompts of `tokens` tokens: the corpus's text through the file's tokenizer, else random ids."""
    try:
        ids = tokenizer_from_gguf(f).encode(resources.files("strata_mgpu").joinpath("data/corpus.txt")
                                            .read_text(encoding="utf-8"), add_special=False)
    except GGUFError:
        ids = []
    if len(ids) >= n * tokens:
        return [torch.tensor(ids[k * tokens:(k + 1) * tokens]) for k in range(n)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, spec.vocab_size, (tokens,), generator=g) for _ in range(n)]


def main() -> None:
    environment = env.read_or_exit()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-vram", type=float, default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--slots", type=int, default=None, help="the LFU's slots a layer (default: half the experts)")
    ap.add_argument("--half-lives", default="64,256,1024,0", help="in rows; 0: no decay")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.prompts < 1 or args.tokens < 1:
        raise SystemExit("error: --prompts and --tokens must be at least 1")
    try:
        half_lives = [float(x) for x in args.half_lives.split(",")]
    except ValueError:
        raise SystemExit(f"error: --half-lives {args.half_lives!r}: numbers separated by commas") from None
    f = GGUFFile(args.model)
    spec = spec_from_gguf(f)
    slots = args.slots if args.slots is not None else spec.n_experts // 2
    if not 0 < slots <= spec.n_experts:
        raise SystemExit(f"error: --slots {slots}: 1 to {spec.n_experts}")
    opts = StageOptions.from_env(environment, device=torch.device(args.device), max_vram_gib=args.max_vram)
    stage = build_stage(f, spec, opts)
    prompts = corpus_prompts(f, spec, args.prompts, args.tokens, args.seed)
    record = record_routing(stage, prompts)
    rates = hit_rates(record, spec.n_experts_used)
    print(SYNTHETIC_NOTE)
    print(f"{len(prompts)} prompts x {args.tokens} tokens, {spec.n_experts} experts, {spec.n_experts_used} a row")
    columns = "  ".join(f"half-life {h:g}" if h else "no decay" for h in half_lives)
    print(f"layer  predicted from the layer before: top A   top 2A   | LFU of {slots} slots: {columns}")
    for i in range(len(stage.layers)):
        pred = f"{100 * rates[i - 1][0]:5.1f}%   {100 * rates[i - 1][1]:5.1f}%" if i else "    -        -  "
        lfu = "  ".join(f"{100 * lfu_hit_rate(record.picks[i], spec.n_experts, slots, h):9.1f}%" for h in half_lives)
        print(f"{i:5d}  {pred:>40}   | {lfu}")
    if rates:
        chance = spec.n_experts_used / spec.n_experts
        print(f"mean   {100 * float(np.mean([r[0] for r in rates])):5.1f}% of layer i+1's picks in layer i's top A, "
              f"{100 * float(np.mean([r[1] for r in rates])):5.1f}% in its top 2A "
              f"(chance: {100 * chance:.1f}% / {200 * chance:.1f}%)")


if __name__ == "__main__":
    main()
