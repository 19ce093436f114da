"""STRATA_STAGE_THREADS (0 or 1, default 1), STRATA_DECODE_GRAPH_BATCH (1..64, default 8),
STRATA_HELP_HALVES (tokens, default 0: off) and the allocator default: typed values, one-line
EnvErrors, listed in env.ALL, and the split's threads and helpers following the variables."""

from __future__ import annotations

import pytest
import torch

from strata_mgpu import env


@pytest.mark.parametrize("raw,want", [(None, True), ("", True), ("0", False), ("1", True)])
def test_stage_threads_values(set_env, raw, want):
    set_env("STRATA_STAGE_THREADS", raw)
    assert env.stage_threads() is want


@pytest.mark.parametrize("name,fn,raw,message", [
    ("STRATA_STAGE_THREADS", env.stage_threads, "yes", "expected 0 or 1"),
    ("STRATA_DECODE_GRAPH_BATCH", env.decode_graph_batch, "0", "from 1 to 64"),
    ("STRATA_DECODE_GRAPH_BATCH", env.decode_graph_batch, "65", "from 1 to 64"),
    ("STRATA_DECODE_GRAPH_BATCH", env.decode_graph_batch, "8.5", "from 1 to 64"),
    ("STRATA_HELP_HALVES", env.help_halves, "4k", "whole number of tokens"),
    ("STRATA_HELP_HALVES", env.help_halves, "-1", "whole number of tokens"),
    ("STRATA_HELP_HALVES", env.help_halves, "\u00b2", "whole number of tokens"),  # a digit to isdigit, not to int
    ("STRATA_DECODE_GRAPH_BATCH", env.decode_graph_batch, "\u00b2", "from 1 to 64"),
])
def test_bad_values_are_one_line_errors(monkeypatch, name, fn, raw, message):
    monkeypatch.setenv(name, raw)
    with pytest.raises(env.EnvError, match=f"{name}=.*{message}") as e:
        fn()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("raw,want", [(None, 8), ("1", 1), (" 16 ", 16)])
def test_decode_graph_batch_values(set_env, raw, want):
    set_env("STRATA_DECODE_GRAPH_BATCH", raw)
    assert env.decode_graph_batch() == want


@pytest.mark.parametrize("raw,want", [(None, 0), ("0", 0), (" 6144 ", 6144)])
def test_help_halves_values(set_env, raw, want):
    set_env("STRATA_HELP_HALVES", raw)
    assert env.help_halves() == want


def test_split_helpers_take_help_halves_from_the_environment(set_env, tiny_gguf):
    from strata_mgpu.model.gguf_reader import GGUFFile
    from strata_mgpu.model.spec import spec_from_gguf
    from strata_mgpu.split.help_rule import HelpPolicy
    from strata_mgpu.split.runner import build_split
    from strata_mgpu.stage.stage import StageOptions

    set_env("STRATA_HELP_HALVES", "4096")
    f = GGUFFile(tiny_gguf)
    cpu = StageOptions(device=torch.device("cpu"), chunk_size=64)
    runner = build_split(f, spec_from_gguf(f), [cpu, cpu], "auto", help_policy=HelpPolicy())
    assert [h.halves_from for h in runner.helpers] == [4096, 4096]


def test_listed():
    assert {env.STAGE_THREADS, env.DECODE_GRAPH_BATCH, env.HELP_HALVES} <= set(env.ALL)


def test_allocator_default_keeps_a_user_setting(monkeypatch):
    monkeypatch.delenv(env.ALLOC_CONF, raising=False)
    env.default_allocator_config()
    import os

    assert os.environ[env.ALLOC_CONF] == "expandable_segments:True"
    monkeypatch.setenv(env.ALLOC_CONF, "max_split_size_mb:128")
    env.default_allocator_config()
    assert os.environ[env.ALLOC_CONF] == "max_split_size_mb:128"


def test_cpu_stages_run_inline_whatever_the_variable(monkeypatch, tiny_gguf):
    """Threads only where the work is queued asynchronously (CUDA); CPU work runs as it is given."""
    from strata_mgpu.model.gguf_reader import GGUFFile
    from strata_mgpu.model.spec import spec_from_gguf
    from strata_mgpu.split.runner import build_split
    from strata_mgpu.stage.stage import StageOptions

    monkeypatch.setenv("STRATA_STAGE_THREADS", "1")
    f = GGUFFile(tiny_gguf)
    cpu = StageOptions(device=torch.device("cpu"), chunk_size=64)
    assert not build_split(f, spec_from_gguf(f), [cpu, cpu], "2").workers.threaded
    monkeypatch.setenv("STRATA_STAGE_THREADS", "bad")
    with pytest.raises(env.EnvError):
        build_split(f, spec_from_gguf(f), [cpu, cpu], "2")
