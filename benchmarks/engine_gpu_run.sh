#!/usr/bin/env bash
# One device call for the engine's GPU path: GPU tests (kernels, graphs, compiled parity), the engine's
# decode step on llama-8b in three modes, and the transformers peer. Results under $OUT.
#   bash benchmarks/engine_gpu_run.sh [phases...]   (default: gate tests eager graphs hf compiled; gate is
#   benchmarks/numerics_gate.sh)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flare-engine-gpu}
mkdir -p "$OUT"
PHASES=${*:-gate tests eager graphs hf compiled}
BATCHES=${BATCHES:-1,8,32,64}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
for phase in $PHASES; do
  echo "== $phase $(date -u +%H:%M:%S)"
  case $phase in
    gate) OUT=$OUT bash benchmarks/numerics_gate.sh ;;
    tests) timeout ${TESTS_TIMEOUT:-150} python3 -m pytest ${TESTS:-tests/kernels tests/engine/test_cuda_graphs.py tests/engine/test_engine_gpu.py} \
             -q -p no:cacheprovider -x 2>&1 | tail -15 | tee "$OUT/gpu_tests.log" ;;
    eager) timeout ${EAGER_TIMEOUT:-90} python3 benchmarks/decode_engine.py llama-8b --mode eager --batches "${EAGER_BATCHES:-$BATCHES}" \
             --contexts 512 --warmup 2 --steps 10 --output "$OUT/engine_eager.json" ;;
    graphs) timeout ${GRAPHS_TIMEOUT:-90} python3 benchmarks/decode_engine.py llama-8b --mode graphs --batches "$BATCHES" \
             --contexts 512 --output "$OUT/engine_graphs.json" ;;
    compiled) timeout ${COMPILED_TIMEOUT:-180} python3 benchmarks/decode_engine.py llama-8b --mode compiled \
             --batches "$BATCHES" --contexts ${COMPILED_CONTEXTS:-512,4096} --output "$OUT/engine_compiled.json" ;;
    hf) timeout 120 python3 benchmarks/hf_baseline.py --random llama-8b --input-len 128 --output-len 256 \
             --repetitions 2 --output "$OUT/hf_llama8b.json" 2>&1 | tail -3 ;;
  esac
done
echo "== summary $(date -u +%H:%M:%S)"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("engine_*.json")):
    d = json.loads(path.read_text())
    print(d["mode"], "startup", {k: round(v, 1) for k, v in d["startup"].items()})
    for c in d["cases"]:
        g = "-" if c["gpu_ms"] is None else f"{c['gpu_ms']:.3f}"
        print(f"  {d['mode']:9} B{c['batch']:<3} C{c['context']:<5} step {c['step_ms']:7.3f} gpu {g:>7} ms {c['tokens_per_s']:8.0f} tok/s")
PY
