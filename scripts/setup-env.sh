#!/usr/bin/env bash
# Create .venv and install Flare into it. Sourced by the two README commands.
# On a machine without a GPU this takes the CPU build of PyTorch; where a CUDA PyTorch is already
# installed system-wide (our GPU machines), the venv sees it and nothing large is downloaded.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
EXTRA="${1:-}"
if [ ! -x .venv/bin/python ]; then
  if python3 -c 'import torch' 2>/dev/null; then
    python3 -m venv --system-site-packages .venv
  else
    python3 -m venv .venv
  fi
fi
PY=.venv/bin/python
$PY -m pip install -q --upgrade pip >/dev/null
if ! $PY -c 'import torch' 2>/dev/null; then
  # The CPU build; a bare "torch" would pull a multi-GB CUDA build onto a machine without a GPU.
  $PY -m pip install -q "torch==2.13.0"
fi
if [ -n "$EXTRA" ]; then
  $PY -m pip install -q -e ".[$EXTRA]"
else
  $PY -m pip install -q -e .
fi
