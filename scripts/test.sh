#!/usr/bin/env bash
# Set up the environment and run the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-env.sh test
exec .venv/bin/python -m pytest -q -n 2 "$@"
