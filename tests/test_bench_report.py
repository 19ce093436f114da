"""What `strata bench` prints: on a CPU only what applies there (no link, no VRAM), a prefill table
whose headers wrap between words at 80 columns, and prompts cut to the model's context, said once."""

from __future__ import annotations

import json

from click.testing import CliRunner
from rich.console import Console

from strata_mgpu import report
from strata_mgpu.cli import main
from strata_mgpu.tools.bench import (
    BenchResult,
    CpuExpertRate,
    CpuExpertsResult,
    PrefillResult,
    StageResult,
    prompts_within,
)

PLAN = [("dense weights", 2_000_000), ("KV pool (4,097 tokens)", 16_000_000)]


def prefill(tokens: int, streamed: int, link: bool) -> PrefillResult:
    seconds = tokens / 20_000
    return PrefillResult(tokens=tokens, seconds=seconds, tok_per_s=tokens / seconds, expert_gb_per_s=1.0,
                         streamed_bytes=streamed, link_bound_s=0.17 if link else None,
                         compute_s=0.3 if streamed else None,
                         bound_s=0.3 if link else None, ratio_to_bound=0.95 if link else None,
                         all_streamed_bound_s=0.34 if link else None)


def result(device: str, link_gb_per_s: float | None, pass_bytes: int) -> BenchResult:
    return BenchResult(
        device=device, model="m.gguf", expert_bytes=18_800_000_000, link_gb_per_s=link_gb_per_s,
        prefill=[prefill(n, pass_bytes, link_gb_per_s is not None) for n in (1024, 32_768)], decode_tokens=64,
        decode_tok_per_s=150.0, decode_resident_share=0.5 if pass_bytes else None,
        decode_hit_rate=0.6 if pass_bytes else None, peak_vram_gb=15.0 if link_gb_per_s else None,
        peak_vram_allocated_gb=None, kernels="torch", decode_host_ms=1.0,
        stages=[StageResult(index=0, device=device, layers="0-47", expert_bytes=18_800_000_000, resident_share=0.5,
                            pass_bytes=pass_bytes, plan=PLAN, busy_s=None)],
        cpu_experts=[] if pass_bytes else [CpuExpertsResult(0, "ggml on 2 threads", [
            CpuExpertRate(rows=1, calls=10, gb_per_s=5.0, ms_per_call=0.05),
            CpuExpertRate(rows=8192, calls=4, gb_per_s=0.049, ms_per_call=83.0)])])


def printed(r: BenchResult, width: int = 80) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    for line in report.bench_lines(r, 8192, None):
        console.print(line)
    return console.export_text()


def test_a_cpu_run_shows_only_what_applies_there():
    text = printed(result("cpu", None, 0))
    for gone in ("n/a", "VRAM", "streamed", "bound", "compute s", "H2D", "decode host time", "0.0 GB/s"):
        assert gone not in text, (gone, text)
    assert "memory plan (host RAM): dense weights" in text and "8,192 rows 0.049 GB/s" in text
    header = [line.split() for line in text.splitlines() if "tok/s" in line and "prefill" in line]
    assert header == [["prompt", "tokens", "prefill", "tok/s", "seconds"]], text


def test_a_gpu_run_s_eight_columns_fit_80_characters_with_whole_words():
    text = printed(result("cuda:0", 55.0, 9_500_000_000))
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text, text
    words = " ".join(text.split())
    for header in ("prompt", "tokens", "prefill", "tok/s", "seconds", "streamed", "link", "bound", "compute",
                   "ratio", "all"):
        assert f" {header} " in f" {words} ", (header, text)
    assert "32,768" in text and "VRAM plan: dense weights" in text and "pinned H2D 55.0 GB/s" in text


def test_prompts_are_cut_to_the_context():
    assert prompts_within([1024, 2048], 4096) == ([1024, 2048], None)
    lengths, warning = prompts_within([1024, 4096, 8192, 16384], 4096)
    assert lengths == [1024, 4096] and warning == ("--prompt-tokens 8192,16384: more than the model's context of "
                                                   "4,096 tokens; benched at 4,096")


def test_bench_on_the_cpu_says_it_cut_a_prompt(tiny_gguf, tmp_path):
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--devices", "cpu", "--prompt-tokens", "16,5000",
                                  "--decode-tokens", "0", "--runs", "1", "--json", str(tmp_path / "b.json")],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert r.output.count("warning: --prompt-tokens 5000: more than the model's context of 4,096 tokens") == 1
    assert [p["tokens"] for p in json.loads((tmp_path / "b.json").read_text())["prefill"]] == [16, 4096]
