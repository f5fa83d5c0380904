#!/usr/bin/env bash
# The whole product path on one machine, timed: write a random-weight benchmark checkpoint, `ignition
# export` it, `flare run` the package (seconds to the first answered request), then drive the HTTP API
# with benchmarks/serve_bench.py. Results (logs, JSON) under $OUT.
#
#   bash benchmarks/serve_gpu_run.sh SHAPE [PHASE...]
#
# SHAPE: llama-8b or qwen3-8b (shared/bench/make_random_checkpoint.py, copied to carry/bench), or
# SHAPE:LAYERS for the same shape cut to LAYERS layers (a quick check of the path).
# PHASES (default: serve1 serve16 serve64 serve256 long throughput restart):
#   serveN      concurrency N, 1000 tokens in / 256 out (IN_LEN, OUT_LEN), 4N prompts (at least 8), no
#               sampling fields sent: the package's sampling defaults (as `vllm bench serve` sends none)
#   sampledN    the same with explicit sampling, SAMPLING (default: --temperature 0.6 --top-p 0.9)
#   greedyN     the same at --temperature 0
#   jsonN       serveN with every reply constrained to a JSON schema (serve_bench --json-schema); with
#               any json phase the checkpoint gets a byte-level tokenizer that spells JSON, for every phase
#   poisson     Poisson arrivals at each of RATES (default 4,8,12,16 requests/s), ARRIVAL_S (default 30)
#               seconds of arrivals per rate, no concurrency limit, explicit SAMPLING, SLO goodput for
#               GOODPUT (default: ttft:1000 tpot:50)
#   poisson-defaults  the same with the package's sampling defaults
#   bound:MS    restart the server with --scheduler-max-step-ms MS (the cadence bound; later phases use it)
#   policy:NAME restart the server with --scheduler-policy NAME (balanced, throughput; bound dropped)
#   long        8,000-token prompts, 1 token out: time to first token
#   long32k     32,000-token prompts, 128 tokens out (LONG32K_OUT) at concurrency 1: time to first token, then
#               time per output token with 32K of context (the package's context is the checkpoint's
#               max_position_embeddings, 131,072 for llama-8b and 40,960 for qwen3-8b: the phase checks
#               the served context holds prompt and output, and says so when it does not)
#   throughput  256 requests of 1000 in / 1000 out at concurrency 256: output tok/s
#   restart     stop the server and start it again on the prepared package: warm start-up to first answer
#   profile-start  a restart with the engine's start under cProfile (--profile-startup): where it goes
#   trace       restart the server with --profile-steps: serving steps TRACE_WINDOW (FIRST,COUNT, default
#               300,20) of the phases that follow are traced into OUT/trace-K (host operators and kernels,
#               each step's device busy time), the next COUNT under cProfile; `trace-summary` prints both
#               (and stops the server: a restart or trace phase must follow for more serve phases)
#   bench       `ignition bench` of the checkpoint (stops the server; later serve phases need a restart)
#   peer:CASES  vLLM's own client (`vllm bench serve`, benchmarks/peer_client.py) against this server, for
#               the comma-separated CASES (e.g. peer:c1:greedy,c64:top-p,u256:top-p), results in OUT/peer;
#               vLLM from PEER_SITE (default /tmp/peer-site, benchmarks/peer_stage.sh), the client only
# Environment: PY (python, default python3), OUT (also packed into OUT/results.tgz), WORK (scratch, default
# /tmp/flare-work; other shapes' checkpoints and earlier packages there are removed first), PORT,
# MAX_CONCURRENCY (export, default 256), WHEELS (a folder of wheels to install first, default .whl),
# EXPORT_FLAGS (more `ignition export` flags, e.g. "--online-mxfp8 --kv-cache-dtype fp8": FP8 weights and
# an FP8 KV cache; recorded in device.txt and summary.json), GATE (default 1: benchmarks/numerics_gate.sh
# runs first, before anything holds the GPU; 0 skips it), REUSE_EXPORT (1: keep earlier packages, and serve
# the one an earlier run exported with the same shape, width and flags), EXPORT_ONLY (1: stop after export).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
PY=${PY:-python3}
OUT=${OUT:-/tmp/flare-serve}
WORK=${WORK:-/tmp/flare-work}
PORT=${PORT:-8011}
SHAPE=${1:?usage: serve_gpu_run.sh SHAPE [PHASE...]}
shift
PHASES=${*:-serve1 serve16 serve64 serve256 long throughput restart}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HOME=$WORK/home   # keeps carried wheels (e.g. /tmp/site)
mkdir -p "$HOME"
log() { echo "== $(date -u +%H:%M:%S) $*"; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
ignition() { "$PY" -c 'import sys; from flare.cli.ignition import main; sys.exit(main())' "$@"; }

# shellcheck source=benchmarks/gpu_setup.sh
source "$REPO/benchmarks/gpu_setup.sh"
# Python keeps compiled bytecode next to the sources. Where it cannot (read-only site-packages, or
# PYTHONDONTWRITEBYTECODE), every process recompiles torch's modules from source: 8.7 s of a profiled
# engine start on the H200 machine. A bytecode folder of our own gives what a normal install has.
TORCH_DIR=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] || [ ! -w "$TORCH_DIR" ]; then
  log "bytecode: PYTHONDONTWRITEBYTECODE='${PYTHONDONTWRITEBYTECODE:-}', $TORCH_DIR writable: $([ -w "$TORCH_DIR" ] && echo yes || echo no); caching in $WORK/pycache"
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX=$WORK/pycache
fi
write_device_record
echo "export flags: ${EXPORT_FLAGS:-none}" | tee -a "$OUT/device.txt"

if [ "${GATE:-1}" != 0 ]; then
  log "numerics gate"
  OUT=$OUT PY=$PY bash "$REPO/benchmarks/numerics_gate.sh"
fi

CKPT=$WORK/ckpt-${SHAPE/:/-}
# WORK is scratch: an 8B checkpoint and its package take ~32 GB, so other shapes' checkpoints and
# earlier packages go first (a 64 GiB disk once ran full on the second model).
for old in "$WORK"/ckpt-*; do [ "$old" != "$CKPT" ] && rm -rf "$old"; done
[ "${REUSE_EXPORT:-0}" = 1 ] || rm -rf "$HOME/.cache/flare/packages"
if [ ! -f "$CKPT/config.json" ]; then
  log "checkpoint $SHAPE"
  "$PY" benchmarks/write_bench_checkpoint.py "$CKPT" "$SHAPE"
fi

case " $PHASES " in
  *" json"*)   # grammar phases need a tokenizer that spells JSON (the serve phases then share it, for a fair ratio)
    log "byte-level tokenizer for JSON grammars"
    VOCAB_SIZE=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]+"/config.json"))["vocab_size"])' "$CKPT")
    "$PY" benchmarks/json_bench_tokenizer.py "$CKPT" "$VOCAB_SIZE" ;;
esac

# One entry file per export (shape, width, flags): with REUSE_EXPORT=1 a package exported earlier on this
# machine is served again instead of exported again (e.g. exported in the background while other work ran).
ENTRY_FILE=$WORK/entry-$(echo "$SHAPE-${MAX_CONCURRENCY:-256}-${EXPORT_FLAGS:-bf16}" | tr -c 'A-Za-z0-9\n-' '_')
if [ "${REUSE_EXPORT:-0}" = 1 ] && [ -s "$ENTRY_FILE" ] && [ -s "$ENTRY_FILE.seconds" ]; then
  export_s=$(cat "$ENTRY_FILE.seconds")
  cp "$ENTRY_FILE.log" "$OUT/export.log"
  log "reusing the package exported earlier (${export_s}s): $(tail -1 "$ENTRY_FILE")"
else
  log "ignition export"
  started=$(now)
  # shellcheck disable=SC2086  # EXPORT_FLAGS is a list of flags
  ignition export "$CKPT" --max-concurrency "${MAX_CONCURRENCY:-256}" ${EXPORT_FLAGS:-} > "$ENTRY_FILE" 2> "$OUT/export.log"
  rc=$?
  export_s=$(elapsed "$started")
  tail -15 "$OUT/export.log"
  if [ $rc -ne 0 ]; then echo "export failed ($rc)"; rm -f "$ENTRY_FILE"; exit 1; fi
  echo "$export_s" > "$ENTRY_FILE.seconds" && cp "$OUT/export.log" "$ENTRY_FILE.log"
fi
ENTRY=$(tail -1 "$ENTRY_FILE")
echo "export ${export_s}s -> $ENTRY"
FINGERPRINT=$("$PY" -c 'import sys; from flare.package.signing import main; sys.exit(main(["--development-fingerprint"]))')

# The step costs export measured (the balanced policy's table), for the record.
"$PY" -c 'import json, sys, msgspec
from flare.package.reader import open_unverified
print(json.dumps(msgspec.to_builtins(open_unverified(sys.argv[1]).plan.step_costs)))' "$ENTRY" \
  > "$OUT/step_costs.json" 2>&1 && head -c 600 "$OUT/step_costs.json"; echo
if [ "${EXPORT_ONLY:-0}" = 1 ]; then log "EXPORT_ONLY: no server"; exit 0; fi

SERVER_PID=
SERVER_FLAGS=()      # scheduling flags of the running server (bound:MS, policy:NAME)
start_server() {   # $1: log name, then extra `flare run` flags; sets startup_s
  local started name=$1; shift
  started=$(now)
  "$PY" -c 'import sys; from flare.cli.flare import main; sys.exit(main())' run "$ENTRY" --port "$PORT" \
    --dangerously-approve-key "$FINGERPRINT" --dangerously-accept-publisher local-development \
    "${SERVER_FLAGS[@]}" "$@" > "$OUT/$name.log" 2>&1 &
  SERVER_PID=$!
  startup_s=
  for _ in $(seq 1 1200); do
    if ! kill -0 $SERVER_PID 2>/dev/null; then echo "server exited"; tail -30 "$OUT/$name.log"; return 1; fi
    if curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
         -d '{"model":"'"$SERVED"'","prompt":"Hello","max_tokens":4}' -o "$OUT/$name.first.json" 2>/dev/null; then
      startup_s=$(elapsed "$started")
      break
    fi
    sleep 0.25
  done
  grep -v '^\s*$' "$OUT/$name.log" | head -30
  echo "startup to first answer: ${startup_s}s"
  curl -sf "http://127.0.0.1:$PORT/v1/engine/stats" -o "$OUT/$name.stats.json" && \
    echo "engine stats: $(cat "$OUT/$name.stats.json")"
}
stop_server() {
  [ -n "$SERVER_PID" ] && kill -TERM $SERVER_PID 2>/dev/null && wait $SERVER_PID 2>/dev/null
  SERVER_PID=
}
trap stop_server EXIT

SERVED=$("$PY" -c 'import json,sys
from flare.package.reader import open_unverified
print(open_unverified(sys.argv[1]).served_names[0])' "$ENTRY")
log "flare run ($SERVED)"
start_server serve || exit 1
first_startup_s=$startup_s
VOCAB=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]+"/config.json"))["vocab_size"])' "$CKPT")
BENCH_CALLS=0
bench() {   # name, then serve_bench arguments
  local name=$1; shift
  log "$name"
  # Each call its own prompts: serve_bench seeds a level's prompts by its concurrency, so two phases at one
  # concurrency (serve64, then greedy64) would otherwise send the same prompts, and the second would find
  # them all in the prefix cache.
  BENCH_CALLS=$((BENCH_CALLS + 1))
  timeout ${BENCH_TIMEOUT:-240} "$PY" benchmarks/serve_bench.py --base-url "http://127.0.0.1:$PORT" --model "$SERVED" \
    --vocab-size "$VOCAB" --seed $((BENCH_CALLS * 100003)) --output "$OUT/$name.json" "$@" 2>&1 | tail -8
  "$PY" -c 'import json, sys; [print("errors:", level["errors"]) for level in json.load(open(sys.argv[1]))["levels"]
            if level.get("errors")]' "$OUT/$name.json" 2>/dev/null | cut -c1-600
  # The engine's counters after the phase: Triton kernels built while serving (a build stalls its step), ...
  curl -sf "http://127.0.0.1:$PORT/v1/engine/stats" -o "$OUT/$name.engine.json" && "$PY" -c 'import json, sys
s = json.load(open(sys.argv[1])); print("kernels built while serving so far:", s.get("kernel_builds"), "(%s s)" % s.get("kernel_build_seconds"))
for name in s.get("kernel_builds_recent") or ():
    print("  built:", name)' \
    "$OUT/$name.engine.json"
}
restart_s=
SAMPLING=${SAMPLING:---temperature 0.6 --top-p 0.9}
RATES=${RATES:-4,8,12,16}
ARRIVAL_S=${ARRIVAL_S:-30}
GOODPUT=${GOODPUT:-ttft:1000 tpot:50}
poisson() {   # name, then extra serve_bench arguments (sampling)
  local name=$1; shift
  local rates; rates=$(echo "$RATES" | tr ',' ' ' | wc -w)
  BENCH_TIMEOUT=$(( rates * (${ARRIVAL_S%.*} + 90) )) bench "$name" --input-len "${IN_LEN:-1000}" \
    --output-len "${OUT_LEN:-256}" --request-rate "$RATES" --arrival-seconds "$ARRIVAL_S" --goodput $GOODPUT "$@"
}
restart_with() {   # a phase's name, then the scheduling flags the restarted server keeps
  local name=$1; shift
  SERVER_FLAGS=("$@")
  stop_server; log "flare run ${SERVER_FLAGS[*]}"
  start_server "$name"
}
for phase in $PHASES; do
  case $phase in
    json*)  n=${phase#json}    # the serveN level with every reply constrained to a JSON schema
            bench "$phase" --input-len "${IN_LEN:-1000}" --output-len "${OUT_LEN:-256}" --concurrency "$n" --json-schema ;;
    serve*) n=${phase#serve}
            bench "$phase" --input-len "${IN_LEN:-1000}" --output-len "${OUT_LEN:-256}" --concurrency "$n" ;;
    sampled*) n=${phase#sampled}
            bench "$phase" --input-len "${IN_LEN:-1000}" --output-len "${OUT_LEN:-256}" --concurrency "$n" $SAMPLING ;;
    greedy*) n=${phase#greedy}
            bench "$phase" --input-len "${IN_LEN:-1000}" --output-len "${OUT_LEN:-256}" --concurrency "$n" \
              --temperature 0 ;;
    poisson) poisson poisson $SAMPLING ;;
    poisson-defaults) poisson poisson-defaults ;;
    bound:*) restart_with "bound-${phase#bound:}" --scheduler-max-step-ms "${phase#bound:}" ;;
    policy:*) restart_with "policy-${phase#policy:}" --scheduler-policy "${phase#policy:}" ;;
    long) bench long --input-len 8000 --output-len 1 --concurrency 1 --min-prompts 6 --warmup-requests 1 ;;
    long32k)
      served_context=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | "$PY" -c 'import json, sys
print(max(m.get("max_model_len") or 0 for m in json.load(sys.stdin)["data"]))' 2>/dev/null)
      if [ "${served_context:-0}" -lt $((32000 + ${LONG32K_OUT:-128})) ]; then
        log "long32k skipped: the server holds ${served_context:-an unknown number of} tokens per request, " \
            "not 32,000 + ${LONG32K_OUT:-128}"
      else
        bench long32k --input-len 32000 --output-len "${LONG32K_OUT:-128}" --concurrency 1 --min-prompts 4 \
          --warmup-requests 1
      fi ;;
    throughput) bench throughput --input-len 1000 --output-len 1000 --concurrency 256 --prompts-per-concurrency 1 \
                  --min-prompts 256 --warmup-requests 0 ;;
    restart) stop_server; log "flare run again"; start_server restart && restart_s=$startup_s ;;
    trace)   # a restart that records serving steps TRACE_WINDOW (default 300,20) of the phases after it
      traces=$((${traces:-0} + 1))
      stop_server; log "flare run, steps ${TRACE_WINDOW:-300,20} recorded into trace-$traces"
      start_server "trace-$traces" --profile-steps "$OUT/trace-$traces" \
        --profile-steps-window "${TRACE_WINDOW:-300,20}" ;;
    trace-summary)   # what the last trace recorded: device busy per step, then the host's costliest calls
      stop_server   # the window is written when its last step runs; stopping ends the server's phases
      tail -3 "$OUT/trace-${traces:-1}"/engine-steps-*.txt 2>/dev/null
      "$PY" -c 'import glob, pstats, sys
for path in glob.glob(sys.argv[1] + "/*.prof"):
    pstats.Stats(path).sort_stats("tottime").print_stats(25)' "$OUT/trace-${traces:-1}" 2>&1 \
        | grep -v '^\s*$' | cut -c1-150 | head -40 ;;
    profile-start)   # a restart whose engine start is profiled (cProfile), then its costliest calls
      stop_server; log "flare run, engine start profiled"
      start_server profiled-start --profile-startup "$OUT/startup-profile"
      "$PY" -c 'import glob, pstats, sys
for path in glob.glob(sys.argv[1] + "/*.prof"):
    pstats.Stats(path).sort_stats("cumulative").print_stats(45)' "$OUT/startup-profile" 2>&1 \
        | grep -v '^\s*$' | cut -c1-160 | head -70 ;;
    peer:*) log "vllm bench serve: ${phase#peer:}"
            # shellcheck disable=SC2046  # the case list splits at commas
            PYTHONPATH=${PEER_SITE:-/tmp/peer-site} timeout "${PEER_TIMEOUT:-540}" "$PY" benchmarks/peer_client.py \
              --base-url "http://127.0.0.1:$PORT" --model "$SERVED" --tokenizer "$CKPT" --out "$OUT/peer" \
              --label "flare ${EXPORT_FLAGS:-bf16}" $(echo "${phase#peer:}" | tr ',' ' ') > "$OUT/peer.log" 2>&1
            grep -A40 "^flare .*: case" "$OUT/peer.log" || tail -30 "$OUT/peer.log" ;;
    bench)   # ignition bench on the checkpoint (the server is stopped first: it holds the GPU's memory)
      stop_server; log "ignition bench"
      ignition bench "$CKPT" --batches "${BENCH_BATCHES:-1,8,32,64}" --contexts "${BENCH_CONTEXTS:-512,4096}" \
        --seeds 0,1 --output "$OUT/bench.json" > "$OUT/bench.log" 2>&1
      tail -25 "$OUT/bench.log" ;;
  esac
done
stop_server
"$PY" - "$OUT" "$SHAPE" "$export_s" "$first_startup_s" "${restart_s:-null}" "${EXPORT_FLAGS:-}" <<'PY'
import json, pathlib, sys
out, shape, export_s, first, restart, export_flags = sys.argv[1:]
summary = {"shape": shape, "export_flags": export_flags.split(), "export_s": float(export_s),
           "startup_to_first_answer_s": float(first or "nan"),
           "restart_to_first_answer_s": None if restart == "null" else float(restart), "levels": {}}
for path in sorted(pathlib.Path(out).glob("*.json")):
    if path.name == "summary.json":
        continue
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "levels" in data:
        summary["levels"][path.stem] = data["levels"]
(pathlib.Path(out) / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: v for k, v in summary.items() if k != "levels"}))
PY
# One archive as well, for transports that bring back only a few files.
tar czf "$OUT/results.tgz" -C "$OUT" --exclude results.tgz . && echo "results: $OUT/results.tgz"
