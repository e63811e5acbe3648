#!/usr/bin/env bash
# Everything GPU in one go, most important first (a run cut short still brings back the early parts):
# the gpu tests (kernels, runner, transfer layer, daemons), the demo on CUDA, the handoff
# microbenchmarks, the engine against HF transformers at TinyLlama-1.1B's shape, then the serving
# bench at that shape (daemons and one process). Logs and JSON under $OUT (default ./gpu-results): at most eight
# files, since the device tool brings back no more.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
CKPT="${CKPT:-/tmp/pdkv-llama-1.1b}"
log="$OUT/bench.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
status=0
timeout 260 "$PY" -m pytest -m gpu tests -q -rs \
  -p no:cacheprovider --timeout 180 2>&1 | tee "$OUT/gpu_tests.log" || status=1
# the whole system on the GPU, checked against the reference (bf16 default dtype)
timeout 90 "$PY" -m pdkv.cli demo --device cuda:0 --prompts 16 2>&1 | tee "$OUT/demo.log" \
  || status=1
timeout 40 "$PY" bench/gpu_handoff.py --out "$OUT/gpu_handoff.json" 2>&1 | tee -a "$log" || status=1
timeout 40 "$PY" bench/gpu_pull.py --out "$OUT/gpu_pull.json" 2>&1 | tee -a "$log" || status=1
timeout 150 "$PY" bench/engine.py --out "$OUT/engine.json" --save-checkpoint "$CKPT" 2>&1 \
  | tee -a "$log" || status=1
if [ -d "$CKPT" ]; then
  timeout 150 "$PY" bench/serve.py --model "$CKPT" --device cuda:0 --num-blocks 8192 \
    --requests 48 --prompt-len 128:1024 --output-len 32:256 --sweep 16,inf \
    --json "$OUT/serve.json" --plot "$OUT/serve_sweep.png" --progress 10 2>&1 | tee -a "$log" \
    || status=1
fi
exit $status
