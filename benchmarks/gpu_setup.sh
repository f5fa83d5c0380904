# Sourced by the served GPU jobs (serve_gpu_run.sh, speculation_gpu_run.sh): installs what the server
# needs from a folder of carried wheels (WHEELS, default .whl) when it is missing, and writes the
# device, torch version and commit to $OUT/device.txt. Needs PY, OUT, REPO and a `log` function.
WHEELS=${WHEELS:-.whl}
NEEDED="fastapi uvicorn httptools uvloop rich cryptography tomlkit pyzmq msgspec prometheus-client nvidia-ml-py jinja2 filelock httpx xgrammar apache-tvm-ffi xxhash"
if [ -d "$WHEELS" ] && ! "$PY" -c 'import fastapi, uvicorn, httptools, uvloop, rich, cryptography, tomlkit, zmq, msgspec, prometheus_client, pynvml, httpx, xxhash' 2>/dev/null; then
  log "installing what is missing from $WHEELS"
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" $NEEDED 2>&1 | tail -2
  "$PY" -c 'import fastapi' 2>/dev/null || "$PY" -m pip install -q --no-index --find-links "$WHEELS" \
    --break-system-packages $NEEDED 2>&1 | tail -2
fi
# FlashInfer (the FA3 prompt attention, flare.kernels.flashinfer_prefill) when its wheel was carried: without
# its optional dependencies (cuda-tile, nvidia-cutlass-dsl), which its paged prefill does not import.
if ls "$WHEELS"/flashinfer_python-*.whl >/dev/null 2>&1 && ! "$PY" -c 'import flashinfer' 2>/dev/null; then
  log "installing FlashInfer from $WHEELS"
  FLASHINFER_WHEELS="flashinfer-python nvidia-cudnn-frontend einops tabulate apache-tvm-ffi"
  "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" $FLASHINFER_WHEELS 2>&1 | tail -2
  "$PY" -c 'import flashinfer' 2>/dev/null || "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" \
    --break-system-packages $FLASHINFER_WHEELS 2>&1 | tail -2
fi
write_device_record() {
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/device.txt"
  "$PY" -c 'import torch; print("torch", torch.__version__)' | tee -a "$OUT/device.txt"
  "$PY" -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' 2>/dev/null | tee -a "$OUT/device.txt"
  echo "commit ${COMMIT:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)}" | tee -a "$OUT/device.txt"
}
