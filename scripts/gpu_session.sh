#!/usr/bin/env bash
# One lease's run on the lent GPU machine, in steps chosen by STEPS (space-separated):
#   tests   the GPU tests: every `gpu`-marked test under tests/ (TESTS: other paths or node ids instead)
#   gen     write the 30b-a3b synthetic model (in the background while the tests run)
#   b16 b24 b40   bench at --max-vram 16 / 24 / 40 (one card, residency by the plan)
#   b16off  bench at --max-vram 16 with residency forced off (the figures before the VRAM plan)
#   long    a 32K-token prompt: at --max-vram 16 (its KV in VRAM) and at 8 (KV spilled to host RAM,
#           STRATA_KV_PREFETCH=0 and 1)
#   short   prompts of 1-512 tokens at --max-vram 40 (all resident: the static rows and grouped experts' range)
#   dec40   decode at --max-vram 40 (all resident): bench batch 1, then 1 and 8 requests as the server does
#   dense   STRATA_DENSE_BLOCKS=0 (bf16 copies of the projections and head) against 1 (the file's blocks): prompts of
#           1 / 16 / 1K / 4K tokens and decode at --max-vram 40, decode at 16 (the VRAM the blocks free holds experts)
#   grammar the constrained-decoding mask on $MODEL: tests/test_gpu_grammar.py at --max-vram 16 and 40
#           (STRATA_GPU_MODEL), then tools/grammar_cost at batch 8 with GRAMMAR_ROWS (default 1) of its rows constrained
#   shared  a CPU stage beside busy spinners on the same cores (tools/shared_host, small preset): cores 0-3 and
#           0-7, fixed threads against the adaptive executor; and 0-7 as before it (spinning OpenMP, fixed threads)
#   served  decode through the engine as the server does (sampling on), 1 and 8 requests, at 40 and 16
#   split   two stages on one card, --max-vram 8,8 (total 16) and 20,20 (all resident)
#   splitdec decode on two stages of one card, all resident (--max-vram 20,20): batch 1 and 8, and 1
#           and 8 requests as the server does (against dec40's one stage)
#   splitlong a 32K-token prompt on two stages of one card (--max-vram 16,16) in 8K and 4K chunks: the
#           stages' busy-together time against the shorter stage's busy time (#12: >= 0.75)
#   sweep   the helper's share sweep on two stages of one card
# On two GPUs (the nvidia-h200-x2 kind; the hand-over still goes through mapped host memory):
#   topo    nvidia-smi's and strata's topology reports
#   x2      one-chunk prefill 1K-8K and decode on two cards, --max-vram 16,16: help off and auto
#   x2long  a 32K-token prompt on one card (16) and on two (16,16): tok/s and the stages' overlap
#   x2sweep the share sweep on two cards with residency forced off, and at --max-vram 8,8
#   x2sweep3 the same, residency off only, at 1K / 4K / 8K and shares 0 / 0.3 / 0.45 (a few minutes)
#   x2served decode through the engine as the server does on two cards, 1 and 8 requests
#   x2dec   decode on two cards (batch 1 bench, and 1 and 8 requests as the server does) and on one
#   x2prof  tools/profile_pipeline on two cards, 32K prompt: host vs device timelines, allocator
#           syncs, host calls that wait for the device
#   serve40 / x2serve   `strata serve` as a user launches it (one card --max-vram 40; two cards 16,16),
#           measured over HTTP by tools/serve_probe: prompt tok/s at 1.5K/3K/6K tokens from the
#           server's timings, decode, 8 streamed chats at once (STRATA_DECODE_GRAPH_BATCH as set)
#   serve16long `strata serve --max-vram 16` (one card, the model's whole context): prompts of 1,000,
#           32,000 and 40,000 tokens over HTTP (decode after each on one plan), then 8 chats
#   graphs8 decode at --max-vram 40 with batched graphs off (default) and on (STRATA_DECODE_GRAPH_BATCH=8)
#   dec32k  decode after a 32K-token prompt against after a 1K one (#12: >= 0.8), at --max-vram 40 and 16
#   oom16   scripts/oom_probe.py around dec40's bench at --max-vram 16: what holds the memory when the
#           server-shaped requests run out of it (oom_*.txt)
#   prefix  the prefix cache: tools/prefix_restore (a 32K prefix back from pinned host RAM and from
#           VRAM, against one pinned copy and against computing it), then tools/agent_trace against
#           `strata serve` at --max-vram 16 and 40 (1 and 4 sessions of 10 turns: 4K system prompt,
#           +1.5K and 150 generated a turn), and at 16 with --no-prefix-cache
#   prefixkv the 4-session trace with --kv-tokens 98304 (KV cells for all four) at --max-vram 40 and 16
#   pool42  #42's agent trace through the KV pool (4 sessions at once, 6 turns, a 3K system prompt, +2.7K and 96
#           generated a turn): --max-vram 40 --kv-tokens 131072, --max-vram 16; then 16 sessions at 40
#   cmp42   prefill (2K, 8K) and decode (batch 1 and 8) at --max-vram 40, at this tree and at the tree before the
#           KV pool (.prepool/strata_mgpu, carried: `git archive 4e3cafa strata_mgpu | tar x -C .prepool`), in turn
#   attn    scripts/attn_probe.py: a 2K chunk's attention over 20K cached keys (30B-A3B's heads), three ways
#   llama   the agent trace against llama-server (.llama/llama-server, built from the llama-cpp-python
#           sdist's vendor/llama.cpp with CUDA for sm_90; carried), all layers on the card, and with
#           --n-cpu-moe 18 (about 16 GiB of VRAM)
#   cpudec  decode with a share of the missing experts on the host's cores (--cpu-experts): batch 1 and one
#           server-shaped request at --max-vram 16 and 8, off / auto / fixed shares (CPUSHARES)
#   cpuauto decode at --max-vram 16 and 8 (CPUVRAM), --cpu-experts off and auto, long enough (320 tokens, then 320
#           server-shaped) for auto's refit every 256 steps to run and, where the host loses, to detach the hand-over
#   hostprompt few-row streamed prompts (16, 32, 64 tokens) at --max-vram 8 with --cpu-experts auto and 0.3:
#           STRATA_HOST_PROMPT_HELP=0 (link only) against =1 (the host's cores take a share of the streamed experts)
#   cpurates tools/bench_cpu_experts on the host's cores: 30b-a3b and 235b-a22b layers, 1, 2 and 8 picks a row,
#           4 / 8 / 15 threads, ggml's idle workers sleeping (poll 0) and spinning (poll 50)
#   cpu235  the 235b-a22b preset capped to 24 layers (gen in the background: MODEL235): bench at --max-vram 22,
#           --cpu-experts off and auto (and CPUSHARES235)
#   cpuonly the CPU-only stage (--devices cpu: experts by ggml from the file's bytes) on the host's cores
#           against llama.cpp's llama-bench -ngl 0 on the same file (.llamabench/llama-bench.xz, carried:
#           built from the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp for the CPU alone: `cmake -B build
#           -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
#           -DLLAMA_CURL=OFF && cmake --build build --target llama-bench`: AVX2, as the carried ggml-python wheel;
#           a build with AVX-512 BF16 and AMX died there of an illegal instruction), xz'd, with the build
#           machine's libgomp.so.1 beside it)
#   q8kv    a 32K-token prompt and decode after it at --max-vram 16 with bf16 KV and with q8_0 keys and values
#           (--cache-type-k/-v): speed, and the resident experts the freed bytes buy (the plan's lines)
#   tol     scripts/tol_probe.py: the fused expert kernels' error against their twin over 200 random
#           passes per type pair (what FUSED_TOL in tests/test_gpu_quant.py is set from)
#   kbench  tools/bench_kernels: the fused expert kernels, decode attention and a layer's dequant on
#           synthetic 30b-a3b data (no model file), each checked against its twin; all in VRAM and half on the host
#   prof40  tools/profile_decode at --max-vram 40 (all resident): batch 1, and batch 8 eager and as a graph
#   x2final the session's last two-card figures: a 32K prompt in 4K chunks, decode (graphs per stage,
#           server-shaped 1 and 8), and a 40K prompt on one card at --max-vram 16
#   x2helperprof tools/profile_helper on two cards, residency off, 8K and 2K one-chunk prompts at
#           shares 0 and 0.45: each card's streams busy / idle, hand-over copies, uploads (#13)
#   x2halves the share sweep on two cards, residency off, 1K-8K, helped prompts in two halves of rows
#           (STRATA_HELP_HALVES=1) against all rows at once (=0); then tools/profile_helper at 8K in halves
#   x2hostprof tools/profile_helper on two cards, residency off, share 0.45 at 8K and 1K, all rows at once
#           and in two halves: the cards' streams and the host's CUDA calls (what waits for the device)
#   x2hostpy tools/profile_helper --host: the host's Python time (cProfile) of a 1K prompt on two cards,
#           help off and share 0.45 in all rows at once and in halves
#   x2cells #13's loose ends: two cards, residency off, 1K and 2K at shares 0.45 / 0.47 / 0.5 (--runs 5, the rate
#           model's outlier cell); then two stages of one card (--devices 0,0 --max-vram 8,8) at 1K / 4K / 8K
#   x2oom   the 8,8 sweep cells at 6K and 8K with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#   fewrows prompts of 1-64 tokens at --max-vram 16 with STRATA_GATHER_ROWS=auto (the break-even of the
#           measured rates; the stage logs it), 16 (the rule before it: E picks), 1 (every prompt streams) and
#           64 (every one gathers): where gathering really stops paying, against where the rule puts it
#   hyb     a hybrid model on one GPU stage (#43): the 35b-a3b-hybrid preset (qwen35moe, Qwen3.5-35B-A3B's
#           shapes; written in the background while the tests run: HMODEL), bench at --max-vram 16 (1K and 4K
#           prompts, decode) and 40, and a 10-turn agent session against `strata serve --max-vram 40`
#           (computed against new tokens: the snapshots' prefix cache)
#   delta   scripts/delta_probe.py (one DeltaNet layer's prompt scan, plain against fla-core's kernels), then bench
#           of the hybrid file at --max-vram 16 with STRATA_DELTA_SCAN=torch and the default (fla)
#   llamahyb llama-bench (.llamacuda/llamacuda.tar.xz, carried: llama.cpp of the llama-cpp-python 0.3.36 sdist built
#           for sm_90 with CUDA on the CPU machine by scripts/build_llama_cuda.sh) on the hybrid file: 1K and 4K
#           prompts and 64-token decode, -fa 1 -lm none, with --n-cpu-moe in NCMOE (default 0 16 18)
#   resid   decode at --max-vram 16 after a 1K prompt with STRATA_RESIDENCY_SWAPS=0 (held still), 4 and 16 and
#           STRATA_RESIDENCY_HALF_LIFE 128 / 512 / 2048; tools/router_predict on the model (synthetic: the
#           rates mean little, the run times are what counts)
# Results under $OUT: gpu.txt, gpu_tests.log and results.tgz (every bench_*/sweep_* log and JSON:
# the device tool brings back few files). A failing GPU test fails the run.
# Usage (repo root, .whl carried): STEPS="tests gen b16 b40" bash scripts/gpu_session.sh
source "$(dirname "$0")/gpu_env.sh"
STEPS=${STEPS:-"tests gen b16 b40"}
MODEL=${MODEL:-/tmp/q30b.gguf}
has() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/gpu.txt"
gen_pid=
if has gen && [ ! -f $MODEL ]; then
  # written aside and renamed: a run cut short leaves no half-written model for the next one
  (python3 -m strata_mgpu gen-model /tmp/q30b.part.gguf --preset 30b-a3b --seed 0 > "$OUT/gen.log" 2>&1 \
     && mv /tmp/q30b.part.gguf $MODEL) &
  gen_pid=$!
fi
HMODEL=${HMODEL:-/tmp/h35.gguf}
genh_pid=
if { has hyb || has llamahyb || has delta; } && [ ! -f $HMODEL ]; then
  (python3 -m strata_mgpu gen-model /tmp/h35.part.gguf --preset 35b-a3b-hybrid --seed 0 > "$OUT/genh.log" 2>&1 \
     && mv /tmp/h35.part.gguf $HMODEL) &
  genh_pid=$!
fi
status=0
if has tests; then
  timeout ${TESTS_TIMEOUT:-3000} python3 -m pytest -q -m gpu ${TESTS:-tests} -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests.log" || status=$?
fi
[ -n "$gen_pid" ] && wait $gen_pid
# `strata bench` sets up no logging; BENCH_LOG=1 shows the engine's and stages' INFO lines too (what
# `--cpu-experts auto` chose, its trial's verdict, a detach)
strata_bench() {
  if [ "${BENCH_LOG:-0}" = 1 ]; then
    python3 -c "import logging, sys; logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')
sys.argv[0] = 'strata'
from strata_mgpu.cli import main
main()" bench "$@"
  else
    python3 -m strata_mgpu bench "$@"
  fi
}
bench() {  # name, args...
  local name=$1; shift
  (time strata_bench $MODEL --json "$OUT/bench_$name.json" "$@") 2>&1 | tee "$OUT/bench_$name.log" \
    | tail -30 || status=1  # a failed bench is reported, and the next one still runs
}
has b16 && bench 16 --max-vram 16 --prompt-tokens 2048,4096,8192 --decode-tokens 64 --runs 3
has b16off && bench 16off --max-vram 16 --resident-experts 0 --prompt-tokens 2048,4096 --decode-tokens 0 --runs 2
has b24 && bench 24 --max-vram 24 --prompt-tokens 2048,4096,8192 --decode-tokens 64 --runs 3
has b40 && bench 40 --max-vram 40 --prompt-tokens 2048,4096,8192 --decode-tokens 64 --runs 3
if has long; then
  bench long16 --max-vram 16 --prompt-tokens 32768 --decode-tokens 32 --runs 1
  STRATA_KV_PREFETCH=0 bench long8 --max-vram 8 --prompt-tokens 32768 --decode-tokens 16 --runs 1
  STRATA_KV_PREFETCH=1 bench long8pf --max-vram 8 --prompt-tokens 32768 --decode-tokens 16 --runs 1
fi
has short && bench short40 --max-vram 40 --prompt-tokens 1,16,64,128,160,192,256,512 --decode-tokens 0 --runs 5
has dec40 && bench dec40 --max-vram 40 --prompt-tokens 1024 --decode-tokens 128 --runs 1 --server-decode 1,8 --decode-batch 1,8
if has dense; then  # projections and head as the file's blocks (default) against bf16 copies, same machine
  for blocks in 0 1; do
    STRATA_DENSE_BLOCKS=$blocks bench "dense40_$blocks" --max-vram 40 --prompt-tokens 1,16,1024,4096 --decode-tokens 128 \
      --runs 2 --server-decode 1,8 --decode-batch 1,8
    STRATA_DENSE_BLOCKS=$blocks bench "dense16_$blocks" --max-vram 16 --prompt-tokens 1024 --decode-context 1024 \
      --decode-tokens 64 --runs 1
  done
fi
if has grammar; then
  STRATA_GPU_MODEL=$MODEL timeout 1200 python3 -m pytest -q tests/test_gpu_grammar.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_grammar_tests.log" | tail -5 || status=1
  for vram in ${GRAMMAR_VRAM:-16 40}; do
    for rows in ${GRAMMAR_ROWS:-1}; do
      python3 -m strata_mgpu.tools.grammar_cost $MODEL --devices 0 --max-vram $vram --batch 8 --tokens 128 \
        --rounds ${GRAMMAR_ROUNDS:-3} \
        --constrained-rows $rows 2>&1 | tee "$OUT/grammar_${vram}_$rows.log" | tail -2 || status=1
    done
  done
fi
if has shared; then
  lscpu -e > "$OUT/lscpu_e.txt" 2>&1 || true
  for cores in ${SHARED_CORES:-0-3 0-7}; do
    python3 -m strata_mgpu.tools.shared_host --cores $cores --threads $([ $cores = 0-3 ] && echo 1,2,3,4 || echo 1,2,4,8) \
      ${SHARED_ARGS:-} --json "$OUT/shared_$cores.json" 2>&1 \
      | tee "$OUT/shared_$cores.log" | tail -12 || status=1
  done
  OMP_WAIT_POLICY=ACTIVE python3 -m strata_mgpu.tools.shared_host --cores 0-7 --no-adaptive --torch-threads cores \
    --threads 1,4,8 --warmup 1 --seconds 1 --json "$OUT/shared_0-7_before.json" 2>&1 \
    | tee "$OUT/shared_0-7_before.log" | tail -8 || status=1
fi
if has cpudec; then
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|Flags" | cut -c1-200 > "$OUT/lscpu.txt"
  for vram in ${CPUVRAM:-16 8}; do
    for share in off auto ${CPUSHARES:-0.3 0.5}; do
      bench "cpu${vram}_$share" --max-vram $vram --cpu-experts $share --prompt-tokens 1024 --decode-tokens 64 \
        --runs 1 --server-decode 1
    done
  done
fi
if has cpuauto; then
  for vram in ${CPUVRAM:-16 8}; do
    for share in off auto; do
      BENCH_LOG=1 bench "cpuauto${vram}_$share" --max-vram $vram --cpu-experts $share --prompt-tokens 1024 --decode-tokens 320 \
        --runs 1 --server-decode 1
    done
  done
fi
if has hostprompt; then
  for share in auto 0.3; do
    for help in 0 1; do
      STRATA_HOST_PROMPT_HELP=$help bench "hostprompt_${share}_$help" --max-vram 8 --cpu-experts $share \
        --prompt-tokens 16,32,64 --decode-tokens 0 --runs 5
    done
  done
fi
if has cpurates; then
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|Flags" | cut -c1-2000 > "$OUT/lscpu.txt"
  for preset in ${RATEPRESETS:-30b-a3b 235b-a22b}; do
    for threads in ${RATETHREADS:-4 8 15}; do
      for poll in 0 50; do
        for picks in 1 2 8; do
          python3 -m strata_mgpu.tools.bench_cpu_experts --preset $preset --threads $threads --poll $poll \
            --picks $picks --reps 24 2>&1 | tail -1 | sed "s/^/$preset threads $threads poll $poll picks $picks: /"
        done
      done
    done
  done 2>&1 | tee "$OUT/cpurates.log"
fi
if has cpu235; then
  M235=${MODEL235:-/tmp/q235x24.gguf}
  [ -f $M235 ] || python3 -m strata_mgpu gen-model $M235 --preset 235b-a22b --layers 24 --seed 0 > "$OUT/gen235.log" 2>&1
  for share in off auto ${CPUSHARES235:-}; do
    BENCH_LOG=1 MODEL=$M235 bench "235_22_$share" --max-vram 22 --cpu-experts $share --prompt-tokens 2048 --decode-tokens 32 \
      --runs 1
  done
fi
if has cpuonly; then
  bench cpuonly --devices cpu --prompt-tokens 512 --decode-tokens 32 --runs 1
  [ -x .llamabench/llama-bench ] || { xz -dc .llamabench/llama-bench.xz > .llamabench/llama-bench \
    && chmod +x .llamabench/llama-bench; }
  LD_LIBRARY_PATH=$PWD/.llamabench .llamabench/llama-bench -m $MODEL -ngl 0 -p 512 -n 32 -r 2 -t ${CPUTHREADS:-16} 2>&1 \
    | tee "$OUT/llamabench_cpu.log" \
    | tail -8 || status=1
fi
if has q8kv; then
  for t in bf16 q8_0; do
    bench "kv_$t" --max-vram 16 --cache-type-k $t --cache-type-v $t --prompt-tokens 32768 --decode-tokens 32 --runs 1
  done
fi
has tol && { python3 scripts/tol_probe.py 200 2>&1 | tee "$OUT/tol.log" || status=1; }
if has oom16; then
  python3 scripts/oom_probe.py "$OUT/oom16" -- bench $MODEL --max-vram 16 --prompt-tokens 1024 --decode-tokens 128 \
    --runs 1 --server-decode 1,8 --decode-batch 1,8 > "$OUT/oom16.log" 2>&1 || status=1
  tail -5 "$OUT/oom16.log"; head -30 "$OUT"/oom16/oom_1.txt 2>/dev/null || true
fi
if has served; then
  bench served40 --max-vram 40 --prompt-tokens 1024 --decode-tokens 128 --runs 1 --server-decode 1,8
  bench served16 --max-vram 16 --prompt-tokens 1024 --decode-tokens 128 --runs 1 --server-decode 1,8
fi
if has split; then
  bench split16 --devices 0,0 --max-vram 8,8 --prompt-tokens 2048,4096 --decode-tokens 32 --runs 3
  bench split40 --devices 0,0 --max-vram 20,20 --prompt-tokens 2048,4096 --decode-tokens 32 --runs 3
fi
has splitdec && bench splitdec --devices 0,0 --max-vram 20,20 --prompt-tokens 1024 --decode-tokens 128 --runs 1 \
  --server-decode 1,8 --decode-batch 1,8
if has splitlong; then
  bench splitlong8k --devices 0,0 --layer-split 24 --max-vram 16,16 --prompt-tokens 32768 --chunk-size 8192 \
    --decode-tokens 0 --runs 2
  bench splitlong4k --devices 0,0 --layer-split 24 --max-vram 16,16 --prompt-tokens 32768 --chunk-size 4096 \
    --decode-tokens 0 --runs 2
fi
if has sweep; then
  python3 -m strata_mgpu sweep $MODEL --devices 0,0 --max-vram 8,8 --prompt-tokens 1024,2048,4096,8192 \
    --shares 0,0.3,0.45 --runs 2 --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log" | tail -20
fi
X2="--devices 0,1 --layer-split auto --max-vram 16,16"
if has topo; then
  { nvidia-smi topo -m; nvidia-smi topo -p2p r; python3 -m strata_mgpu topo; } 2>&1 | tee "$OUT/topo.log"
fi
if has x2; then
  bench x2off $X2 --no-prefill-help --prompt-tokens 1024,2048,4096,8192 --decode-tokens 64 --runs 3
  bench x2auto $X2 --prompt-tokens 1024,2048,4096,8192 --decode-tokens 0 --runs 3
fi
if has x2long; then  # X2LONG_ONE=0: the two-card run only
  [ "${X2LONG_ONE:-1}" = 0 ] || bench long16one --devices 0 --max-vram 16 --prompt-tokens 32768 --decode-tokens 32 --runs 2
  bench long16two $X2 --prompt-tokens 32768 --decode-tokens 32 --runs 2
fi
if has x2sweep; then
  for budget in "16,16 --resident-experts 0" "8,8"; do
    name=sweep_x2_${budget%% *}; name=${name/,/_}
    python3 -m strata_mgpu sweep $MODEL --devices 0,1 --max-vram $budget --prompt-tokens 1024,2048,3072,4096,6144,8192 \
      --shares 0,0.2,0.3,0.4,0.45,0.5 --runs 2 --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | tail -24 || status=1
  done
fi
if has x2sweep3; then
  python3 -m strata_mgpu sweep $MODEL --devices 0,1 --max-vram 16,16 --resident-experts 0 \
    --prompt-tokens 1024,4096,8192 --shares 0,0.3,0.45 --runs 2 --json "$OUT/sweep_x2_3.json" 2>&1 \
    | tee "$OUT/sweep_x2_3.log" | tail -24 || status=1
fi
if has x2served; then
  bench x2served $X2 --prompt-tokens 1024 --decode-tokens 128 --runs 1 --server-decode 1,8 --decode-batch 1,8
fi
if has x2dec; then
  bench x2dec $X2 --prompt-tokens 1024 --decode-tokens 128 --runs 1 --server-decode 1,8
  bench dec40 --max-vram 40 --prompt-tokens 1024 --decode-tokens 128 --runs 1 --server-decode 1,8
fi
if has x2prof; then  # STRATA_STAGE_THREADS=0 gives the one-thread figures to compare
  python3 -m strata_mgpu.tools.profile_pipeline $MODEL --devices 0,1 --max-vram 16,16 --tokens 32768 --chunk 8192 \
    > "$OUT/pipeline.log" 2>&1 || status=1
  head -24 "$OUT/pipeline.log"
fi
if has x2helperprof; then
  for n in 8192 2048; do
    python3 -m strata_mgpu.tools.profile_helper $MODEL --devices 0,1 --max-vram 16,16 --resident-experts 0 \
      --tokens $n --shares 0,0.45 2>&1 | grep -v "^USDT\|^$" | tee "$OUT/helperprof_$n.log" || status=1
  done
fi
if has x2halves; then
  for halves in 0 1; do
    STRATA_HELP_HALVES=$halves python3 -m strata_mgpu sweep $MODEL --devices 0,1 --max-vram 16,16 --resident-experts 0 \
      --prompt-tokens 1024,2048,4096,6144,8192 --shares 0,0.2,0.3,0.45 --runs 3 --json "$OUT/sweep_halves$halves.json" \
      2>&1 | tee "$OUT/sweep_halves$halves.log" | tail -12 || status=1
  done
  STRATA_HELP_HALVES=1 python3 -m strata_mgpu.tools.profile_helper $MODEL --devices 0,1 --max-vram 16,16 \
    --resident-experts 0 --tokens 8192 --shares 0.45 2>&1 | grep -v "^USDT\|^$" | tee "$OUT/helperprof_halves.log" \
    || status=1
fi
if has x2hostprof; then
  for n in 8192 1024; do
    python3 -m strata_mgpu.tools.profile_helper $MODEL --devices 0,1 --max-vram 16,16 --resident-experts 0 \
      --tokens $n --shares 0,0.45 --halves 0,1 2>&1 | grep -v "^USDT\|^$\|warn" | tee "$OUT/hostprof_$n.log" || status=1
  done
fi
if has x2hostpy; then
  python3 -m strata_mgpu.tools.profile_helper $MODEL --devices 0,1 --max-vram 16,16 --resident-experts 0 \
    --tokens 1024 --shares 0,0.45 --halves 0,1 --host 2>&1 | grep -v "^USDT" | tee "$OUT/hostpy_1024.log" || status=1
fi
if has x2cells; then
  python3 -m strata_mgpu sweep $MODEL --devices 0,1 --max-vram 16,16 --resident-experts 0 --prompt-tokens 1024,2048 \
    --shares 0,0.45,0.47,0.5 --runs 5 --json "$OUT/sweep_cells.json" 2>&1 | tee "$OUT/sweep_cells.log" | tail -12 || status=1
  python3 -m strata_mgpu sweep $MODEL --devices 0,0 --max-vram 8,8 --prompt-tokens 1024,4096,8192 \
    --shares 0,0.3,0.45 --runs 2 --json "$OUT/sweep_onecard.json" 2>&1 | tee "$OUT/sweep_onecard.log" | tail -12 || status=1
fi
if has x2oom; then  # the sweep cell that ran out of memory at 8,8 (fragmentation?), with expandable segments
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m strata_mgpu sweep $MODEL --devices 0,1 --max-vram 8,8 \
    --prompt-tokens 6144,8192 --shares 0,0.3 --runs 2 2>&1 | tee "$OUT/oom_expandable.log" | grep -v "^ " | tail -8 \
    || status=1
fi
if has x2final; then
  bench long16two4k $X2 --prompt-tokens 32768 --chunk-size 4096 --decode-tokens 0 --runs 2
  bench x2dec_final $X2 --prompt-tokens 1024 --decode-tokens 128 --runs 1 --server-decode 1,8
  bench long40k --devices 0 --max-vram 16 --prompt-tokens 40000 --decode-tokens 32 --runs 1
fi
wait_healthy() {  # port, pid: until the server on the port answers /health with 200 (or its process ends)
  for _ in $(seq 1 300); do
    python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$1/health').status_code != 200)" \
      2> /dev/null && return
    kill -0 $2 2> /dev/null || return
    sleep 1
  done
}
serve_probe() {  # name, serve args...: a server in the background, the probe, then SIGTERM
  local name=$1; shift
  local probe_args=${PROBE_ARGS:-"--prompt-tokens 1500,3000,6000 --max-tokens 128 --chats 8"}
  local port=$((8100 + RANDOM % 500))
  python3 -m strata_mgpu serve $MODEL "$@" --port $port > "$OUT/serve_$name.log" 2>&1 &
  local pid=$!
  wait_healthy $port $pid
  python3 -m strata_mgpu.tools.serve_probe "http://127.0.0.1:$port" $probe_args \
    --json "$OUT/serve_$name.json" 2>&1 | tee "$OUT/probe_$name.log" || status=1
  kill $pid 2> /dev/null; wait $pid 2> /dev/null || true
}
has serve40 && serve_probe one40 --max-vram 40
trace() {  # name, serve args...: a server in the background, tools/agent_trace, then SIGTERM
  local name=$1; shift
  local port=$((8600 + RANDOM % 300))
  python3 -m strata_mgpu serve $MODEL "$@" --port $port > "$OUT/serve_$name.log" 2>&1 &
  local pid=$!
  wait_healthy $port $pid
  python3 -m strata_mgpu.tools.agent_trace "http://127.0.0.1:$port" ${TRACE_ARGS:-} \
    --json "$OUT/trace_$name.json" 2>&1 | tee "$OUT/trace_$name.log" || status=1
  kill $pid 2> /dev/null; wait $pid 2> /dev/null || true
}
if has prefix; then
  python3 -m strata_mgpu.tools.prefix_restore $MODEL --tokens 32768 --json "$OUT/prefix_restore.json" 2>&1 \
    | tee "$OUT/prefix_restore.log" || status=1
  trace one16 --max-vram 16 --ctx-size 32768
  trace one40 --max-vram 40 --ctx-size 32768
  TRACE_ARGS="--sessions 1" trace one16nocache --max-vram 16 --ctx-size 32768 --no-prefix-cache
fi
if has prefixkv; then  # four sessions at once with KV cells for all of them (--kv-tokens), at 40 and 16
  TRACE_ARGS="--sessions 4" trace one40kv --max-vram 40 --ctx-size 32768 --kv-tokens 98304
  TRACE_ARGS="--sessions 4" trace one16kv --max-vram 16 --ctx-size 32768 --kv-tokens 98304
fi
if has attn; then
  for cached in 4096 20000; do
    python3 scripts/attn_probe.py --chunk 2048 --cached $cached 2>&1 | tee -a "$OUT/attn_probe.log" || status=1
  done
fi
if has cmp42; then
  for round in 1 2; do
    bench "cmp_pool_$round" --max-vram 40 --prompt-tokens 2048,8192 --decode-tokens 128 --runs 3 --decode-batch 1,8
    # from inside it: `python3 -m` puts the working directory first on the path
    (cd .prepool && PYTHONPATH=/tmp/site bench "cmp_prepool_$round" --max-vram 40 --prompt-tokens 2048,8192 \
      --decode-tokens 128 --runs 3 --decode-batch 1,8)
  done
fi
if has pool42; then
  POOL_TRACE="--turns 6 --system-tokens 3072 --turn-tokens 2700 --answer-tokens 96"
  TRACE_ARGS="--sessions 4 $POOL_TRACE" trace pool40 --max-vram 40 --ctx-size 32768 --kv-tokens 131072
  TRACE_ARGS="--sessions 4 $POOL_TRACE" trace pool16 --max-vram 16 --ctx-size 32768
  TRACE_ARGS="--sessions 16 $POOL_TRACE" trace pool40x16 --max-vram 40 --ctx-size 32768 --kv-tokens 131072
fi
if has llama; then  # the same traces against llama-server (.llama/llama-server, carried): all on the card, and
  # at about 16 GiB with the experts of its first layers on the host's cores (--n-cpu-moe)
  [ -x .llama/llama-server ] || { xz -dc .llama/llama-server.xz > .llama/llama-server && chmod +x .llama/llama-server; }
  export LD_LIBRARY_PATH=$(python3 -c "import nvidia, os; print(':'.join(os.path.join(p, 'cu13/lib') for p in nvidia.__path__))"):${LD_LIBRARY_PATH:-}
  llama_trace() {  # name, llama-server args...
    local name=$1; shift
    local port=$((8900 + RANDOM % 90))
    .llama/llama-server -m $MODEL --port $port -c 32768 -np 1 -ngl 99 "$@" > "$OUT/llama_$name.log" 2>&1 &
    local pid=$!
    wait_healthy $port $pid
    nvidia-smi --query-gpu=memory.used --format=csv >> "$OUT/llama_$name.log"
    python3 -m strata_mgpu.tools.agent_trace "http://127.0.0.1:$port" ${TRACE_ARGS:-} \
      --json "$OUT/trace_llama_$name.json" 2>&1 | tee "$OUT/trace_llama_$name.log" || status=1
    kill $pid 2> /dev/null; wait $pid 2> /dev/null || true
  }
  TRACE_ARGS="--sessions 1" llama_trace all -fa on
  TRACE_ARGS="--sessions 1" llama_trace cpumoe18 -fa on --n-cpu-moe 18
fi
has x2serve && serve_probe two16 --devices 0,1 --layer-split auto --max-vram 16,16
has serve16long && PROBE_ARGS="--prompt-tokens 1000,32000,40000 --max-tokens 64 --chats 8" serve_probe one16long --max-vram 16
if has graphs8; then
  STRATA_DECODE_GRAPH_BATCH=1 bench graphs_off --max-vram 40 --prompt-tokens 1024 --decode-tokens 128 --runs 1 --server-decode 1,8 --decode-batch 1,8
  STRATA_DECODE_GRAPH_BATCH=8 bench graphs_on --max-vram 40 --prompt-tokens 1024 --decode-tokens 128 --runs 1 \
    --server-decode 1,8 --decode-batch 1,8
fi
if has dec32k; then
  for ctx in 1024 32768; do
    bench dec${ctx}_40 --max-vram 40 --prompt-tokens 1024 --decode-context $ctx --decode-tokens 64 --runs 1
    bench dec${ctx}_16 --max-vram 16 --prompt-tokens 1024 --decode-context $ctx --decode-tokens 64 --runs 1
  done
fi
if has fewrows; then
  for rows in auto 16 1 64; do
    STRATA_GATHER_ROWS=$rows bench "fewrows_$rows" --max-vram 16 --prompt-tokens 1,8,14,16,24,32,48,64 \
      --decode-tokens 0 --runs 5
  done
fi
if has hyb; then
  [ -n "$genh_pid" ] && wait $genh_pid
  MODEL=$HMODEL bench hyb16 --max-vram 16 --prompt-tokens 1024,4096 --decode-tokens 64 --runs 2
  MODEL=$HMODEL TRACE_ARGS="--sessions 1 --turns 10 --system-tokens 3072 --turn-tokens 1536 --answer-tokens 96" \
    trace hyb40 --max-vram 40 --ctx-size 32768
  MODEL=$HMODEL bench hyb40 --max-vram 40 --prompt-tokens 4096 --decode-tokens 64 --runs 2
fi
if has delta; then  # the DeltaNet prompt scan: fla-core's kernels against the plain scan, a layer and a whole bench
  python3 scripts/delta_probe.py --tokens 1024,4096 2>&1 | tee "$OUT/delta_probe.log" || status=1
  [ -n "$genh_pid" ] && wait $genh_pid
  STRATA_DELTA_SCAN=torch MODEL=$HMODEL bench hyb16_torch --max-vram 16 --prompt-tokens 1024,4096 --decode-tokens 0 --runs 2
  MODEL=$HMODEL bench hyb16_fla --max-vram 16 --prompt-tokens 1024,4096 --decode-tokens 0 --runs 2
fi
if has llamahyb; then  # llama-bench on the same hybrid file: all on the card, and its first layers' experts on the
  # host's cores (--n-cpu-moe) near the 16 GiB of hyb16; VRAM in use sampled beside each run
  [ -n "$genh_pid" ] && wait $genh_pid
  [ -x .llamacuda/llama-bench ] || tar xJf .llamacuda/llamacuda.tar.xz -C .llamacuda
  LLAMA_LIBS=$(python3 -c "import nvidia, os; print(':'.join(os.path.join(p, 'cu13/lib') for p in nvidia.__path__))")
  for ncmoe in ${NCMOE:-0 16 18}; do
    nvidia-smi --query-gpu=memory.used --format=csv,noheader -lms 250 > "$OUT/llamahyb_mem_$ncmoe.txt" &
    smi=$!
    LD_LIBRARY_PATH=$PWD/.llamacuda:$LLAMA_LIBS:${LD_LIBRARY_PATH:-} .llamacuda/llama-bench -m $HMODEL -ngl 99 -fa 1 \
      -p 1024,4096 -n 64 -r 2 -ub 4096 -b 4096 --n-cpu-moe $ncmoe -lm none -t 16 2>&1 \
      | tee "$OUT/llamahyb_$ncmoe.log" | grep -E "^\|" || status=1
    kill $smi 2> /dev/null; wait $smi 2> /dev/null || true
    echo "peak VRAM in use (MiB): $(sort -n "$OUT/llamahyb_mem_$ncmoe.txt" | tail -1)" | tee -a "$OUT/llamahyb_$ncmoe.log"
  done
fi
if has resid; then
  for swaps in 0 4 16; do
    STRATA_RESIDENCY_SWAPS=$swaps bench "resid_s$swaps" --max-vram 16 --prompt-tokens 1024 --decode-tokens 256 --runs 1
  done
  for half in 128 2048; do
    STRATA_RESIDENCY_HALF_LIFE=$half bench "resid_h$half" --max-vram 16 --prompt-tokens 1024 --decode-tokens 256 \
      --runs 1
  done
  python3 -m strata_mgpu.tools.router_predict $MODEL --max-vram 40 --prompts 4 --tokens 512 --slots 64 \
    > "$OUT/router_predict.log" 2>&1 || status=1
  tail -5 "$OUT/router_predict.log"
fi
if has kbench; then
  python3 -m strata_mgpu.tools.bench_kernels --json "$OUT/kbench.json" 2>&1 | tee "$OUT/kbench.log" || status=1
  python3 -m strata_mgpu.tools.bench_kernels --host-share 0.5 --contexts 1024 --expert-rows 16 \
    --json "$OUT/kbench_host.json" 2>&1 \
    | tee "$OUT/kbench_host.log" || status=1
fi
if has prof40; then
  python3 -m strata_mgpu.tools.profile_decode $MODEL --max-vram 40 --steps 16 > "$OUT/prof40_b1.log" 2>&1 || status=1
  python3 -m strata_mgpu.tools.profile_decode $MODEL --max-vram 40 --steps 8 --batch 8 > "$OUT/prof40_b8.log" 2>&1 || status=1
  STRATA_DECODE_GRAPH_BATCH=8 python3 -m strata_mgpu.tools.profile_decode $MODEL --max-vram 40 --steps 8 --batch 8 \
    > "$OUT/prof40_b8g.log" 2>&1 || status=1
  head -3 "$OUT"/prof40_*.log
fi
# few files come back from the device machine: everything but the summary files in one archive
(cd "$OUT" && tar czf results.tgz --exclude=results.tgz --exclude=gpu.txt --exclude=gpu_tests.log \
  --exclude=topo.log -- * && find . -maxdepth 1 -type f ! -name results.tgz ! -name gpu.txt ! -name gpu_tests.log \
  ! -name topo.log -delete) || true
exit $status
