#!/usr/bin/env bash
# Side by side on one GPU: the 2000-token case of run_gpu_serve.sh (16 prompts at 2/s, 8 tokens
# out, both daemons on cuda:0) through the daemons of this checkout and of OLD, a source tree of
# an earlier commit (`git archive REV | tar -x -C OLD`), alternating ROUNDS times (default 2), each
# tree installed editable in turn (its extension built by its own CMake). The local engine runs
# once, with this checkout. JSON per run under $OUT (default ./gpu-results), the tables in
# $OUT/ab.log (REQUESTS per run, default 16); `bench/ab_summary.py $OUT/ab_*.json` prints the 2nd token and the decode's stages.
# CASE=nano runs nano-vllm's burst instead (256 sequences, `bench/serve.py --nano`; no local run).
#   bench/run_gpu_ab.sh OLD_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OLD="$(cd "${1:?usage: run_gpu_ab.sh OLD_DIR}" && pwd)"
OUT="$(mkdir -p "${OUT:-gpu-results}" && cd "${OUT:-gpu-results}" && pwd)"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
CKPT="${CKPT:-/tmp/pdkv-llama-1.1b}"
log="$OUT/ab.log"
if [ ! -d "$CKPT" ]; then
  "$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, 'bench'); \
from engine import build_checkpoint; build_checkpoint(Path('$CKPT'))" || exit 1
fi
install() {  # $1: tree
  (cd "$1" && "$PY" -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | tail -3)
}
long() {  # $1: tree, $2: tag, $3: target
  echo "== $2 ($3)" | tee -a "$log"
  local work=(--num-blocks 4096 --requests "${REQUESTS:-16}" --rate 2 --prompt-len 2000:2000 --output-len 8:8)
  [ "${CASE:-long}" = nano ] && work=(--nano)
  (cd "$1" && timeout 170 "$PY" bench/serve.py --model "$CKPT" --device cuda:0 "${work[@]}" \
    --target "$3" --progress 30 --json "$OUT/ab_$2.json") 2>&1 | tee -a "$log"
}
status=0
for i in $(seq 1 "${ROUNDS:-2}"); do
  install "$ROOT" || status=1
  if [ "$i" = 1 ] && [ "${CASE:-long}" != nano ]; then long "$ROOT" local local || status=1; fi
  long "$ROOT" "new$i" daemons || status=1
  install "$OLD" || status=1
  long "$OLD" "old$i" daemons || status=1
done
install "$ROOT" || status=1
exit $status
