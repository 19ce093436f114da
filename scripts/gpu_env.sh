# Sourced by the GPU-machine scripts: install the carried wheels (.whl/, from
# `../shared/device/wheels.sh hypothesis attrs sortedcontainers httpx2 httpcore2 h11 anyio idna certifi`:
# collecting every test file needs them) and point Python at the checkout; $OUT collects the results.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/strata-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
