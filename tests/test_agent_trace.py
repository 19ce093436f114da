"""tools/agent_trace against a real `strata serve` of the tiny model on the CPU: every turn after
the first takes the conversation so far from the prefix cache and computes about its new tokens;
concurrent sessions too (theirs sent at once: both compute the system prompt, as nothing is cached
before a prompt has been computed); the same trace with the cache off computes it all."""

from __future__ import annotations

import json
import subprocess
import sys

from strata_mgpu.tools.agent_trace import run_trace
from tests.server_proc import running_server


def test_each_turn_computes_what_is_new(tiny_gguf, tmp_path):
    with running_server([str(tiny_gguf), "--ctx-size", "2048"], tmp_path / "serve.log") as base:
        lines: list[str] = []
        result = run_trace(base, [1, 2], turns=3, system_tokens=200, turn_tokens=60, answer_tokens=8, say=lines.append)
        assert [r.concurrent for r in result.runs] == [1, 2]
        for run in result.runs:
            for s in run.sessions:
                assert [t.answer_tokens for t in s.turns] == [8, 8, 8]
                for k, t in enumerate(s.turns):
                    assert t.cached_tokens + t.computed_tokens == t.prompt_tokens
                    if k:  # the last turn's prompt and answer, less what ends past its last full block
                        seen = s.turns[k - 1].prompt_tokens + 8
                        assert seen - 64 - 8 <= t.cached_tokens <= seen, (k, t, seen)
        assert "turns 2+" in lines[-2] and "KV pool" in lines[-1]
        # the pool read from /metrics: the cached conversations' blocks stay in use after the run
        assert all(r.pool is not None and r.pool.used_blocks > 0 and r.pool.preemptions == 0 for r in result.runs)
        out = tmp_path / "trace.json"
        cli = subprocess.run([sys.executable, "-m", "strata_mgpu.tools.agent_trace", base, "--sessions", "1",
                              "--turns", "2", "--system-tokens", "50", "--turn-tokens", "20", "--answer-tokens", "4",
                              "--json", str(out)], capture_output=True, text=True, timeout=300)
        assert cli.returncode == 0, cli.stderr
        assert len(json.loads(out.read_text())["runs"][0]["sessions"][0]["turns"]) == 2


def test_without_the_cache_every_turn_is_computed_whole(tiny_gguf, tmp_path):
    with running_server([str(tiny_gguf), "--ctx-size", "2048", "--no-prefix-cache"], tmp_path / "serve.log") as base:
        result = run_trace(base, [1], turns=2, system_tokens=100, turn_tokens=30, answer_tokens=4, say=lambda _: None)
        turns = result.runs[0].sessions[0].turns
        assert all(t.cached_tokens == 0 and t.computed_tokens == t.prompt_tokens for t in turns)
