"""Every STRATA_* variable read once at start-up (`env.read`): typed values and defaults, one-line
EnvErrors naming the variable, every command of the CLI refusing a bad value before it does
anything (whatever the device), and the runtime following the values it is given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from strata_mgpu import env
from strata_mgpu.cli import main
from strata_mgpu.config import AUTO_SPLIT, LayerSplit, Placement

CPU = torch.device("cpu")


def test_defaults_are_the_variables_own():
    got = env.read({})
    assert got == env.EnvOptions()
    assert (got.log_level, got.prefill_help, got.prefill_help_frac, got.help_halves, got.kv_prefetch,
            got.stage_threads, got.decode_graph_batch, got.cache_dir) == ("INFO", True, "auto", 0, True, True, 8, None)
    assert {var.default for var in env.ALL} == {None, "INFO", "1", "auto", "0", "8", "512", "4", "fla"}
    assert env.read({var.name: "" for var in env.ALL}) == got  # empty is unset


@pytest.mark.parametrize("name,raw,field,want", [
    ("STRATA_STAGE_THREADS", "0", "stage_threads", False),
    ("STRATA_STAGE_THREADS", "1", "stage_threads", True),
    ("STRATA_KV_PREFETCH", "0", "kv_prefetch", False),
    ("STRATA_KV_PREFETCH", " 1 ", "kv_prefetch", True),
    ("STRATA_DECODE_GRAPH_BATCH", "1", "decode_graph_batch", 1),
    ("STRATA_DECODE_GRAPH_BATCH", " 16 ", "decode_graph_batch", 16),
    ("STRATA_HELP_HALVES", " 6144 ", "help_halves", 6144),
    ("STRATA_PREFILL_HELP", "off", "prefill_help", False),
    ("STRATA_PREFILL_HELP_FRAC", " Rule ", "prefill_help_frac", "rule"),
    ("STRATA_PREFILL_HELP_FRAC", "0.35", "prefill_help_frac", 0.35),
    ("STRATA_DELTA_SCAN", " Torch ", "delta_scan", "torch"),
    ("STRATA_LOG_LEVEL", "debug", "log_level", "DEBUG"),
    ("STRATA_CACHE_DIR", "/tmp/strata-cache", "cache_dir", Path("/tmp/strata-cache")),
    ("STRATA_DENSE_BLOCKS", "0", "dense_blocks", False),
    ("STRATA_DENSE_BLOCKS", " 1", "dense_blocks", True),
    ("STRATA_ADAPT_THREADS", "0", "adapt_threads", False),
    ("STRATA_GATHER_ROWS", " Auto ", "gather_rows", None),
    ("STRATA_GATHER_ROWS", "24", "gather_rows", 24),
    ("STRATA_RESIDENCY_HALF_LIFE", "2048", "residency_half_life", 2048),
    ("STRATA_RESIDENCY_SWAPS", "0", "residency_swaps", 0),
])
def test_values(name, raw, field, want):
    assert getattr(env.read({name: raw}), field) == want


@pytest.mark.parametrize("name,raw,message", [
    ("STRATA_STAGE_THREADS", "yes", "expected 0 or 1"),
    ("STRATA_KV_PREFETCH", "maybe", "expected 0 or 1"),
    ("STRATA_KV_PREFETCH", "2", "expected 0 or 1"),
    ("STRATA_KV_PREFETCH", "on", "expected 0 or 1"),
    ("STRATA_DELTA_SCAN", "triton", "expected fla or torch"),
    ("STRATA_DECODE_GRAPH_BATCH", "0", "from 1 to 64"),
    ("STRATA_DECODE_GRAPH_BATCH", "65", "from 1 to 64"),
    ("STRATA_DECODE_GRAPH_BATCH", "8.5", "from 1 to 64"),
    ("STRATA_DECODE_GRAPH_BATCH", "\u00b2", "from 1 to 64"),  # a digit to isdigit, not to int
    ("STRATA_HELP_HALVES", "4k", "whole number of tokens"),
    ("STRATA_HELP_HALVES", "-1", "whole number of tokens"),
    ("STRATA_HELP_HALVES", "\u00b2", "whole number of tokens"),
    ("STRATA_PREFILL_HELP", "sometimes", "expected 0 or 1"),
    ("STRATA_DENSE_BLOCKS", "yes", "expected 0 or 1"),
    ("STRATA_ADAPT_THREADS", "2", "expected 0 or 1"),
    ("STRATA_PREFILL_HELP_FRAC", "fast", "expected auto, rule or a number"),
    ("STRATA_LOG_LEVEL", "LOUD", "expected DEBUG, INFO"),
    ("STRATA_GATHER_ROWS", "0", "auto or a whole number of rows"),
    ("STRATA_GATHER_ROWS", "many", "auto or a whole number of rows"),
    ("STRATA_RESIDENCY_HALF_LIFE", "0", "decode steps, at least 1"),
    ("STRATA_RESIDENCY_SWAPS", "-1", "whole number of experts"),
])
def test_bad_values_are_one_line_errors(name, raw, message):
    with pytest.raises(env.EnvError, match=f"{name}=.*{message}") as e:
        env.read({name: raw})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("command", [["serve"], ["topo"], ["gen-model", "x.gguf"], ["info", "x.gguf"],
                                     ["bench", "x.gguf"], ["sweep", "x.gguf"]])
def test_every_command_refuses_a_bad_value_at_once(tmp_path, monkeypatch, command):
    """Before anything is read, written or loaded: `serve` would otherwise serve on the CPU, where
    nothing reads STRATA_KV_PREFETCH."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, command, env={"STRATA_KV_PREFETCH": "maybe"})
    assert not os.listdir(tmp_path)  # gen-model wrote nothing
    lines = r.stderr.splitlines()
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert lines[0] == "Error: STRATA_KV_PREFETCH='maybe': expected 0 or 1"


def test_placement_takes_the_environment_and_the_flags_win():
    environment = env.read({"STRATA_PREFILL_HELP": "0", "STRATA_PREFILL_HELP_FRAC": "rule", "STRATA_HELP_HALVES": "64",
                            "STRATA_KV_PREFETCH": "0", "STRATA_STAGE_THREADS": "0",
                            "STRATA_DECODE_GRAPH_BATCH": "4"})
    p = Placement.from_env(environment, devices=("cpu",))
    assert (p.prefill_help, p.prefill_help_frac, p.help_halves, p.kv_prefetch, p.stage_threads,
            p.decode_graph_batch) == (False, "rule", 64, False, False, 4)
    flagged = Placement.from_env(environment, prefill_help=True, prefill_help_frac="0.3")
    assert (flagged.prefill_help, flagged.prefill_help_frac) == (True, 0.3)
    with pytest.raises(env.EnvError, match="--prefill-help-frac='never'"):
        Placement.from_env(environment, prefill_help_frac="never")


def test_the_runtime_follows_the_placement(tiny_gguf):
    """A split's helpers take the placement's halves; its stages its prefetch and graph batch."""
    from strata_mgpu.engine.build import build_runner
    from strata_mgpu.model.gguf_reader import GGUFFile
    from strata_mgpu.model.spec import spec_from_gguf

    f = GGUFFile(tiny_gguf)
    placement = Placement.from_env(env.read({"STRATA_HELP_HALVES": "4096", "STRATA_KV_PREFETCH": "0",
                                             "STRATA_DECODE_GRAPH_BATCH": "2"}), devices=("cpu", "cpu"))
    runner = build_runner(f, spec_from_gguf(f), placement, 64, kv_tokens=256)
    assert [h.halves_from for h in runner.helpers] == [4096, 4096]
    assert [s.options.switches.kv_prefetch for s in runner.stages] == [False, False]
    assert [s.options.switches.decode_graph_batch for s in runner.stages] == [2, 2]


def test_cpu_stages_run_inline_whatever_the_switch(tiny_gguf):
    """Threads only where the work is queued asynchronously (CUDA); CPU work runs as it is given."""
    from strata_mgpu.model.gguf_reader import GGUFFile
    from strata_mgpu.model.spec import spec_from_gguf
    from strata_mgpu.split.runner import build_split
    from strata_mgpu.stage.stage import StageOptions

    f = GGUFFile(tiny_gguf)
    cpu = StageOptions(device=CPU, chunk_size=64)
    assert not build_split(f, spec_from_gguf(f), [cpu, cpu], LayerSplit((2,)), stage_threads=True).workers.threaded
    assert not build_split(f, spec_from_gguf(f), [cpu, cpu], AUTO_SPLIT, stage_threads=False).workers.threaded


def test_allocator_default_keeps_a_user_setting(monkeypatch):
    monkeypatch.delenv(env.ALLOC_CONF, raising=False)
    env.default_allocator_config()
    assert os.environ[env.ALLOC_CONF] == "expandable_segments:True"
    monkeypatch.setenv(env.ALLOC_CONF, "max_split_size_mb:128")
    env.default_allocator_config()
    assert os.environ[env.ALLOC_CONF] == "max_split_size_mb:128"


def test_nothing_else_reads_the_environment():
    """env.py is the one reader of STRATA_* variables in the package."""
    package = Path(env.__file__).parent
    readers = [p.relative_to(package).as_posix() for p in package.rglob("*.py")
               if p.name != "env.py" and ("os.environ" in p.read_text() or "os.getenv" in p.read_text())]
    assert readers == []


def test_a_tool_building_its_own_stage_takes_the_environment_too(monkeypatch):
    """`StageOptions.from_env` carries the switches into a stage a tool builds itself; a tool's
    main refuses a bad value in one line (`env.read_or_exit`), before it opens the model."""
    import subprocess
    import sys

    from strata_mgpu.stage.stage import StageOptions

    opts = StageOptions.from_env(env.read({"STRATA_DECODE_GRAPH_BATCH": "2", "STRATA_KV_PREFETCH": "0"}), device=CPU)
    assert (opts.switches.decode_graph_batch, opts.switches.kv_prefetch, opts.device) == (2, False, CPU)
    r = subprocess.run([sys.executable, "-m", "strata_mgpu.tools.profile_decode", "missing.gguf"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "STRATA_DECODE_GRAPH_BATCH": "0"})
    assert r.returncode == 1
    assert r.stderr.strip() == "error: STRATA_DECODE_GRAPH_BATCH='0': expected a whole number from 1 to 64"


def test_torch_s_openmp_threads_spin_a_bounded_while_unless_the_user_chose(monkeypatch):
    """Set as the package is imported, before torch loads libgomp (which reads them once); a user's
    OMP_WAIT_POLICY or GOMP_SPINCOUNT leaves both as the user has them."""
    import subprocess
    import sys

    code = "import os, strata_mgpu, torch; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    for given, want in (({}, f"ACTIVE {env.OMP_SPINS}"), ({env.OMP_WAIT: "PASSIVE"}, "PASSIVE None"),
                        ({env.OMP_SPIN: "0"}, "None 0")):
        environ = {k: v for k, v in os.environ.items() if k not in (env.OMP_WAIT, env.OMP_SPIN)}
        out = subprocess.run([sys.executable, "-c", code], env={**environ, **given}, capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == want
