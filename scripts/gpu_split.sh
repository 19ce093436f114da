#!/usr/bin/env bash
# On the GPU machine: GPU tests, then one stage against two stages on the same card (30b-a3b preset).
source "$(dirname "$0")/gpu_env.sh"
tests_rc=0  # a failing test fails the script, after the benchmarks have run
[ "${SKIP_TESTS:-0}" = 1 ] || python3 -m pytest -q -m gpu tests -p no:cacheprovider \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -3 || tests_rc=$?
MODEL=/tmp/q30b.gguf
[ -f $MODEL ] || python3 -m strata_mgpu gen-model $MODEL --preset 30b-a3b --seed 0 2>&1 | tail -1
python3 -m strata_mgpu bench $MODEL --max-vram 16 --prompt-tokens 4096 --decode-tokens 0 --runs 3 \
  --json "$OUT/bench_single.json" 2>&1 | tee "$OUT/bench_single.log" | tail -9
python3 -m strata_mgpu bench $MODEL --devices 0,0 --layer-split 24 --max-vram 16 \
  --prompt-tokens 1024,2048,4096,8192,32768 --chunk-size 8192 --decode-tokens 16 --runs 3 \
  --json "$OUT/bench_split.json" 2>&1 | tee "$OUT/bench_split.log" | tail -18
exit $tests_rc
