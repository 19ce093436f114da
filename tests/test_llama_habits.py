"""A llama.cpp user's command lines: the spellings with the same meaning read as ours, those without
a counterpart refused in one usage error naming the option and what to use (never click's cluster
reading of `-ngl` as `-n`), `--cache-ram` with units (a bare number MiB, as llama-server reads it),
and `--threads` cut to the CPUs the process may use."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu import cli
from strata_mgpu.cli import main
from strata_mgpu.config import ServerConfig
from strata_mgpu.kernels.cpu_experts import clamp_threads, usable_cpus
from strata_mgpu.server import launch


@pytest.fixture()
def served(monkeypatch):
    """`strata serve ARGS` parsed into the config it would serve, nothing started."""
    seen: list[ServerConfig] = []

    def fake_serve(config: ServerConfig) -> int:
        seen.append(config)
        return 0

    monkeypatch.setattr(launch, "serve", fake_serve)

    def run(*args: str) -> tuple[ServerConfig | None, str, int]:
        r = CliRunner().invoke(main, ["serve", *args])
        return (seen.pop() if seen else None), r.output, r.exit_code

    return run


def test_llama_server_spellings_mean_ours(served, tiny_gguf):
    config, output, status = served("-m", str(tiny_gguf), "-c", "1024", "-np", "4", "-ctk", "q8_0", "-ctv", "q8_0",
                                    "-a", "my-model", "--jinja", "-t", "1")
    assert status == 0, output
    assert config is not None and config.model_path == tiny_gguf and config.model_name == "my-model"
    assert config.engine.ctx_size == 1024 and config.engine.max_running == 4
    assert config.placement.kv_types == (Q.Q8_0, Q.Q8_0) and config.placement.threads == 1
    config, output, status = served(f"--model={tiny_gguf}", "--parallel", "2", "--ctx-size=512", "-c256", "-cb",
                                    "-kvu", "--metrics", "-cram", "4096")
    assert status == 0, output
    assert config is not None and config.engine.max_running == 2 and config.engine.ctx_size == 256  # the last wins
    assert config.engine.cache_ram_gib == 4


def test_bench_takes_llama_bench_spellings(tiny_gguf, tmp_path):
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny_gguf), "--devices", "cpu", "-p", "16", "-n", "2", "-r", "1",
                                  "-ctk", "q8_0", "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    assert '"tokens": 16' in (tmp_path / "b.json").read_text() and "2 random tokens" in r.output


@pytest.mark.parametrize("args, points_at", [
    (["-ngl", "99"], "--max-vram"), (["--n-gpu-layers=99"], "--max-vram"), (["--n-cpu-moe", "30"], "--cpu-experts"),
    (["-cmoe"], "--cpu-experts"), (["-ts", "1,1"], "--layer-split"), (["-ub", "512"], "--chunk-size")])
@pytest.mark.parametrize("command", ["serve", "bench"])
def test_options_without_a_counterpart_are_one_usage_error_naming_them(tiny_gguf, command, args, points_at):
    r = CliRunner().invoke(main, [command, str(tiny_gguf), *args])
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    name = args[0].partition("=")[0]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert errors[0].startswith(f"Error: {name}: llama.cpp's option, not strata's: ") and points_at in errors[0]
    assert "No such option" not in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_an_unknown_word_after_one_dash_is_named_whole_not_as_click_s_cluster(tiny_gguf, command):
    r = CliRunner().invoke(main, [command, str(tiny_gguf), "-cnv"])
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert r.exit_code == 2 and errors == ["Error: no such option: -cnv (--help lists the options)"], r.output


def test_an_option_s_value_is_never_read_as_an_option(served, tiny_gguf):
    config, output, status = served(str(tiny_gguf), "--api-key", "-fa", "--alias", "-ngl")
    assert status == 0 and config is not None, output
    assert config.api_key == "-fa" and config.model_name == "-ngl"


def test_a_spelling_after_the_double_dash_is_left_alone(served):
    config, output, status = served("--", "-ngl")
    assert status == 0 and config is not None and str(config.model_path) == "-ngl", output  # a file's name
    _, output, status = served("-m")
    assert status == 2 and "-m needs the model's file" in output


@pytest.mark.parametrize("given, gib", [
    ("8GiB", 8), ("8192MiB", 8), ("8G", 8), ("8192", 8), ("512", 0.5), ("1.5g", 1.5), ("0", 0), ("1024KiB", 2**-10),
    ("2GB", 2e9 / 2**30)])
def test_cache_ram_takes_units_and_a_bare_number_is_mib(served, tiny_gguf, given, gib):
    config, output, status = served(str(tiny_gguf), "--cache-ram", given)
    assert status == 0, output
    assert config is not None and config.engine.cache_ram_gib == pytest.approx(gib)


def test_a_small_bare_cache_ram_says_it_is_mib(served, tiny_gguf, monkeypatch):
    monkeypatch.setattr(cli, "err", cli.Console(stderr=True, width=200))
    config, output, _ = served(str(tiny_gguf), "--cache-ram", "8")
    assert config is not None and config.engine.cache_ram_gib == 8 / 1024
    assert "warning: --cache-ram 8 is 8 MiB (a bare number is MiB, as llama-server reads it); write 8GiB" in output
    _, output, _ = served(str(tiny_gguf), "--cache-ram", "8192")
    assert "warning" not in output


@pytest.mark.parametrize("given", ["8 parsecs", "-1", "GiB", "1e3", "-2"])
def test_a_bad_cache_ram_is_a_usage_error(served, tiny_gguf, given):
    _, output, status = served(str(tiny_gguf), "--cache-ram", given)
    assert status == 2 and "--cache-ram" in output and "a bare number is MiB" in output, output


def test_the_default_cache_ram_is_8_gib(served, tiny_gguf):
    config, _, _ = served(str(tiny_gguf))
    assert config is not None and config.engine.cache_ram_gib == 8


def test_threads_are_cut_to_the_cpus_the_process_may_use(served, tiny_gguf, monkeypatch):
    assert clamp_threads(2, cpus=2) == (2, None)
    threads, warning = clamp_threads(16, cpus=2)
    assert threads == 2 and warning is not None and warning.startswith("--threads 16 is more than the 2 CPUs")
    monkeypatch.setattr(cli, "err", cli.Console(stderr=True, width=200))  # one line, whatever the terminal
    config, output, status = served(str(tiny_gguf), "--threads", str(usable_cpus() + 14))
    assert status == 0 and config is not None and config.placement.threads == usable_cpus()
    assert output.count("warning: --threads") == 1 and f"using {usable_cpus()}" in output
    config, output, _ = served(str(tiny_gguf), "--threads", "1")
    assert config is not None and config.placement.threads == 1 and "warning" not in output
