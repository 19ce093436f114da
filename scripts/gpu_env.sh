# Sourced by the GPU-machine scripts: install the carried wheels (.whl/, from
# `../shared/device/wheels.sh hypothesis attrs sortedcontainers httpx httpcore httpx2 httpcore2 truststore h11
# anyio idna certifi llguidance jsonschema jsonschema-specifications referencing rpds-py fla-core einops`: collecting every test
# file needs them; and ggml-python's portable wheel: `CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
# -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF" pip wheel --no-deps -w .whl ggml-python==0.0.45`) and point
# Python at the checkout; $OUT collects the results.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/strata-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
