#!/usr/bin/env bash
# Create or reuse the virtual environment .venv at the repository's root, install into it what is
# missing (torch, then the project; with --dev also what the tests need), then run the command given,
# inside it:
#
#   bash scripts/setup.sh strata serve
#   bash scripts/setup.sh --dev python -m pytest -q
#
# torch: one already in .venv is kept (install the build you want there first to choose it yourself).
# Otherwise, with an NVIDIA GPU: PyPI's wheel, which on Linux is the CUDA build; without one: the CPU
# build from PyTorch's CPU index (a plain `pip install torch` would fetch several GB of CUDA libraries).
# The project is installed again only when pyproject.toml has changed since the last run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH_VERSION=2.13.0  # the CPU build's version: the one CI tests (.ci/run)
CPU_INDEX=https://download.pytorch.org/whl/cpu

extras=""
if [[ "${1:-}" == "--dev" ]]; then
    extras="[dev]"
    shift
fi

say() { echo "setup.sh: $*" >&2; }
has_gpu() { [[ -e /dev/nvidia0 ]] || nvidia-smi -L >/dev/null 2>&1; }

if [[ ! -x .venv/bin/python ]]; then
    say "creating .venv with $(${PYTHON:-python3} --version)"
    "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate

if ! python -c "import torch" 2>/dev/null; then
    if has_gpu; then
        say "an NVIDIA GPU is here: installing torch from PyPI (the CUDA build)"
        python -m pip install -q torch
    else
        say "no NVIDIA GPU: installing torch $TORCH_VERSION, the CPU build"
        python -m pip install -q --retries 1 "torch==$TORCH_VERSION" --index-url "$CPU_INDEX"
    fi
elif has_gpu && python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
    say "torch in .venv is a CPU build; install a CUDA build to use the GPU" \
        "(.venv/bin/pip uninstall -y torch, then run this again)"
fi

stamp=".venv/strata-setup${extras:+-dev}"
want="$(cksum < pyproject.toml)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    say "installing the project${extras:+ with its test tools} (pip install -e '.$extras')"
    python -m pip install -q -e ".$extras"
    echo "$want" > "$stamp"
    if [[ -n "$extras" ]]; then echo "$want" > .venv/strata-setup; fi  # the base install is part of it
fi

if [[ $# -gt 0 ]]; then
    exec "$@"
fi
