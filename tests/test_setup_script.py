"""scripts/setup.sh, the command a new user runs first, against a stand-in virtual environment whose
`python` records what it is asked: `strata serve`'s set-up installs ggml's CPU kernels (and says the
build takes a minute), `--dev` the test tools as CI has them, a second run installs nothing, and a
machine that cannot build ggml still gets the project to serve, told why it will be slower (and the
tests' set-up fails there)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None,
                                reason="setup.sh takes another path where there is an NVIDIA GPU")

# `python` of the stand-in .venv: torch is there (a CPU build), ggml only once "installed", and pip
# records its arguments (failing for the extras with ggml-python where FAKE_GGML_FAILS is set)
FAKE_PYTHON = r"""#!/usr/bin/env bash
here="$(dirname "$0")"
case "$*" in
    "-c import torch") exit 0 ;;
    "-c import ggml") [[ -e "$here/ggml-installed" ]] ;;
    "-m pip install"*)
        echo "$*" >> "$here/pip.log"
        if [[ ( "$*" == *cpu-experts* || "$*" == *"[dev]"* ) && -n "${FAKE_GGML_FAILS:-}" ]]; then exit 1; fi
        if [[ "$*" == *cpu-experts* || "$*" == *"[dev]"* ]]; then touch "$here/ggml-installed"; fi ;;
    *) echo "unexpected: python $*" >&2; exit 3 ;;
esac
"""


@pytest.fixture()
def checkout(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    return tmp_path


def setup(checkout: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    r = subprocess.run(["bash", str(checkout / "scripts" / "setup.sh"), *args], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=60)
    log = checkout / ".venv" / "bin" / "pip.log"
    installs = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return r, installs


def test_serve_s_set_up_installs_ggml_s_kernels_once_and_says_it_builds(checkout):
    r, installs = setup(checkout, "echo", "serving")
    assert r.returncode == 0 and r.stdout == "serving\n", r.stderr
    assert installs == ["-m pip install -q -e .[cpu-experts]"]
    assert "ggml-python builds ggml from source, about a minute" in r.stderr
    r, installs = setup(checkout, "true")
    assert r.returncode == 0 and installs == [] and r.stderr == "", r.stderr  # nothing changed: starts at once


def test_the_dev_set_up_is_ci_s_and_covers_serve(checkout):
    r, installs = setup(checkout, "--dev", "true")
    assert r.returncode == 0 and installs == ["-m pip install -q -e .[dev]"], r.stderr
    r, installs = setup(checkout, "true")
    assert r.returncode == 0 and installs == [], r.stderr  # ggml-python came with the test tools
    (checkout / "pyproject.toml").write_text((checkout / "pyproject.toml").read_text() + "\n")
    r, installs = setup(checkout, "--dev", "true")
    assert installs == ["-m pip install -q -e .[dev]"]  # pyproject.toml changed: installed again
    assert "about a minute" not in r.stderr  # ggml is built already


def test_a_machine_that_cannot_build_ggml_still_gets_the_project(checkout):
    r, installs = setup(checkout, "true", FAKE_GGML_FAILS="1")
    assert r.returncode == 0, r.stderr
    assert installs == ["-m pip install -q -e .[cpu-experts]", "-m pip install -q -e ."]
    assert "ggml could not be built" in r.stderr and "slower" in r.stderr
    r, installs = setup(checkout, "--dev", "true", FAKE_GGML_FAILS="1")
    assert r.returncode == 1 and installs == ["-m pip install -q -e .[dev]"]  # the tests need ggml: CI fails here
