#!/usr/bin/env bash
# The numerics gate, run in every GPU job (about two minutes on an H200; the GPU scripts call it first):
#   * tests/models/test_numerics_gate.py: teacher-forced bf16 logits of llama-8b- and qwen3-8b-shaped
#     models (real widths, 2 layers, random weights) on the Triton backend, eager and with compiled
#     layers, against transformers' float32 logits, as close as transformers' bf16 and as Flare's own
#     reference attention are (the test's docstring states the tolerance);
#   * tests/kernels/test_backend_greedy_parity.py: the Triton backend's greedy tokens equal the reference
#     backend's (tiny float32 models, on the GPU here; on a CPU in every test run).
# Prints every measured deviation and the test summary; writes $OUT/numerics_gate.json (the deviations)
# and $OUT/numerics_gate.log. Exits non-zero when the gate fails.
#   bash benchmarks/numerics_gate.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-/tmp/flare-numerics}
mkdir -p "$OUT"
rm -f "$OUT/numerics_gate.json"
timeout "${GATE_TIMEOUT:-420}" "$PY" -m pytest tests/models/test_numerics_gate.py tests/kernels/test_backend_greedy_parity.py \
  -q -s -p no:cacheprovider --numerics-report "$OUT/numerics_gate.json" > "$OUT/numerics_gate.log" 2>&1
rc=$?
grep -E " max [0-9.]+ rms | (passed|failed|error|skipped)|^(FAILED|ERROR) |AssertionError" "$OUT/numerics_gate.log" | cut -c1-300
[ $rc -eq 0 ] && echo "numerics gate: passed" || echo "numerics gate: FAILED ($rc), see $OUT/numerics_gate.log"
exit $rc
