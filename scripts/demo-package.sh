#!/usr/bin/env bash
# Print the path of a prepared demo package: the one exported last time when nothing it is made from
# changed (Flare's sources and the configuration file), otherwise a new `ignition export demo`.
# The demo checkpoint itself is trained once and cached by Flare, so an export is the only repeated work.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
config="$HOME/.config/flare/config.toml"
stamp=.venv/demo-package
inputs="$( { cat pyproject.toml; find src -type f \( -name '*.py' -o -name '*.jinja' -o -name '*.json' -o -name '*.txt' \) \
              -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs cat; cat "$config" 2>/dev/null || true; } \
           | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ]; then
  { read -r recorded_inputs; read -r recorded_entry; } < "$stamp" || true
  if [ "${recorded_inputs:-}" = "$inputs" ] && [ -f "${recorded_entry:-}/model.safetensors" ]; then
    echo "demo: reusing $recorded_entry (prepared from these sources; nothing changed)" >&2
    echo "$recorded_entry"
    exit 0
  fi
fi
echo "demo: preparing the demo package (ignition export demo)" >&2
entry="$(.venv/bin/ignition export demo)"
printf '%s\n%s\n' "$inputs" "$entry" > "$stamp"
echo "$entry"
