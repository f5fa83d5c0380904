#!/usr/bin/env bash
# Flare and vLLM side by side on one GPU machine, through vLLM's own client (benchmarks/peer_client.py),
# in one warm lease. The peer's wheels arrive one part per call (benchmarks/peer_wheels.py, peer_stage.sh);
# the staging calls are short, so Flare's numerics gate and exports run meanwhile in the background.
#
#   bash benchmarks/side_by_side_gpu.sh background      # first call, carry .whl (Flare's wheels): starts, returns
#   bash benchmarks/peer_stage.sh .peer/partK            # one call per part, carry .peer/partK
#   bash benchmarks/peer_stage.sh --install              # with the last part
#   bash benchmarks/side_by_side_gpu.sh flare bf16 peer:CASES [PHASE...]   # serve_gpu_run.sh phases
#   bash benchmarks/side_by_side_gpu.sh vllm bf16 CASE...                  # peer_serve_run.sh
#   bash benchmarks/side_by_side_gpu.sh flare fp8 peer:CASES; ... vllm fp8 CASE...
#   bash benchmarks/side_by_side_gpu.sh pack             # OUT/r into OUT/all.tgz (the files-back limit)
#
# `background` copies the repo to /tmp/side-repo and runs from there under setsid (a process in a session
# of its own outlives its call on the GPU machine), logging to /tmp/side-bg/bg.log: Flare's wheels into
# /tmp/site, benchmarks/numerics_gate.sh, then `ignition export` of the checkpoint in bf16 and with
# FP8_FLAGS (REUSE_EXPORT=1 EXPORT_ONLY=1 serve_gpu_run.sh), then /tmp/side-bg/done. `flare` waits for
# that file: a measurement must not share the GPU with an export. Each run's files land in OUT/r/NAME.
# Environment: SHAPE (default llama-8b), FP8_FLAGS (default "--online-mxfp8 --kv-cache-dtype fp8"),
# VLLM_FP8_FLAGS (default "--quantization fp8"), COMMIT (recorded in device.txt; the device copy's HEAD
# can be older than the tree it runs).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SHAPE=${SHAPE:-llama-8b}
FP8_FLAGS=${FP8_FLAGS:---online-mxfp8 --kv-cache-dtype fp8}
BG=/tmp/side-bg
OUT=${OUT:-/tmp/side-out}
verb=${1:?usage: side_by_side_gpu.sh background|flare MODE PHASE...|vllm MODE CASE...|pack}
shift

exports() {   # in the background: wheels, gate, the bf16 and FP8 packages
  date -u
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
  OUT=$BG/gate bash benchmarks/numerics_gate.sh; echo "gate rc=$? $(date -u)"
  export REUSE_EXPORT=1 EXPORT_ONLY=1 GATE=0 WHEELS=/nonexistent
  OUT=$BG/bf16 bash benchmarks/serve_gpu_run.sh "$SHAPE"; echo "bf16 export rc=$? $(date -u)"
  OUT=$BG/fp8 EXPORT_FLAGS="$FP8_FLAGS" bash benchmarks/serve_gpu_run.sh "$SHAPE"; echo "fp8 export rc=$? $(date -u)"
  rm -f "$BG"/*/results.tgz
  touch "$BG/done"
}

case $verb in
  background)
    rm -rf "$BG" /tmp/side-repo && mkdir -p "$BG" && cp -r . /tmp/side-repo
    (cd /tmp/side-repo && SHAPE=$SHAPE FP8_FLAGS=$FP8_FLAGS setsid nohup bash benchmarks/side_by_side_gpu.sh exports \
       > "$BG/bg.log" 2>&1 < /dev/null &)
    sleep 2; cat "$BG/bg.log" ;;
  exports) exports ;;
  flare)
    mode=${1:?flare bf16|fp8 PHASE...}; shift
    for _ in $(seq 900); do [ -e "$BG/done" ] && break; sleep 1; done
    [ -e "$BG/done" ] || { echo "the background exports have not finished: $(tail -2 "$BG/bg.log")"; exit 1; }
    mkdir -p "$OUT/r" && cp -r "$BG" "$OUT/r/bg"
    [ "$mode" = fp8 ] && export EXPORT_FLAGS="$FP8_FLAGS"
    PYTHONPATH=/tmp/site REUSE_EXPORT=1 GATE=0 WHEELS=/nonexistent OUT=$OUT/r/flare-$mode \
      bash benchmarks/serve_gpu_run.sh "$SHAPE" "$@"
    rm -f "$OUT"/r/*/results.tgz ;;
  vllm)
    mode=${1:?vllm bf16|fp8 CASE...}; shift
    [ "$mode" = fp8 ] && export VLLM_FLAGS="${VLLM_FP8_FLAGS:---quantization fp8}"
    mkdir -p "$OUT/r"
    OUT=$OUT/r/vllm-$mode bash benchmarks/peer_serve_run.sh "$SHAPE" "$@" ;;
  pack) tar czf "$OUT/all.tgz" -C "$OUT" r && ls -la "$OUT/all.tgz" ;;
  *) echo "unknown verb $verb"; exit 2 ;;
esac
