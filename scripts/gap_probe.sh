#!/usr/bin/env bash
# First tokens of 8 chats sent at once over HTTP, for each --arrival-gap-ms in GAPS, on a model of
# 30B-A3B's layer shapes with 16 experts a layer (written in seconds; the host's work a layer is
# the same as with 128). Results: $OUT/gap_<ms>.log. Usage: GAPS="2 10" bash scripts/gap_probe.sh
source "$(dirname "$0")/gpu_env.sh"
set +e
MODEL=/tmp/q30b_e16.gguf
[ -f $MODEL ] || python3 -c "
from dataclasses import replace
from strata_mgpu.model import synthetic
synthetic.PRESETS['30b-e16'] = replace(synthetic.PRESETS['30b-a3b'], n_experts=16)
synthetic.write_model('$MODEL', '30b-e16', seed=0)"
for gap in ${GAPS:-2 10}; do
  port=$((8100 + RANDOM % 500))
  python3 -m strata_mgpu serve $MODEL --max-vram 40 --ctx-size 4096 --arrival-gap-ms $gap --port $port \
    > "$OUT/serve_gap_$gap.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do
    python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" \
      2> /dev/null && break
    sleep 1
  done
  for run in 1 2; do
    python3 -m strata_mgpu.tools.serve_probe "http://127.0.0.1:$port" --prompt-tokens 100 --max-tokens 32 \
      --chats 8 2>&1 | grep chats | sed "s/^/gap $gap ms, run $run: /" | tee -a "$OUT/gap_$gap.log"
  done
  kill $pid; wait $pid 2> /dev/null
done
