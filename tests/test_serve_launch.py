"""`strata serve` before and after the HTTP server: refusals in one line, warnings, loading bars,
and a clean stop while the model loads."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from rich.console import Console
from rich.progress import Progress

from strata_mgpu.cli import main
from strata_mgpu.config import EngineConfig, LayerSplit, Placement, ServerConfig
from strata_mgpu.engine.build import build_runner
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.progress import layer_bars
from strata_mgpu.server import launch
from strata_mgpu.server.dialects import PARSER_NAMES
from tests.server_proc import free_port

ROOT = Path(__file__).resolve().parents[1]


def serve_process(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata_mgpu", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "NO_COLOR": "1"})


def test_port_in_use_and_unknown_host_are_one_line_errors(tiny_gguf):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = serve_process([str(tiny_gguf), "--devices", "cpu", "--port", str(port)])
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == [f"Error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    r = serve_process([str(tiny_gguf), "--devices", "cpu", "--host", "999.1.1.1"])
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("Error: cannot listen on 999.1.1.1:8080: "), \
        r.stderr


# `strata serve` with each layer's load slowed to SLOW_LAYER_S, as a large model's would be
SLOW_LAYER_S = 3
SLOW_SERVE = f"""
import sys, time
import strata_mgpu.model.runner as model_runner

load_weights = model_runner.load_weights

def slow_load_weights(*args, on_layer, **kw):
    def layer_done(i):
        time.sleep({SLOW_LAYER_S})
        on_layer(i)
    return load_weights(*args, on_layer=layer_done, **kw)

model_runner.load_weights = slow_load_weights
import strata_mgpu.stage.build as stage_build  # `--devices cpu` serves a CPU stage where ggml-python is there

stage_build.load_weights = slow_load_weights
from strata_mgpu.cli import main
sys.exit(main())
"""


def start_serve(args: list[str], log: Path, until: str) -> subprocess.Popen:
    """`python ARGS` with its output in `log`, once `until` shows there (killed if it never does)."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "NO_COLOR": "1"})
    deadline = time.monotonic() + 120
    while until not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(log.read_text())
        time.sleep(0.1)
    return proc


def test_ctrl_c_while_loading_stops_the_loader_and_exits_130(tiny_gguf, tmp_path):
    """The loader gives up at its next layer and the process exits cleanly (it used to abort in
    torch: "terminate called without an active exception", status 134)."""
    log = tmp_path / "serve.log"
    proc = start_serve(["-c", SLOW_SERVE, "serve", str(tiny_gguf), "--devices", "cpu", "--port", str(free_port())],
                       log, until="serving")
    try:
        proc.send_signal(signal.SIGINT)  # within the first of the tiny model's 4 layers
        t_signal = time.monotonic()
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert status == 130, text
    assert "stopped: the server is shutting down" in text and "ready" not in text, text
    assert "Traceback" not in text and "terminate called" not in text, text
    # stopped after the layer in hand, not after all 4 (the whole load takes 4 * SLOW_LAYER_S)
    assert time.monotonic() - t_signal < 3 * SLOW_LAYER_S, text


# `strata serve` with a Ctrl+C arriving after the server said it serves, before uvicorn has put its
# own signal handlers in place (the window a Ctrl+C right at start-up falls into)
EARLY_SIGNAL_SERVE = """
import signal, sys
import uvicorn

run = uvicorn.Server.run

def run_after_a_stop_signal(self, *args, **kwargs):
    signal.raise_signal(signal.SIGINT)
    return run(self, *args, **kwargs)

uvicorn.Server.run = run_after_a_stop_signal
from strata_mgpu.cli import main
sys.exit(main())
"""


def test_ctrl_c_before_uvicorn_takes_over_still_stops_it(tiny_gguf, tmp_path):
    """The signal is the server's to pass on until uvicorn has its handlers: it exits at once, 130
    (it used to be noted and then lost: the server went on serving)."""
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", EARLY_SIGNAL_SERVE, "serve", str(tiny_gguf), "--devices", "cpu",
                                 "--port", str(free_port())], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "NO_COLOR": "1"})
    try:
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert status == 130 and "Traceback" not in text, text


def test_ctrl_c_while_serving_exits_130_without_a_traceback(tiny_gguf, tmp_path):
    """Once the model is ready, Ctrl+C shuts uvicorn down, which raises the signals it caught again
    from its event loop as it ends; that must end the process quietly (with Ctrl+C pressed twice
    it printed a traceback of the torn-down loop)."""
    log, port = tmp_path / "serve.log", free_port()
    proc = start_serve(["-m", "strata_mgpu", "serve", str(tiny_gguf), "--devices", "cpu", "--port", str(port)], log,
                       until="ready")
    try:
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                            timeout=60)
        assert answer.status_code == 200  # a request served first, as a user's session would
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)  # impatient users press it twice: uvicorn raises both again
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert status == 130 and "Traceback" not in text and "CancelledError" not in text, text


@pytest.mark.parametrize("args, message", [
    (["--api-key", ""], "--api-key '': give a non-empty key"),
    (["--api-key", " key"], "without spaces around it"),
    (["--layer-split", "999"], "--layer-split '999' needs several devices"),
    (["--layer-split", "-3"], "increasing from 1"),
    (["--layer-split", "foo"], "expected 'auto' or layer numbers"),
    (["--devices", "cpu,cpu", "--layer-split", "2,1"], "increasing from 1"),
])
def test_serve_refuses_in_one_line_before_serving(tiny_gguf, monkeypatch, args, message):
    served = []
    monkeypatch.setattr(launch, "serve", lambda config: served.append(config) or 0)
    r = CliRunner().invoke(main, ["serve", str(tiny_gguf), *args])
    lines = r.stderr.splitlines()
    assert r.exit_code == 1 and not served, r.output
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], r.stderr


def test_placement_accepts_a_split_only_across_devices():
    assert Placement(devices=("cpu",), layer_split=LayerSplit.parse(" Auto ")).layer_split.auto
    assert Placement(devices=("0", "1", "2"), layer_split=LayerSplit.parse("16,32")).layer_split.starts == (16, 32)
    with pytest.raises(ValueError, match="needs several devices"):
        Placement(devices=("auto",), layer_split=LayerSplit((24,)))
    with pytest.raises(ValueError, match="makes 2 stages, but 3 devices"):
        Placement(devices=("0", "1", "2"), layer_split=LayerSplit((24,)))


def test_warnings_for_a_context_beyond_the_model_and_a_vram_cap_on_the_cpu(tiny_gguf):
    spec = spec_from_gguf(GGUFFile(tiny_gguf))
    config = ServerConfig(model_path=tiny_gguf, engine=EngineConfig(ctx_size=100_000),
                          placement=Placement(devices=("cpu", "cpu"), max_vram_gib=(4.0,)))
    assert launch.config_warnings(config, spec) == [
        f"--ctx-size 100000 is more than the model's context of {spec.context_length} tokens: sequences get "
        f"{spec.context_length}",
        "--max-vram 4,4 is ignored on the CPU: it caps GPU memory only"]
    fits = ServerConfig(model_path=tiny_gguf, engine=EngineConfig(ctx_size=spec.context_length),
                        placement=Placement(devices=("cpu",)))
    assert launch.config_warnings(fits, spec) == []


def test_loading_bars_of_a_second_stage_end_at_their_own_total(tiny_gguf):
    """Stage 2 of a split reports its layers by global index (3/2, 4/2 for layers 2-3): each bar
    must still count 1..its own total."""
    f = GGUFFile(tiny_gguf)
    with Progress(console=Console(file=io.StringIO())) as bar:
        build_runner(f, spec_from_gguf(f), Placement(devices=("cpu", "cpu"), layer_split=LayerSplit((2,))), 16,
                     on_progress=layer_bars(bar))
        shown = {t.description: (t.completed, t.total) for t in bar.tasks}
    assert shown == {f"{what} {layers} on cpu": (2, 2) for what in ("dense weights", "experts")
                     for layers in ("0-1", "2-3")}


def test_serve_takes_the_tool_call_parser_and_the_lenient_schemas(tiny_gguf, monkeypatch):
    served = []
    monkeypatch.setattr(launch, "serve", lambda config: served.append(config) or 0)
    r = CliRunner().invoke(main, ["serve", str(tiny_gguf), "--tool-call-parser", "qwen3_coder",
                                  "--lenient-json-schema"])
    assert r.exit_code == 0, r.output
    (config,) = served
    assert config.tool_call_parser == "qwen3_coder" and config.lenient_json_schema
    r = CliRunner().invoke(main, ["serve", str(tiny_gguf)])
    assert served[-1].tool_call_parser == "auto" and not served[-1].lenient_json_schema
    r = CliRunner().invoke(main, ["serve", str(tiny_gguf), "--tool-call-parser", "mistral"])
    assert r.exit_code == 2 and ", ".join(map(repr, PARSER_NAMES)) in r.stderr  # the CLI names every dialect
