#!/usr/bin/env bash
# On the GPU machine: the helper's GPU tests, then a short share sweep on the 30b-a3b preset,
# two stages on the one card.
source "$(dirname "$0")/gpu_env.sh"
tests_rc=0  # a failing test fails the script, after the sweep has run
python3 -m pytest -q -m gpu tests -p no:cacheprovider -k "helper or two_stage" 2>&1 \
  | tail -3 || tests_rc=$?
MODEL=/tmp/q30b.gguf
[ -f $MODEL ] || python3 -m strata_mgpu gen-model $MODEL --preset 30b-a3b --seed 0 2>&1 | tail -1
python3 -m strata_mgpu sweep $MODEL --devices 0,0 --layer-split 24 --max-vram 16 ${SWEEP_ARGS:-} \
  --csv "$OUT/sweep.csv" --json "$OUT/sweep.json" --png "$OUT/sweep.png" 2>&1 | tail -14
exit $tests_rc
