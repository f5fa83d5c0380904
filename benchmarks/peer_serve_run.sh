#!/usr/bin/env bash
# The peer on the GPU machine: `vllm serve` on the same random-weight checkpoint serve_gpu_run.sh exports,
# timed to its first answer, then driven by the same client and cases (benchmarks/peer_client.py).
#
#   bash benchmarks/peer_serve_run.sh SHAPE CASE...        # e.g. llama-8b c1:greedy c64:top-p u256:top-p
#
# Needs vLLM in PEER_SITE (default /tmp/peer-site: benchmarks/peer_stage.sh --install), which is on the
# PYTHONPATH of vLLM's processes only. Environment: OUT (default /tmp/peer-serve), WORK (default
# /tmp/flare-work: the checkpoint is shared with serve_gpu_run.sh, written here when missing), PORT (8021),
# VLLM_FLAGS (more `vllm serve` flags, e.g. "--quantization fp8"; recorded in OUT/peer-device.txt).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/peer-serve}
WORK=${WORK:-/tmp/flare-work}
PORT=${PORT:-8021}
PEER_SITE=${PEER_SITE:-/tmp/peer-site}
SHAPE=${1:?usage: peer_serve_run.sh SHAPE CASE...}
shift
CKPT=$WORK/ckpt-${SHAPE/:/-}
mkdir -p "$OUT" "$WORK/home"
export HOME=$WORK/home PYTHONUNBUFFERED=1
log() { echo "== $(date -u +%H:%M:%S) $*"; }

if [ ! -f "$CKPT/config.json" ]; then
  log "checkpoint $SHAPE"
  "$PY" benchmarks/write_bench_checkpoint.py "$CKPT" "$SHAPE" || exit 1
fi
{ echo "vllm $(PYTHONPATH=$PEER_SITE "$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)"
  echo "vllm serve flags: ${VLLM_FLAGS:-none}"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
} | tee "$OUT/peer-device.txt"

log "vllm serve $SHAPE ${VLLM_FLAGS:-}"
started=$(date +%s.%N)
# shellcheck disable=SC2086  # VLLM_FLAGS is a list of flags
PYTHONPATH=$PEER_SITE setsid "$PY" -m vllm.entrypoints.cli.main serve "$CKPT" --served-model-name "$SHAPE" \
  --port "$PORT" ${VLLM_FLAGS:-} > "$OUT/vllm-server.log" 2>&1 &
SERVER_PID=$!
stop_server() { kill -TERM -- -"$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; }
trap stop_server EXIT
ready=
for _ in $(seq 1 ${START_WAIT:-2400}); do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "vllm exited"; tail -40 "$OUT/vllm-server.log"; exit 1; fi
  if curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
       -d '{"model":"'"$SHAPE"'","prompt":"w5 w6","max_tokens":4}' -o /dev/null 2>/dev/null; then
    ready=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'); break
  fi
  sleep 0.25
done
if [ -z "$ready" ]; then echo "vllm did not answer"; tail -40 "$OUT/vllm-server.log"; exit 1; fi
echo "vllm start-up to first answer: ${ready}s" | tee -a "$OUT/peer-device.txt"
grep -iE "memory|KV cache|graph|compil" "$OUT/vllm-server.log" | cut -c1-200 | head -20

log "vllm bench serve: $*"
PYTHONPATH=$PEER_SITE timeout "${PEER_TIMEOUT:-540}" "$PY" benchmarks/peer_client.py \
  --base-url "http://127.0.0.1:$PORT" --model "$SHAPE" --tokenizer "$CKPT" --out "$OUT/peer" \
  --label "vllm ${VLLM_FLAGS:-bf16}" "$@" > "$OUT/peer.log" 2>&1
grep -A40 "^vllm .*: case" "$OUT/peer.log" || tail -30 "$OUT/peer.log"
