#!/usr/bin/env bash
# The handoff issue's figures at TinyLlama-1.1B's shape on one GPU, both daemons on cuda:0, against
# the single-process engine, without and then with MPS (when nvidia-cuda-mps-control is there):
#   long: 2000-token prompts one at a time (TTFT; the first inter-token gap is the 2nd token)
#   long16: 16 × 2040-token prompts at once (the handoff at 16 in flight; 2040 + 8 fits the
#   shape's 2048 positions)
#   burst: 16 × (512 + 128) all at once (TTFT spread, throughput)
# MPS=0 skips the MPS half. JSON per case under $OUT (default ./gpu-results); the tables go to $OUT/serve_cases.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
CKPT="${CKPT:-/tmp/pdkv-llama-1.1b}"
log="$OUT/serve_cases.log"
if [ ! -d "$CKPT" ]; then
  "$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, 'bench'); \
from engine import build_checkpoint; build_checkpoint(Path('$CKPT'))" || exit 1
fi
common=(--model "$CKPT" --device cuda:0 --num-blocks 4096 --progress 30)
# MAX_PREFILL_TOKENS: the prefill daemon's batched-prefill budget (and the local engine's), when set
[ -n "${MAX_PREFILL_TOKENS:-}" ] && common+=(--max-prefill-tokens "$MAX_PREFILL_TOKENS")
cases() {  # $1: tag
  timeout 120 "$PY" bench/serve.py "${common[@]}" --requests 16 --rate 2 --prompt-len 2000:2000 \
    --output-len 8:8 --json "$OUT/long_$1.json" 2>&1 | tee -a "$log"
  timeout 120 "$PY" bench/serve.py "${common[@]}" --requests 16 --rate inf --prompt-len 2040:2040 \
    --output-len 8:8 --json "$OUT/long16_$1.json" 2>&1 | tee -a "$log"
  timeout 120 "$PY" bench/serve.py "${common[@]}" --requests 16 --rate inf --prompt-len 512:512 \
    --output-len 128:128 --json "$OUT/burst_$1.json" 2>&1 | tee -a "$log"
}
echo "== without MPS" | tee -a "$log"
cases plain
if [ "${MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "== with MPS" | tee -a "$log"
  cases mps
  echo quit | nvidia-cuda-mps-control
fi
