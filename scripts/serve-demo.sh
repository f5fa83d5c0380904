#!/usr/bin/env bash
# Set up the environment, prepare the built-in demo model (trained on first use, then cached) and
# serve it over the OpenAI API on http://127.0.0.1:8000/v1. Extra arguments go to `flare run`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-env.sh
.venv/bin/ignition export demo
exec .venv/bin/flare run demo \
  --dangerously-approve-key "$(.venv/bin/python -m flare.package.signing --development-fingerprint)" \
  --dangerously-accept-publisher local-development "$@"
