#!/usr/bin/env bash
# Issues 24 and 22 on one GPU in one call, most important first, each step under its own timeout
# (a run cut short still brings back the steps before): STEPS (comma-separated, default all) picks
#   tests   the GPU tests of the decode step (overlapped or not), the daemons' fp32 reference,
#           the kernels and the prefill graphs
#   engine  bench/engine.py (one process; also writes the 1.1B checkpoint to $CKPT)
#   nano    bench/serve.py --nano through the daemons, --overlap-steps on, always, off ($NANO; an
#           entry MODE+MS gives the decode --prefill-first-ms MS, MODE alone 0: "on on+50 on on+50")
#   pipe    nano through the daemons, the prefill's --pipeline-forwards on against off,
#           alternated $PIPE_ROUNDS times (default 2), each with its idle between forwards
#   nanomps the same, both daemons under MPS ($NANOMPS, entries as in $NANO; default on)
#   kernel  bench/context_kernel.py (the paged-context kernel, new against old), when present
#   prefix  bench/serve.py --target cache, the shared-prefix workload (issue 22's first target),
#           once per --overlap-steps mode in $PREFIX (default on; MODE+MS as in $NANO)
#   prefixmps  the same with both daemons under MPS
#   goodput bench/serve.py's rate sweep with SLO bounds, daemons and one process (issue 24 item 5)
#   cold    a fresh pair's first burst against its later ones (issue 24 item 4)
#   tcp     16 × 2000-token prompts at 2/s, 8 out: the Unix socket against a TCP link with NIXL
#           push, early and late handoff (issue 24 item 3: TTFT ≤ 1.10×, 2nd token ≤ 1.2×)
#   warm    the same 16 × 2000 over the Unix socket, --warm-wait on against off (issue 24
#           item 2: the 2nd token), alternated twice
#   launch  the same 16 × 2000, the prefill's --launch-early (KV_LAUNCHED) on against off,
#           alternated $WARM_ROUNDS times (default 2)
#   launchmps  the same with both daemons under MPS (the GPU's switch between the two
#           processes, ~0.55 ms without MPS, is on the 2nd token's path: bench/pending_wait.py)
#   graphs  a 2,000-token prompt's forward replayed from a CUDA graph against launched
#           (bench/prefill_context.py, one process), then the same 16 × 2000 through the
#           daemons with --prefill-graph-tokens $GRAPH_TOKENS (default 4096) against 1024,
#           alternated $WARM_ROUNDS times
#   api     bench/serve.py --nano --target served: the pair's socket, then its HTTP API, whose
#           CPU per output token and busiest process's share of a core the bench prints (is one
#           API process enough at the pair's ~44k tokens/s?), once per --workers in $API_WORKERS
#           (default "1 4")
#   shapes  (not in the default STEPS) bench/engine.py at the 8B shapes, one process, no HF side:
#           --shape llama3-8b, then qwen3-8b ($SHAPES), 64 rows each (issue 41)
#   serve8b (not in the default STEPS) a random Llama-3-8B-shape bf16 checkpoint (built once in
#           $CKPT8), then bench/serve.py per workload in $WORKLOADS (default 2048x512): the
#           daemons against one process at the rates $RATES8 (default 1,2), $REQ8 requests each
#           (default 32), pools sized by --num-blocks auto (each daemon's default
#           --memory-fraction, $MEMFRAC8 for both if set; one process gets the decode's count;
#           $BLOCKS8: a fixed count instead, e.g. 4096 = 8 GiB of KV a daemon), goodput at TTFT
#           p99 <= 2 s and ITL <= 50 ms (issue 41 item 3)
#   new     (not in the default STEPS) the GPU checks of the 2026-12-05 work not yet run or not
#           yet passed there, each under its own limit: structured output (its two gpu tests,
#           which failed on an H200 with no output back, then bench/structured_decode.py at the
#           1.1B shape, overlapped and not), one copy of the weights (--share-weights is off on
#           CUDA until tests/integration/test_gpu_shared_weights.py passes), --num-blocks auto
#           (tests/integration/test_gpu_pool_auto.py), bench/sliding_window.py
#           (what skipping tiles before the window saves) and the host tier's multi-turn serve run
#           (issues 41, 42, 43)
# Everything lands in $OUT/results.tgz (re-made after each step) and $OUT/run.log; the device tool
# brings back at most eight files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
R="$OUT/r"
mkdir -p "$R"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
CKPT="${CKPT:-/tmp/pdkv-llama-1.1b}"
STEPS="${STEPS:-tests,engine,nano,pipe,nanomps,kernel,prefix,prefixmps,goodput,cold,tcp,warm,launch,launchmps,graphs,api}"
log="$OUT/run.log"
want() { [[ ",$STEPS," == *",$1,"* ]]; }
pack() { tar czf "$OUT/results.tgz" -C "$R" . 2>/dev/null; }
step() { echo "== $1 $(date -u +%H:%M:%S)" | tee -a "$log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
git log --oneline -1 2>/dev/null | tee -a "$log"
if [ ! -d "$CKPT" ] && ! want engine; then
  "$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, 'bench'); \
from engine import build_checkpoint; build_checkpoint(Path('$CKPT'))" || exit 1
fi
if want tests; then
  step tests
  # TESTS: other test paths (or -k expressions) instead of these; TESTS_TIMEOUT: the step's limit
  # shellcheck disable=SC2086
  # SIGINT at the limit: pytest then still prints the failures so far (a KILL printed none, and
  # the junit file is written only at the end); the whole output is kept in tests_full.log
  timeout -s INT -k 30 "${TESTS_TIMEOUT:-300}" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
    --timeout 150 -m gpu --junitxml "$R/tests.xml" \
    ${TESTS:-tests/gpu/test_decode_batch_gpu.py tests/integration/test_gpu_daemons.py \
    tests/model/test_kernels.py tests/gpu/test_prefill_graphs_gpu.py} 2>&1 \
    | tee "$R/tests_full.log" | tail -40 | tee -a "$log" > "$R/tests.log"
  pack
fi
if want new; then
  # NEW picks the parts (default all five; together they may pass one call's 10 minutes)
  part() { [[ ",${NEW:-structured,weights,pool,window,tier}," == *",$1,"* ]]; }
  gpu_tests() {  # $1: name, $2: limit (s), the rest: test paths; the failures so far even when
    # cut by the limit, and the daemons' logs of the run (pytest's tmp dirs) in $R/logs_$1
    local name=$1 limit=$2; shift 2
    step "new $name"
    local since="$R/.since_$name"
    touch "$since"
    timeout -s INT -k 30 "$limit" "$PY" -m pytest -q -rfEs --tb=short -p no:cacheprovider \
      --timeout 200 -m gpu "$@" > "$R/new_$name.log" 2>&1
    tail -30 "$R/new_$name.log" | tee -a "$log"
    mkdir -p "$R/logs_$name"
    find "/tmp/pytest-of-$(id -un)" -name '*.log' -size -4M -newer "$since" 2>/dev/null \
      | while read -r f; do cp "$f" "$R/logs_$name/$(echo "${f#/tmp/}" | tr / _)"; done
    pack
  }
  if part structured; then  # 6 variants each (CUDA_VARIANTS): which CUDA feature fails, if any
    gpu_tests structured_daemons "${NEW_TIMEOUT:-300}" tests/integration/test_structured_daemons.py
    gpu_tests structured_checkpoint "${NEW_TIMEOUT:-300}" \
      tests/integration/test_structured_checkpoint.py
    step "new structured_ttft"
    timeout 200 "$PY" bench/structured_ttft.py --model "$CKPT" --device cuda:0 \
      --allow-byte-tokenizer --schemas 30 --out "$R/structured_ttft.json" \
      > "$R/structured_ttft.log" 2>&1
    tail -12 "$R/structured_ttft.log" | tee -a "$log"
    for mode in off always; do
      step "new structured_decode overlap=$mode"
      timeout 150 "$PY" bench/structured_decode.py --device cuda:0 --shape tinyllama-1.1b \
        --batch 1 64 --steps 50 --overlap-steps "$mode" > "$R/structured_decode_$mode.log" 2>&1
      tail -12 "$R/structured_decode_$mode.log" | tee -a "$log"
    done
    pack
  fi
  if part weights; then
    gpu_tests weights "${NEW_TIMEOUT:-240}" tests/integration/test_gpu_shared_weights.py
    step "new shared_weights 1.1B"
    timeout 200 "$PY" bench/shared_weights.py --device cuda:0 --shape tinyllama-1.1b \
      > "$R/shared_weights.log" 2>&1
    tail -12 "$R/shared_weights.log" | tee -a "$log"
    pack
  fi
  if part pool; then  # --num-blocks auto on CUDA: the pools fit the formula, the warm-up the reserve
    gpu_tests pool "${NEW_TIMEOUT:-240}" tests/integration/test_gpu_pool_auto.py
  fi
  if part window; then
    step "new sliding_window"
    timeout 150 "$PY" bench/sliding_window.py --out "$R/sliding_window.json" \
      > "$R/sliding_window.log" 2>&1
    tail -20 "$R/sliding_window.log" | tee -a "$log"
    pack
  fi
  if part tier; then
    step "new tier serve"
    timeout 300 "$PY" bench/serve.py --target tier --turns 8 --requests 32 \
      --prompt-len 1024:1024 --message-len 128:128 --output-len 128:128 --num-blocks 1408 \
      --host-cache-gb 2 --rate 4 --device cuda:0 --model "$CKPT" > "$R/tier_serve.log" 2>&1
    tail -30 "$R/tier_serve.log" | tee -a "$log"
    pack
  fi
fi
if want shapes; then
  for s in ${SHAPES:-llama3-8b qwen3-8b}; do
    step "shapes $s"
    timeout 420 "$PY" bench/engine.py --shape "$s" --out "$R/engine_$s.json" 2>&1 | tail -30 \
      | tee -a "$log"
    pack
  done
fi
if want engine; then
  step engine
  timeout 200 "$PY" bench/engine.py --out "$R/engine.json" --save-checkpoint "$CKPT" 2>&1 \
    | grep -v '^{' | tail -30 | tee -a "$log"
  pack
fi
nano() {  # $1: tag, then the environment for the daemons
  local tag=$1
  shift
  step "nano $tag"
  env "$@" PDKV_BENCH_LOGS="$R/logs_nano_$tag" timeout 150 "$PY" bench/serve.py --model "$CKPT" \
    --device cuda:0 --nano --target daemons --progress 30 --json "$R/nano_$tag.json" \
    > "$R/nano_$tag.log" 2>&1
  grep -E "^daemons|2nd token|KV pulled" "$R/nano_$tag.log" | tail -6 | tee -a "$log"
  gaps "$R/logs_nano_$tag"
  pack
}
gaps() {  # the prefill's idle between queued forwards, from the daemons' logs in $1
  "$PY" bench/forward_gaps.py "$1"/pair*-prefill.log 2>&1 | sed "s|$1/||" | tee -a "$log"
}
pf() { [[ $1 == *+* ]] && echo "${1#*+}" || echo 0; }  # MODE+MS -> MS, MODE -> 0
if want nano; then  # NANO: the --overlap-steps modes to run, in order
  for spec in ${NANO:-on always off}; do
    nano "${spec/+/_pf}" PDKV_OVERLAP_STEPS="${spec%%+*}" PDKV_PREFILL_FIRST_MS="$(pf "$spec")"
  done
fi
if want pipe; then  # --pipeline-forwards on against off, alternated $PIPE_ROUNDS times
  for round in $(seq "${PIPE_ROUNDS:-2}"); do
    for v in 1 0; do
      nano "pipe${v}_$round" PDKV_PIPELINE_FORWARDS=$v
    done
  done
fi
mps_start() {  # every process started after it shares the GPU through MPS; false: no MPS here
  command -v nvidia-cuda-mps-control >/dev/null || return 1
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { mps_stop; return 1; }
}
mps_stop() {
  echo quit | nvidia-cuda-mps-control 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
if want serve8b; then
  CKPT8="${CKPT8:-/tmp/pdkv-llama3.1-8b-shape}"  # a new shape: a new name
  if [ ! -d "$CKPT8" ]; then
    step "serve8b checkpoint"
    "$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, 'bench'); \
from engine import build_checkpoint; build_checkpoint(Path('$CKPT8'), 'llama3-8b')" 2>&1 \
      | tail -3 | tee -a "$log"
  fi
  # SERVE8_MPS=1: both daemons (and the one process) under MPS, as in nanomps
  mps=""; [ "${SERVE8_MPS:-0}" = 1 ] && mps_start && mps="_mps"
  frac8=()  # --memory-fraction goes with auto only
  [ -z "${BLOCKS8:-}" ] && [ -n "${MEMFRAC8:-}" ] && frac8=(--memory-fraction "$MEMFRAC8")
  for w in ${WORKLOADS:-2048x512}; do
    step "serve8b $w$mps"
    timeout "${SERVE8_TIMEOUT:-480}" "$PY" bench/serve.py --model "$CKPT8" --device cuda:0 \
      --workload "$w" --num-blocks "${BLOCKS8:-auto}" --requests "${REQ8:-32}" \
      "${frac8[@]}" \
      --sweep "${RATES8:-1,2}" --slo-ttft-ms 2000 --slo-itl-ms 50 --progress 30 \
      --plot "$R/serve8b_$w${mps}_sweep.png" --goodput-plot "$R/serve8b_$w${mps}_goodput.png" \
      --json "$R/serve8b_$w$mps.json" > "$R/serve8b_$w$mps.log" 2>&1
    grep -vE "^\s+(daemons|local).* @ |warm-up" "$R/serve8b_$w$mps.log" | tail -30 | tee -a "$log"
    pack
  done
  [ -n "$mps" ] && mps_stop
fi
if want nanomps && mps_start; then  # both daemons under MPS; NANOMPS: entries as in NANO
  for spec in ${NANOMPS:-on}; do
    nano "mps_${spec/+/_pf}" PDKV_OVERLAP_STEPS="${spec%%+*}" PDKV_PREFILL_FIRST_MS="$(pf "$spec")"
  done
  mps_stop
fi
if want kernel && [ -f bench/context_kernel.py ]; then
  step kernel
  timeout 100 "$PY" bench/context_kernel.py --out "$R/context_kernel.json" 2>&1 | tail -7 \
    | tee -a "$log"
  timeout 100 "$PY" bench/context_kernel.py --table-blocks 128 --out "$R/context_kernel_w128.json" \
    2>&1 | tail -7 | tee -a "$log"
  timeout 100 "$PY" bench/context_kernel.py --table-blocks 128 --rows 64 \
    --out "$R/context_kernel_w128_r64.json" 2>&1 | tail -7 | tee -a "$log"
  timeout 100 "$PY" bench/prefill_context.py --model "$CKPT" --prefix 1536 --own 128 \
    --out "$R/prefill_context.json" 2>&1 | tail -12 | tee -a "$log"
  pack
fi
prefix() {  # $1: tag, $2: --overlap-steps MODE[+MS]
  local tag=$1 mode=$2
  step "prefix $tag"
  PDKV_OVERLAP_STEPS=${mode%%+*} PDKV_PREFILL_FIRST_MS=$(pf "$mode") timeout 240 "$PY" bench/serve.py --model "$CKPT" --device cuda:0 \
    --num-blocks 4096 --target cache --shared-prefix 1536 --prompt-len 128:128 \
    --output-len 64:64 --rate 20 --requests 200 --progress 30 --json "$R/prefix_$tag.json" \
    > "$R/prefix_$tag.log" 2>&1
  grep -E "^daemons|2nd token|KV pulled|same tokens" "$R/prefix_$tag.log" | tee -a "$log"
  pack
}
if want prefix; then  # PREFIX: the --overlap-steps modes to run it with
  for mode in ${PREFIX:-on}; do
    prefix "${mode/+/_pf}" "$mode"
  done
fi
if want prefixmps && mps_start; then  # the same with both daemons under MPS: the prefill's
  # forward then need not wait for the decode's step to yield the GPU
  for mode in ${PREFIX:-on}; do
    prefix "mps_${mode/+/_pf}" "$mode"
  done
  mps_stop
fi
if want goodput; then  # issue 24 item 5: daemons against one process over a rate sweep
  step "goodput prefill-first-ms ${PDKV_PREFILL_FIRST_MS:-default}"
  timeout 300 "$PY" bench/serve.py --model "$CKPT" --device cuda:0 --num-blocks 8192 \
    --requests 64 --prompt-len 128:1024 --output-len 32:256 --sweep "${RATES:-8,16,32,64}" \
    --slo-ttft-ms "${SLO_TTFT_MS:-100}" --slo-itl-ms "${SLO_ITL_MS:-4}" --progress 30 \
    --plot "$R/goodput_sweep.png" --goodput-plot "$R/goodput.png" --json "$R/goodput.json" \
    > "$R/goodput.log" 2>&1
  grep -vE "^\s+(daemons|local).* @ |warm-up" "$R/goodput.log" | tail -30 | tee -a "$log"
  pack
fi
if want api; then  # the HTTP API at the pair's full rate, with each --workers in $API_WORKERS
  for w in ${API_WORKERS:-1 4}; do
    step "api workers=$w"
    PDKV_BENCH_LOGS="$R/logs_api$w" timeout 300 "$PY" bench/serve.py --model "$CKPT" \
      --device cuda:0 --nano --target served --api-workers "$w" --progress 30 \
      --json "$R/api$w.json" > "$R/api$w.log" 2>&1
    grep -vE "warm-up| @ " "$R/api$w.log" | tail -12 | tee -a "$log"
    gaps "$R/logs_api$w"
    pack
  done
fi
if want cold; then
  step cold
  # a kernel cache of its own, empty: the pair compiles everything at its start; no prefix
  # cache, since every burst sends the same prompts; no warm-up request: the 1st burst is cold
  PDKV_KERNEL_CACHE_DIR="$(mktemp -d)" PDKV_PREFIX_CACHE=0 timeout 200 "$PY" bench/serve.py \
    --model "$CKPT" --device cuda:0 --num-blocks 4096 --target daemons --requests 16 \
    --prompt-len 512:512 --output-len 128:128 --warmup 0 --sweep inf,inf,inf,inf \
    --plot "$R/cold.png" --json "$R/cold.json" > "$R/cold.log" 2>&1
  tail -20 "$R/cold.log" | tee -a "$log"
  pack
fi
if want tcp; then  # issue 24 item 3, alternated twice
  for round in 1 2; do
    for run in uds:1 push:1 push:0; do
      link=${run%:*} early=${run#*:}
      step "tcp $link early=$early round $round"
      PDKV_EARLY_HANDOFF=$early timeout 120 "$PY" bench/serve.py --model "$CKPT" --device cuda:0 \
        --num-blocks 4096 --target daemons --link "$link" --requests 16 --rate 2 \
        --prompt-len 2000:2000 --output-len 8:8 --progress 30 \
        --json "$R/tcp_${link}_${early}_$round.json" > "$R/tcp_${link}_${early}_$round.log" 2>&1
      grep -E "^daemons|2nd token|handoff_us" "$R/tcp_${link}_${early}_$round.log" | tee -a "$log"
      pack
    done
  done
fi
second_token() {  # $1: step name, $2: the daemons' setting, $3: its values (default "on off"),
  # alternated $WARM_ROUNDS times
  local name=$1 var=$2 values=${3:-on off} round value
  for round in $(seq "${WARM_ROUNDS:-2}"); do
    for value in $values; do
      step "$name $value round $round"
      env "$var=$value" timeout 120 "$PY" bench/serve.py --model "$CKPT" --device cuda:0 \
        --num-blocks 4096 --target daemons --requests 16 --rate 2 \
        --prompt-len 2000:2000 --output-len 8:8 --progress 30 \
        --json "$R/${name}_${value}_$round.json" > "$R/${name}_${value}_$round.log" 2>&1
      grep -E "^daemons|2nd token" "$R/${name}_${value}_$round.log" | tee -a "$log"
      grep -oE "(launch_(lead|send|ahead)|first_(launch|prep|fill|read|sync)|prefill_forward|usable|pull|enqueue|join)_us \
[0-9.-]+/[0-9.-]+" "$R/${name}_${value}_$round.log" | tee -a "$log"
      pack
    done
  done
}
# issue 24 item 2 (the 2nd token): --warm-wait, then the prefill's --launch-early (KV_LAUNCHED)
want warm && second_token warm PDKV_WARM_WAIT
want launch && second_token launch PDKV_LAUNCH_EARLY
if want launchmps && mps_start; then  # the same under MPS: no context switch between the two
  second_token launchmps PDKV_LAUNCH_EARLY
  mps_stop
fi
if want graphs; then  # a long prompt's forward from a CUDA graph: TTFT, and KV_LAUNCHED's lead
  step graphs
  timeout 150 "$PY" bench/prefill_context.py --model "$CKPT" --prefix 1872 --own 128 \
    --graph-tokens 2048 --profile --out "$R/prefill_context_2048.json" \
    > "$R/prefill_context_2048.log" 2>&1
  grep '^{' "$R/prefill_context_2048.log" | tee -a "$log"  # the medians; the profiles stay there
  pack
  second_token graphs PDKV_PREFILL_GRAPH_TOKENS "${GRAPH_TOKENS:-4096} 1024"
fi
pack
