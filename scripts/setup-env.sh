#!/usr/bin/env bash
# Create .venv and install Flare into it. Sourced by the two README commands.
# On a machine without a GPU this takes the CPU build of PyTorch; where a CUDA PyTorch is already
# installed system-wide (our GPU machines), the venv sees it and nothing large is downloaded.
# Each step says what it does on stderr (a first set-up takes a few minutes, most of it downloads).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
EXTRA="${1:-}"
started=$SECONDS
step() { echo "setup: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  if python3 -c 'import torch' 2>/dev/null; then
    step "creating .venv beside the system's PyTorch"
    python3 -m venv --system-site-packages .venv
  else
    step "creating .venv"
    python3 -m venv .venv
  fi
else
  step ".venv exists; bringing it up to date"
fi
PY=.venv/bin/python
step "updating pip"
$PY -m pip install -q --upgrade pip >/dev/null
if ! $PY -c 'import torch' 2>/dev/null; then
  # The CPU build; a bare "torch" would pull a multi-GB CUDA build onto a machine without a GPU.
  step "installing PyTorch 2.13.0, CPU build (the largest download, about a minute)"
  $PY -m pip install -q "torch==2.13.0"
else
  step "PyTorch $($PY -c 'import torch; print(torch.__version__)') is installed"
fi
if [ -n "$EXTRA" ]; then
  step "installing Flare and its dependencies (pip install -e \".[$EXTRA]\")"
  $PY -m pip install -q -e ".[$EXTRA]"
else
  step "installing Flare and its dependencies (pip install -e .)"
  $PY -m pip install -q -e .
fi
step "ready in $(( SECONDS - started )) s: .venv/bin/flare and .venv/bin/ignition"
