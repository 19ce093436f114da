#!/usr/bin/env bash
# On a machine with two GPUs (the device tool's nvidia-h200-x2 kind): everything docs/MULTI_GPU.md's
# two-card tables need, in one run. The hand-over between the stages always goes through mapped
# host memory (no P2P), as on consumer cards. Output under $OUT: topo.txt, gpu_tests.log,
# bench_one_card.*, bench_two_cards.*, sweep.* (CSV, JSON, PNG).
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=index,name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv \
  | tee "$OUT/gpu.txt"
python3 -m strata_mgpu topo 2>&1 | tee "$OUT/topo.txt"
tests_rc=0  # a failing test fails the script, after the benchmarks have run
[ "${SKIP_TESTS:-0}" = 1 ] || python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_quant.py -p no:cacheprovider \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -3 || tests_rc=$?
MODEL=/tmp/q30b.gguf
[ -f $MODEL ] || python3 -m strata_mgpu gen-model $MODEL --preset 30b-a3b --seed 0 2>&1 | tail -1
LENGTHS=1024,2048,4096,8192,32768
python3 -m strata_mgpu bench $MODEL --devices 0 --max-vram 16 --prompt-tokens $LENGTHS --chunk-size 8192 \
  --decode-tokens 32 --runs 3 --json "$OUT/bench_one_card.json" 2>&1 | tee "$OUT/bench_one_card.log" | tail -12
python3 -m strata_mgpu bench $MODEL --devices 0,1 --layer-split auto --max-vram 16,16 --prompt-tokens $LENGTHS \
  --chunk-size 8192 --decode-tokens 32 --runs 3 --no-prefill-help --json "$OUT/bench_two_cards_help_off.json" \
  2>&1 | tee "$OUT/bench_two_cards_help_off.log" | tail -16
python3 -m strata_mgpu bench $MODEL --devices 0,1 --layer-split auto --max-vram 16,16 --prompt-tokens $LENGTHS \
  --chunk-size 8192 --decode-tokens 0 --runs 3 --json "$OUT/bench_two_cards_rule.json" \
  2>&1 | tee "$OUT/bench_two_cards_rule.log" | tail -16
python3 -m strata_mgpu sweep $MODEL --devices 0,1 --layer-split auto --max-vram 16,16 \
  --prompt-tokens 1024,2048,3072,4096,6144,8192 --shares 0,0.2,0.3,0.35,0.4,0.45,0.5 --runs 3 \
  --csv "$OUT/sweep.csv" --json "$OUT/sweep.json" --png "$OUT/sweep.png" 2>&1 | tail -14
exit $tests_rc
