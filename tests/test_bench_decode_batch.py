"""`strata bench --decode-batch` on the CPU with the tiny model: the figures' shape and the KV the
batched steps advance (not speed)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from strata_mgpu.cli import main
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions
from strata_mgpu.tools.bench import decode_batch_kv_tokens, decode_batch_prompts, time_decode_batch


class RecordingRunner:
    """A runner that keeps the sequences it hands out, so a test can read their KV lengths."""

    def __init__(self, runner):
        self.runner = runner
        self.kvs = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def new_sequence(self, max_length: int):
        kv = self.runner.new_sequence(max_length)
        self.kvs.append(kv)
        return kv


@pytest.fixture(scope="module")
def stage(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    return build_stage(f, spec_from_gguf(f), StageOptions(device=torch.device("cpu"), chunk_size=64))


@pytest.mark.parametrize("batch", [1, 3])
def test_batch_decode_advances_every_sequence(stage, batch):
    runner = RecordingRunner(stage)
    total, each = time_decode_batch(runner, batch, n_steps=5, warmup=2, chunk=64)  # 71, 78: two chunks
    assert total > 0 and each > 0 and total == pytest.approx(batch * each)
    prompts = decode_batch_prompts(batch)
    assert len(runner.kvs) == batch and len(set(prompts)) == batch  # each row at its own position
    assert [kv.length for kv in runner.kvs] == [n + 2 + 5 for n in prompts]
    assert decode_batch_kv_tokens(batch, 5, warmup=2) >= sum(kv.length for kv in runner.kvs)


def test_bench_cli_decode_batch_json(tiny_gguf, tmp_path):
    common = ["bench", str(tiny_gguf), "--prompt-tokens", "64", "--decode-tokens", "3", "--runs", "1"]
    r = CliRunner().invoke(main, [*common, "--devices", "cpu,cpu", "--decode-batch", "1,4",
                                  "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "b.json").read_text())
    assert [d["batch"] for d in result["decode_batch"]] == [1, 4]
    for d in result["decode_batch"]:
        assert d["steps"] == 3 and len(d["prompt_tokens"]) == d["batch"]
        assert d["tok_per_s"] > 0 and d["per_seq_tok_s"] > 0
        assert d["tok_per_s"] == pytest.approx(d["batch"] * d["per_seq_tok_s"])
    assert result["decode_tok_per_s"] > 0  # the batch-1 figure is still there
    step_ms = 1e3 / result["decode_tok_per_s"]
    assert 0 < result["decode_host_ms"] <= step_ms  # queuing a step is part of the step (all of it on the CPU)
    assert "decode batch 4:" in r.output and "per sequence" in r.output
    assert "decode host time:" not in r.output  # on the CPU the host's time is the whole step: nothing to say
    r = CliRunner().invoke(main, [*common, "--devices", "cpu", "--json", str(tmp_path / "d.json")])
    assert r.exit_code == 0, r.output  # the default: batch 1 alone, as before
    assert json.loads((tmp_path / "d.json").read_text())["decode_batch"] == [] and "decode batch" not in r.output
    r = CliRunner().invoke(main, [*common, "--devices", "cpu", "--decode-context", "300", "--chunk-size", "128",
                                  "--json", str(tmp_path / "c.json")])
    assert r.exit_code == 0, r.output  # a longer prompt before the decode steps, prefilled in chunks
    assert json.loads((tmp_path / "c.json").read_text())["decode_context"] == 300
    assert "after a 300-token prompt" in r.output


@pytest.mark.parametrize("value", ["0", "1,x", "", "-2", "2.5"])
def test_bad_decode_batch_is_a_usage_error(tiny_gguf, value):
    r = CliRunner().invoke(main, ["bench", str(tiny_gguf), "--devices", "cpu", "--decode-batch", value])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--decode-batch" in errors[0], r.output
