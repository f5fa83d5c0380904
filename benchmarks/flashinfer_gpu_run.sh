#!/usr/bin/env bash
# FlashInfer's FA3 prompt attention on the GPU, one job (about five minutes on an H200, the JIT build of
# the kernel included): installs the carried wheels (WHEELS, default .whl, FlashInfer's among them),
# times the paged prefill kernels (benchmarks/prefill_attention_bench.py, FlashInfer's first call timed:
# its build), runs the kernel's GPU test and the numerics gate (which measures the model with FlashInfer
# computing its prompt rows too). Results under $OUT.
#   COMMIT=$(git rev-parse --short HEAD) bash benchmarks/flashinfer_gpu_run.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
PY=${PY:-python3}
OUT=${OUT:-/tmp/flare-flashinfer}
mkdir -p "$OUT"
export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log() { echo "== $(date -u +%H:%M:%S) $*"; }
source benchmarks/gpu_setup.sh
write_device_record
log "paged prefill kernels"
"$PY" benchmarks/prefill_attention_bench.py ${BENCH_FLAGS:-} --output "$OUT/prefill_attention.json" 2>&1 \
  | tee "$OUT/prefill_attention.log" | grep -v "^  " | tail -20
log "GPU tests of the FlashInfer prefill"
"$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_flashinfer_prefill.py tests/engine/test_prompt_kernel.py \
  2>&1 | tail -3
log "numerics gate"
OUT=$OUT bash benchmarks/numerics_gate.sh
log "done"
