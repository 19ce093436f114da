#!/usr/bin/env bash
# Create or reuse the virtual environment .venv at the repository's root, install into it what is
# missing (torch, then the project with ggml's CPU kernels, the `cpu-experts` extra, and where torch is
# a CUDA build CuPy for its CUDA kernels; with --dev instead what the tests need, ggml included), then
# run the command given, inside it:
#
#   bash scripts/setup.sh strata serve
#   bash scripts/setup.sh --dev python -m pytest -q
#
# torch: one already in .venv is kept (install the build you want there first to choose it yourself).
# Otherwise, with an NVIDIA GPU: PyPI's wheel, which on Linux is the CUDA build; without one: the CPU
# build from PyTorch's CPU index (a plain `pip install torch` would fetch several GB of CUDA libraries).
# The project is installed again only when pyproject.toml has changed since the last run. ggml-python
# builds ggml from source (about a minute, a C compiler); where that fails the project is installed
# without it, said once: a CPU stage then runs slower torch code.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH_VERSION=2.13.0  # the CPU build's version: the one CI tests (.ci/run)
CPU_INDEX=https://download.pytorch.org/whl/cpu

dev=""
if [[ "${1:-}" == "--dev" ]]; then
    dev=1
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

# What to install with the project: the test tools (ggml-python among them), or what serves fastest
# here: ggml's CPU kernels, and CuPy of torch's CUDA major where torch is a CUDA build
cuda=""
if [[ -n "$dev" ]]; then
    extras="dev"
else
    if has_gpu; then
        cuda_major="$(python -c "import torch; print((torch.version.cuda or '').split('.')[0])")"
        if [[ "$cuda_major" == 12 || "$cuda_major" == 13 ]]; then cuda="cuda$cuda_major"; fi
    fi
    extras="cpu-experts${cuda:+,$cuda}"
fi
stamp=".venv/strata-setup-${extras//,/-}"
want="$(cksum < pyproject.toml)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    building=""  # ggml-python compiles ggml as it installs, unless a build of it is here already
    python -c "import ggml" 2>/dev/null || building=": ggml-python builds ggml from source, about a minute"
    say "installing the project with ${dev:+its test tools and }ggml's CPU kernels" \
        "(pip install -e '.[$extras]')$building"
    if ! python -m pip install -q -e ".[$extras]"; then
        [[ -z "$dev" ]] || exit 1
        say "ggml could not be built (it needs a C compiler; pip said why above): installing without it, so" \
            "a CPU stage runs torch code, several times slower (pip install -e '.[cpu-experts]' to try again)"
        python -m pip install -q -e ".${cuda:+[$cuda]}"
    fi
    echo "$want" > "$stamp"
    if [[ -n "$dev" ]]; then echo "$want" > .venv/strata-setup-cpu-experts; fi  # ggml-python is a test tool
fi

if [[ $# -gt 0 ]]; then
    exec "$@"
fi
