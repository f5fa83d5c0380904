#!/usr/bin/env bash
# The prefix cache's tiers below the GPU, measured through the HTTP API (issue rows, H200, llama-8b):
#   host     a 32K-token prefix pushed out of the GPU's pages, then repeated: TTFT from host memory over the
#            TTFT of recomputing it (target <= 0.2); the same prefix repeated before it is pushed out gives
#            the GPU tier's TTFT (gpu_ttft_ms)
#   disk     the same prefix after a restart of the server (drained to disk at the stop): TTFT from disk over
#            recomputing (target <= 0.4); `disk-direct` repeats it with disk_transport = "direct"
#   spill    (not in the default) no restart: a host tier of SPILL_MEMORY (8G) too small for the traffic that
#            pushes the prefix out, so it is served from the disk pages written behind the host tier
#   tpot     decode TPOT at concurrency 16 (1000 in / 256 out) with the host tier on, where every finished
#            request's pages stream to the host, against the tier off (target: within 3%)
# Writes a random-weight checkpoint, exports it (--max-concurrency MAX_CONCURRENCY, default 16), serves the
# package with a configuration per phase, and leaves logs and JSON under $OUT (summary.json at the end).
#
#   bash benchmarks/prefix_tiers_gpu_run.sh [SHAPE] [PHASE...]     # default: llama-8b tpot host disk
#
# Environment: PY, OUT (default /tmp/flare-prefix-tiers), WORK (default /tmp/flare-work), PORT, HOST_MEMORY
# (the host tier, default 48G), SPILL_MEMORY (the spill phase's, 8G), PREFIX_TOKENS (32000), EVICT_TOKENS
# (160000: more than the GPU pool of --kv-cache-limit context holds), REPETITIONS (3), MAX_CONCURRENCY (16),
# WHEELS (carried wheels, default .whl: xxhash is needed, for the disk tier's checksums).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
PY=${PY:-python3}
OUT=${OUT:-/tmp/flare-prefix-tiers}
WORK=${WORK:-/tmp/flare-work}
PORT=${PORT:-8011}
SHAPE=${1:-llama-8b}
shift || true
PHASES=${*:-tpot host disk}
HOST_MEMORY=${HOST_MEMORY:-48G}
SPILL_MEMORY=${SPILL_MEMORY:-8G}
PREFIX_TOKENS=${PREFIX_TOKENS:-32000}
EVICT_TOKENS=${EVICT_TOKENS:-160000}
REPETITIONS=${REPETITIONS:-3}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HOME=$WORK/home
mkdir -p "$HOME/.config/flare"
CONFIG=$HOME/.config/flare/config.toml
log() { echo "== $(date -u +%H:%M:%S) $*"; }
ignition() { "$PY" -c 'import sys; from flare.cli.ignition import main; sys.exit(main())' "$@"; }

# shellcheck source=benchmarks/gpu_setup.sh
source "$REPO/benchmarks/gpu_setup.sh"
"$PY" -c 'import xxhash' || { echo "xxhash is missing: carry its wheel in $WHEELS (gpu_setup.sh installs it)"; exit 1; }
write_device_record
free -g | tee -a "$OUT/device.txt"

CKPT=$WORK/ckpt-${SHAPE/:/-}
if [ ! -f "$CKPT/config.json" ]; then
  log "checkpoint $SHAPE"
  "$PY" benchmarks/write_bench_checkpoint.py "$CKPT" "$SHAPE"
fi
echo "# no tiers while exporting" > "$CONFIG"
ENTRY_FILE=$WORK/entry-prefix-tiers-$SHAPE-${MAX_CONCURRENCY:-16}
if [ ! -s "$ENTRY_FILE" ]; then
  log "ignition export"
  ignition export "$CKPT" --max-concurrency "${MAX_CONCURRENCY:-16}" > "$ENTRY_FILE" 2> "$OUT/export.log" \
    || { tail -20 "$OUT/export.log"; rm -f "$ENTRY_FILE"; exit 1; }
fi
ENTRY=$(tail -1 "$ENTRY_FILE")
FINGERPRINT=$("$PY" -c 'import sys; from flare.package.signing import main; sys.exit(main(["--development-fingerprint"]))')
SERVED=$("$PY" -c 'import sys; from flare.package.reader import open_unverified
print(open_unverified(sys.argv[1]).served_names[0])' "$ENTRY")
VOCAB=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]+"/config.json"))["vocab_size"])' "$CKPT")
PREFIXES=$WORK/prefixes

configure() {   # the [prefix_cache] and [paths] lines of the phase
  printf '%s\n' "$@" > "$CONFIG"
  echo "config: $*" >> "$OUT/phases.txt"
}
SERVER_PID=
start_server() {   # $1: log name, then extra `flare run` flags
  local name=$1; shift
  "$PY" -c 'import sys; from flare.cli.flare import main; sys.exit(main())' run "$ENTRY" --port "$PORT" \
    --dangerously-approve-key "$FINGERPRINT" --dangerously-accept-publisher local-development "$@" \
    > "$OUT/$name.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 1200); do
    if ! kill -0 $SERVER_PID 2>/dev/null; then echo "server exited"; tail -30 "$OUT/$name.log"; return 1; fi
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    sleep 0.25
  done
  grep -E "prefix cache|KV cache|then disk" "$OUT/$name.log"
}
stop_server() {
  [ -n "$SERVER_PID" ] && kill -TERM $SERVER_PID 2>/dev/null && wait $SERVER_PID 2>/dev/null
  SERVER_PID=
}
trap stop_server EXIT
tiers() {   # mode, output name, then more prefix_tiers_bench.py arguments
  local mode=$1 name=$2; shift 2
  "$PY" benchmarks/prefix_tiers_bench.py "$mode" --base-url "http://127.0.0.1:$PORT" --model "$SERVED" \
    --vocab-size "$VOCAB" --prefix-tokens "$PREFIX_TOKENS" --evict-tokens "$EVICT_TOKENS" \
    --repetitions "$REPETITIONS" --output "$OUT/$name.json" "$@" 2>&1 | tail -20
}
tpot() {   # output name
  "$PY" benchmarks/serve_bench.py --base-url "http://127.0.0.1:$PORT" --model "$SERVED" --vocab-size "$VOCAB" \
    --input-len 1000 --output-len 256 --concurrency 16 --prompts-per-concurrency 6 --seed 7 \
    --output "$OUT/$1.json" 2>&1 | tail -6
  curl -sf "http://127.0.0.1:$PORT/v1/engine/stats" -o "$OUT/$1.stats.json"
}

for phase in $PHASES; do
  case $phase in
    tpot)
      log "TPOT at c=16, tier off"
      configure "# tier off"
      start_server tpot-off && tpot tpot-off; stop_server
      log "TPOT at c=16, host tier on ($HOST_MEMORY)"
      configure "[prefix_cache]" "memory = \"$HOST_MEMORY\""
      start_server tpot-on && tpot tpot-on; stop_server ;;
    host)
      log "32K prefix from host memory"
      configure "[prefix_cache]" "memory = \"$HOST_MEMORY\""
      start_server host --kv-cache-limit context && tiers evicted host; stop_server ;;
    disk|disk-direct)
      transport=staged; [ "$phase" = disk-direct ] && transport=direct
      log "32K prefix from disk after a restart ($transport)"
      rm -rf "$PREFIXES"
      configure "[prefix_cache]" "memory = \"$HOST_MEMORY\"" "drain_on_shutdown = \"45s\"" \
        "disk_transport = \"$transport\"" "[paths]" "prefix_cache = \"$PREFIXES\""
      start_server "$phase-first" --kv-cache-limit context && tiers prime "$phase-prime" --state "$WORK/$phase.state"
      stop_server
      du -sh "$PREFIXES" | tee -a "$OUT/phases.txt"
      start_server "$phase-restart" --kv-cache-limit context && tiers repeat "$phase" --state "$WORK/$phase.state"
      stop_server ;;
    spill)
      log "32K prefix from disk behind a $SPILL_MEMORY host tier, no restart"
      rm -rf "$PREFIXES"
      configure "[prefix_cache]" "memory = \"$SPILL_MEMORY\"" "[paths]" "prefix_cache = \"$PREFIXES\""
      start_server spill --kv-cache-limit context && tiers evicted spill; stop_server ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done

"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
read = lambda name: json.loads((out / f"{name}.json").read_text()) if (out / f"{name}.json").exists() else None
summary = {}
for name in ("host", "disk", "disk-direct", "spill"):
    found = read(name)
    if found:
        summary[name] = {k: found.get(k) for k in ("recompute_ttft_ms", "gpu_ttft_ms", "gpu_ratio", "tier_ttft_ms",
                                                   "ratio", "host_hit_tokens", "disk_hit_tokens", "gpu_hit_tokens")}
    log = out / f"{name}-restart.log" if name.startswith("disk") else out / f"{name}.log"
    if found and log.exists():   # the start-up report's account of the tiers
        summary[name]["startup_report"] = [line.strip() for line in log.read_text().splitlines()
                                           if "prefix cache" in line or "then disk" in line or "disk holds" in line]
off, on = read("tpot-off"), read("tpot-on")
if off and on:
    tpot = lambda result: result["levels"][0]["tpot_ms"]["p50"]
    summary["tpot"] = {"off_p50_ms": tpot(off), "on_p50_ms": tpot(on), "ratio": round(tpot(on) / tpot(off), 4)}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PYEOF
tar -czf "$OUT/results.tgz" -C "$OUT" --exclude results.tgz . 2>/dev/null
