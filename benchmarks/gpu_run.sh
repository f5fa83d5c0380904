#!/usr/bin/env bash
# One planned GPU session (about 8 minutes on an H200): the numerics gate, the kernel tests on CUDA (bf16 included), the
# attention micro-benchmark, the llama-8b decode-step benchmark and the transformers peer.
# Results go to $OUT (default /tmp/flare-gpu-run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flare-gpu-run}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
echo "== numerics gate"
OUT=$OUT bash benchmarks/numerics_gate.sh
echo "== kernel tests on CUDA"
timeout 110 python3 -m pytest tests/kernels -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
echo "== attention kernels"
timeout 140 python3 benchmarks/kernel_bench.py --sweep --output "$OUT/kernels.json" 2>&1 | tee "$OUT/kernel_bench.log"
echo "== llama-8b decode step"
timeout 140 python3 benchmarks/decode_bench.py llama-8b --batches 1,8,32,64 --contexts 512,4096 --seeds 0,1 \
  --output "$OUT/decode_llama8b.json" 2>&1 | tee "$OUT/decode_bench.log"
echo "== transformers peer"
timeout 160 python3 benchmarks/hf_baseline.py --random llama-8b --input-len 128 --output-len 256 \
  --output "$OUT/hf_llama8b.json" 2>&1 | tail -20 | tee "$OUT/hf.log"
