from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from strata_mgpu.cli import main


def test_gen_model_and_info(tmp_path):
    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(main, ["gen-model", str(out), "--preset", "tiny", "--expert-type", "Q5_K", "--seed", "4"])
    assert r.exit_code == 0, r.output
    assert out.exists()
    r = CliRunner().invoke(main, ["info", str(out), "--link-gbps", "50"])
    assert r.exit_code == 0, r.output
    for needle in ("qwen3moe", "experts / used / expert FFN", "8 / 2 / 256", "Q5_K", "Q6_K",
                   "one expert pass at 50 GB/s", "expert bytes in all"):
        assert needle in r.output, needle


def test_gen_model_split(tmp_path):
    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(main, ["gen-model", str(out), "--split-max-size", "2M"])
    assert r.exit_code == 0, r.output
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(shards) > 1
    r = CliRunner().invoke(main, ["info", str(shards[0])])
    assert r.exit_code == 0 and f"in {len(shards)} file(s)" in r.output


def test_gen_model_writes_a_chat_template_given_as_a_file(tmp_path):
    from strata_mgpu.model.gguf_reader import GGUFFile
    from strata_mgpu.model.tokenizer import tokenizer_from_gguf
    from tests.conftest import TEMPLATES

    out, source = tmp_path / "m.gguf", TEMPLATES / "qwen3-coder.jinja"
    r = CliRunner().invoke(main, ["gen-model", str(out), "--chat-template", str(source)])
    assert r.exit_code == 0, r.output
    template = tokenizer_from_gguf(GGUFFile(out)).chat_template
    assert template is not None and template.source == source.read_text("utf-8")
    bad, never = tmp_path / "bad.jinja", tmp_path / "x.gguf"
    bad.write_text("{% for %}")
    r = CliRunner().invoke(main, ["gen-model", str(never), "--chat-template", str(bad)])
    assert r.exit_code == 1 and "chat template does not parse: line 1" in r.output and not never.exists()


def test_bad_arguments_are_one_line_errors(tmp_path):
    r = CliRunner().invoke(main, ["gen-model", str(tmp_path / "x.gguf"), "--expert-type", "Q9"])
    assert r.exit_code == 2 and "unknown tensor type 'Q9'" in r.output
    r = CliRunner().invoke(main, ["info", str(tmp_path / "missing.gguf")])
    assert r.exit_code == 1 and "cannot open" in r.output


def test_info_refuses_an_unknown_device_in_one_line(tiny_gguf):
    r = CliRunner().invoke(main, ["info", str(tiny_gguf), "--max-vram", "8", "--devices", "gpu0"])
    lines = r.stderr.splitlines()
    assert r.exit_code == 1 and lines == ["Error: unknown device 'gpu0' (cpu, cuda, cuda:N or N)"], r.output


def test_info_says_the_kv_pool_the_plan_makes(tiny_gguf):
    r = CliRunner().invoke(main, ["info", str(tiny_gguf), "--max-vram", "8", "--ctx-size", "4096"])
    out = " ".join(r.output.split())
    assert r.exit_code == 0 and "KV pool on cuda:0: 64 blocks of 64 tokens" in out and "--cache-ram" in out, r.output


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "strata_mgpu", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "gen-model" in r.stdout


def test_serve_refuses_bad_placement_before_starting(tiny_gguf):
    import torch

    cases = [(["--devices", "cpu,cpu", "--layer-split", "7"], "stage boundaries must increase"),
             (["--devices", "gpu"], "unknown device 'gpu'"),
             (["--max-vram", "abc"], "--max-vram 'abc'")]
    if not torch.cuda.is_available():
        cases.append((["--devices", "cuda:0"], "torch sees no CUDA device"))
    for args, message in cases:
        r = subprocess.run([sys.executable, "-m", "strata_mgpu", "serve", str(tiny_gguf), "--port", "1", *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, (args, r.stderr)
        assert message in r.stderr, (args, r.stderr)
