#!/usr/bin/env bash
# One device call for DeepSeek V4 on one GPU: its GPU tests (the V4 kernels against their references, V4's
# logits on the kernels), then benchmarks/deepseek_v4_bench.py's phases, one process each so one failure
# leaves the others' JSON: parity (a tiny V4 checkpoint's greedy tokens against transformers on the GPU),
# kernels (numerics and timings at V4-Flash's shapes), engine (the decode step on random weights in
# V4-Flash's widths, LAYERS layers: c=1 TPOT and c=64 tok/s). Results under $OUT/deepseek-v4.
#   bash benchmarks/deepseek_v4_gpu_run.sh [phases...]   (default: tests parity kernels engine)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/flare-deepseek-v4-gpu}
RESULTS=$OUT/deepseek-v4
mkdir -p "$RESULTS"
PHASES=${*:-tests parity kernels engine}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$RESULTS/device.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__)' 2>&1 | tee -a "$RESULTS/device.txt"
echo "commit $(git rev-parse --short HEAD 2>/dev/null)" | tee -a "$RESULTS/device.txt"
for phase in $PHASES; do
  echo "== $phase $(date -u +%H:%M:%S)"
  case $phase in
    tests) timeout ${TESTS_TIMEOUT:-240} python3 -m pytest tests/kernels/test_compressed_attention.py \
             tests/kernels/test_deepseek_v4_kernels_parity.py -q -p no:cacheprovider 2>&1 | tail -15 \
             | tee "$RESULTS/gpu_tests.log" ;;
    parity) timeout ${PARITY_TIMEOUT:-180} python3 benchmarks/deepseek_v4_bench.py --phases parity \
             --output-dir "$RESULTS" 2>&1 | tail -8 ;;
    kernels) timeout ${KERNELS_TIMEOUT:-240} python3 benchmarks/deepseek_v4_bench.py --phases kernels \
             --contexts "${CONTEXTS:-4096,65536,262144}" --output-dir "$RESULTS" 2>&1 | tail -50 ;;
    engine) timeout ${ENGINE_TIMEOUT:-300} python3 benchmarks/deepseek_v4_bench.py --phases engine \
             --layers "${LAYERS:-4}" --batches "${BATCHES:-1,64}" --engine-contexts "${ENGINE_CONTEXTS:-512}" \
             --output-dir "$RESULTS" 2>&1 | tail -8 ;;
    *) echo "unknown phase $phase (tests parity kernels engine)" ;;
  esac
done
echo "== done $(date -u +%H:%M:%S): $(ls "$RESULTS")"
