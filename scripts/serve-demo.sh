#!/usr/bin/env bash
# Set up the environment, prepare the built-in demo model (trained on first use, then cached) and
# serve it over the OpenAI and Anthropic APIs on http://127.0.0.1:8000. Extra arguments go to `flare run`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-env.sh
entry="$(bash scripts/demo-package.sh)"      # the last export again when nothing changed
# The package is signed with this machine's development key; accept exactly that key and namespace.
fingerprint="$(.venv/bin/python -c 'import sys; from flare.package.signing import main; sys.exit(main(["--development-fingerprint"]))')"
exec .venv/bin/flare run "$entry" \
  --dangerously-approve-key "$fingerprint" --dangerously-accept-publisher local-development "$@"
