#!/usr/bin/env bash
# On the GPU machine: gather the peer's wheel parts (benchmarks/peer_wheels.py) call by call, then install.
#   bash benchmarks/peer_stage.sh .peer/partK     # one call per part, carry: [".peer/partK"]
#   bash benchmarks/peer_stage.sh --install        # after the last part: join split wheels, install
# Parts collect in /tmp/peer-wheels, outside the repository, which survives between calls only while the
# same machine stays warm (a call within its idle release); a fresh machine starts from nothing again,
# so a part count below the total on --install means the machine changed: carry the parts again.
# Installed into /tmp/peer-site (PYTHONPATH for the peer only: its pins differ from Flare's wheels).
set -euo pipefail
STAGE=/tmp/peer-wheels
mkdir -p "$STAGE"
if [ "${1:-}" != "--install" ]; then
  part=${1:?a part folder, e.g. .peer/part1}
  cp "$part"/* "$STAGE"/
  echo "$(basename "$part"): $(ls "$part" | wc -l) files; staged now: $(ls "$STAGE" | wc -l) files, $(du -sm "$STAGE" | cut -f1) MiB"
  exit 0
fi
cd "$STAGE"
for first in *.whl.000; do
  [ -e "$first" ] || break
  wheel=${first%.000}
  cat "$wheel".[0-9][0-9][0-9] > "$wheel" && rm "$wheel".[0-9][0-9][0-9]
  echo "joined $wheel"
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer-site ./*.whl
echo "installed $(ls ./*.whl | wc -l) wheels into /tmp/peer-site; run the peer with PYTHONPATH=/tmp/peer-site"
