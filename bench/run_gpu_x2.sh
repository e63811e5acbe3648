#!/usr/bin/env bash
# The two-GPU issue's run on nvidia-h200-x2, in one call, most important first: the gpu suite (its
# "needs 2 GPUs" tests run here), the demo with prefill on cuda:0 and decode on cuda:1, the pull
# across GPUs against a plain peer copy, then the serving cases at TinyLlama-1.1B's shape with the
# decode on cuda:1 against both daemons on cuda:0 (and the single-process engine). Logs and JSON
# under $OUT (default ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
CKPT="${CKPT:-/tmp/pdkv-llama-1.1b}"
log="$OUT/x2.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
nvidia-smi topo -m 2>&1 | head -4 | tee -a "$log"
status=0
timeout 260 "$PY" -m pytest -m gpu tests -q -rs -p no:cacheprovider --timeout 180 2>&1 \
  | tee "$OUT/gpu_tests.log" || status=1
timeout 90 "$PY" -m pdkv.cli demo --device cuda:0 --decode-device cuda:1 --prompts 16 2>&1 \
  | tee "$OUT/demo_x2.log" || status=1
timeout 60 "$PY" bench/gpu_pull.py --out "$OUT/gpu_pull.json" 2>&1 | tee -a "$log" || status=1
if [ ! -d "$CKPT" ]; then
  "$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, 'bench'); \
from engine import build_checkpoint; build_checkpoint(Path('$CKPT'))" || exit 1
fi
common=(--model "$CKPT" --device cuda:0 --num-blocks 4096 --progress 30)
for where in 1gpu 2gpu; do
  extra=()
  [ "$where" = 2gpu ] && extra=(--decode-device cuda:1 --target daemons)
  echo "== $where" | tee -a "$log"
  timeout 120 "$PY" bench/serve.py "${common[@]}" "${extra[@]}" --requests 16 --rate 2 \
    --prompt-len 2000:2000 --output-len 8:8 --json "$OUT/long_$where.json" 2>&1 | tee -a "$log"
  timeout 120 "$PY" bench/serve.py "${common[@]}" "${extra[@]}" --requests 16 --rate inf \
    --prompt-len 512:512 --output-len 128:128 --json "$OUT/burst_$where.json" 2>&1 | tee -a "$log"
done
exit $status
