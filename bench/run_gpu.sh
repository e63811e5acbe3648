#!/usr/bin/env bash
# Everything GPU in one go: the gpu tests (transfer layer and daemons), the demo on CUDA, then
# both benchmarks. Logs and JSON under $OUT
# (default ./gpu-results); few files, since the device tool brings back at most 8.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.log"
status=0
timeout 420 "$PY" -m pytest -m gpu tests -q -rs \
  -p no:cacheprovider --timeout 180 2>&1 | tee "$OUT/gpu_tests.log" || status=1
# the whole system on the GPU, checked against the reference (bf16 default dtype)
timeout 180 "$PY" -m common.app.cli demo --device cuda:0 --prompts 16 2>&1 | tee "$OUT/demo.log" || status=1
timeout 120 "$PY" bench/gpu_handoff.py --out "$OUT/gpu_handoff.json" 2>&1 | tee -a "$OUT/bench.log" || status=1
timeout 120 "$PY" bench/gpu_pull.py --out "$OUT/gpu_pull.json" 2>&1 | tee -a "$OUT/bench.log" || status=1
exit $status
