#!/usr/bin/env bash
# One full run on the lent GPU machine: install the carried wheels, run the GPU tests, write the
# 30b-a3b synthetic model, and benchmark it. Output under $OUT (gpu_tests.log, bench.log, bench.json).
# Usage (from the repo root, with .whl carried): bash scripts/gpu_run.sh [bench args...]
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/gpu.txt"
# A failing GPU test fails the script, at its end: the benchmarks below still run and report.
tests_rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests.log" || tests_rc=$?
fi
if [ "${DIAG:-1}" = 1 ]; then
  python3 -m strata_mgpu gen-model /tmp/small.gguf --preset small --seed 3
  # A diagnostic that prints what it finds, optional: its failure must not stop the benchmark.
  python3 -m strata_mgpu.tools.diag_bf16 /tmp/small.gguf 2>&1 | tee "$OUT/diag_bf16.txt" || true
fi
MODEL=/tmp/q30b.gguf
[ -f $MODEL ] || (time python3 -m strata_mgpu gen-model $MODEL --preset 30b-a3b --seed 0) 2>&1 | tail -3
python3 -m strata_mgpu info $MODEL --link-gbps 54.6 | tee "$OUT/info.txt"
(time python3 -m strata_mgpu bench $MODEL --max-vram 16 --json "$OUT/bench.json" "$@") 2>&1 | tee "$OUT/bench.log"
python3 -m strata_mgpu bench $MODEL --max-vram 16 --prompt-tokens 1024 --runs 1 --decode-tokens 32 \
  --no-cuda-graphs 2>&1 | tail -4 | tee "$OUT/bench_eager_decode.log"
if [ "${PROFILE:-1}" = 1 ]; then
  # Optional profile (the profiler may be unavailable); the benchmark results are in already.
  python3 -m strata_mgpu.tools.profile_decode $MODEL > "$OUT/profile_decode.txt" 2>&1 || true
  head -1 "$OUT/profile_decode.txt"
fi
exit $tests_rc
