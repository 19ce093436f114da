"""tools/serve_probe against a real `strata serve` of the tiny model on the CPU: prompt lengths
exact (token ids), the server's timings read, chats streamed at once with their first tokens."""

from __future__ import annotations

import json
import subprocess
import sys

from strata_mgpu.tools.serve_probe import run_probe
from tests.server_proc import running_server


def test_probe_reads_timings_and_streams_chats(tiny_gguf, tmp_path):
    with running_server([str(tiny_gguf), "--ctx-size", "512"], tmp_path / "serve.log") as base:
        lines: list[str] = []
        result = run_probe(base, [40, 90], max_tokens=6, chats=3, say=lines.append)
        assert [p.prompt_tokens for p in result.prompts] == [40, 90]
        assert all(p.prompt_per_second > 0 and p.predicted_per_second > 0 for p in result.prompts)
        assert len(result.chats) == 3 and all(c.tokens == 6 and c.ttft_s > 0 for c in result.chats)
        # the server's side of each first token, from the last chunk's timings
        assert all(c.prompt_ms > 0 and c.queue_ms >= 0 for c in result.chats)
        assert all(c.ttft_s * 1e3 >= c.prompt_ms for c in result.chats)
        assert result.chats_tok_per_s and result.chats_tok_per_s > 0
        assert len(lines) == 3 and "3 chats at once" in lines[-1]
        out = tmp_path / "probe.json"
        cli = subprocess.run([sys.executable, "-m", "strata_mgpu.tools.serve_probe", base, "--prompt-tokens", "30",
                              "--max-tokens", "3", "--chats", "0", "--json", str(out)],
                             capture_output=True, text=True, timeout=300)
        assert cli.returncode == 0, cli.stderr
        assert json.loads(out.read_text())["prompts"][0]["prompt_tokens"] == 30


def test_probe_says_what_is_wrong_in_one_line(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "strata_mgpu.tools.serve_probe", "http://127.0.0.1:9",
                          "--prompt-tokens", "10"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1
    usage = subprocess.run([sys.executable, "-m", "strata_mgpu.tools.serve_probe", "http://x", "--prompt-tokens",
                            "a"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "--prompt-tokens" in usage.stderr
