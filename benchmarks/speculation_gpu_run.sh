#!/usr/bin/env bash
# Speculative decoding on one GPU, timed; results (logs, JSON, tables) under $OUT.
#
#   bash benchmarks/speculation_gpu_run.sh [PHASE...]        (default: widths acceptance serve)
#
# widths      verification-round cost by width: a random-weight llama-8b (carry/bench/make_random_checkpoint.py,
#             as serve_gpu_run.sh makes it), benchmarks/verify_width_bench.py at widths 1..8, batches 1, 8, 32,
#             context 1024 (random weights measure cost only; the target: width 8 at batch 1 <= 1.15x width 1)
# acceptance  a target (8 layers, 512 wide) and a draft model (2 layers, 256 wide) trained here from the demo's
#             corpus (about three minutes together), benchmarks/speculation_acceptance.py --device cuda
# serve       that target exported without its draft and with it, served by `flare run`, and driven by
#             benchmarks/serve_bench.py at concurrency 1, 8, 32, greedy, on held-out documents followed by their
#             first third again (answers that repeat their prompts): ordinary decoding (--mtp-draft-tokens 0),
#             history drafts (--history-drafts), the draft model, both; /metrics before and after each run
# Environment: PY (default python3), OUT (default /tmp/flare-speculation), WORK (default /tmp/flare-spec-work),
# PORT (default 8012), WHEELS (a folder of wheels to install from first, default .whl), SERVERS (the serve phase's
# servers, default "plain history draft both").
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
PY=${PY:-python3}
OUT=${OUT:-/tmp/flare-speculation}
WORK=${WORK:-/tmp/flare-spec-work}
PORT=${PORT:-8012}
PHASES=${*:-widths acceptance serve}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HOME=$WORK/home
mkdir -p "$HOME"
log() { echo "== $(date -u +%H:%M:%S) $*"; }
ignition() { "$PY" -c 'import sys; from flare.cli.ignition import main; sys.exit(main())' "$@"; }
# shellcheck source=benchmarks/gpu_setup.sh
source "$REPO/benchmarks/gpu_setup.sh"
write_device_record

phase_widths() {
  local ckpt=$WORK/ckpt-llama-8b
  if [ ! -f "$ckpt/config.json" ]; then
    log "random-weight llama-8b checkpoint"
    "$PY" -c 'import sys; sys.path.insert(0, "carry/bench"); import make_random_checkpoint as m; m.main(sys.argv[1], "llama-8b")' "$ckpt" \
      || { echo "no carry/bench/make_random_checkpoint.py: copy shared/bench there"; return 1; }
  fi
  log "verification rounds by width"
  "$PY" benchmarks/verify_width_bench.py "$ckpt" --widths 1-8 --batches 1,8,32 --contexts 1024 \
    --output "$OUT/verify_width.json" 2>&1 | tee "$OUT/verify_width.log" | tail -12
  rm -rf "$ckpt"                     # 16 GB: the serve phase's disk
}

phase_acceptance() {
  log "target and draft trained from the demo corpus, acceptance"
  "$PY" benchmarks/speculation_acceptance.py --device cuda --gpu-trained "$WORK/trained" \
    --out "$OUT/speculation_acceptance_gpu.json" 2>&1 | tee "$OUT/speculation_acceptance_gpu.log" | tail -40
}

SERVER_PID=
stop_server() { [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null; SERVER_PID=; }
trap stop_server EXIT
serve_one() {   # $1: label, $2: package entry, then flare run flags
  local label=$1 entry=$2; shift 2
  local fingerprint
  fingerprint=$("$PY" -c 'import sys; from flare.package.signing import main; sys.exit(main(["--development-fingerprint"]))')
  "$PY" -c 'import sys; from flare.cli.flare import main; sys.exit(main())' run "$entry" --port "$PORT" --offline \
    --dangerously-approve-key "$fingerprint" --dangerously-accept-publisher local-development "$@" \
    > "$OUT/serve-$label.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
  curl -sf "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics-$label-before.txt"
  "$PY" benchmarks/serve_bench.py --base-url "http://127.0.0.1:$PORT" --model demo-trained \
    --prompts-file "$WORK/repeat_prompts.json" --output-len 128 --concurrency 1,8,32 --temperature 0 \
    --output "$OUT/serve-$label.json" 2>&1 | tail -5
  curl -sf "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics-$label-after.txt"
  grep -E '^flare_spec_decode_(rounds|draft_tokens|accepted_tokens)_total|mean_accepted' "$OUT/metrics-$label-after.txt"
  stop_server
}

phase_serve() {
  if [ ! -f "$WORK/trained/training.json" ]; then     # the serve phase alone trains the pair, measuring nothing
    log "target and draft trained from the demo corpus"
    "$PY" benchmarks/speculation_acceptance.py --device cuda --gpu-trained "$WORK/trained" --train-only 2>&1 | tail -4
  fi
  "$PY" - "$WORK" <<'PY'
import json, sys
sys.path.insert(0, "benchmarks")
from speculation_acceptance import corpus_prompts
_, repeating = corpus_prompts(count=32, words=90)
json.dump(repeating, open(sys.argv[1] + "/repeat_prompts.json", "w"))
PY
  rm -rf "$WORK/target-only" && mkdir -p "$WORK/target-only"
  find "$WORK/trained" -maxdepth 1 -type f -exec cp {} "$WORK/target-only/" \;
  log "export: the target alone (history drafts), and with its draft model"
  ignition export "$WORK/target-only" --max-concurrency 32 --mtp-draft-tokens 4 > "$WORK/entry-history" 2> "$OUT/export-history.log" || { tail "$OUT/export-history.log"; return 1; }
  local history draft servers=" ${SERVERS:-plain history draft both} "
  history=$(tail -1 "$WORK/entry-history")
  case $servers in
    *" draft "*|*" both "*)
      ignition export "$WORK/trained" --max-concurrency 32 --mtp-draft-tokens 4 > "$WORK/entry-draft" 2> "$OUT/export-draft.log" || { tail "$OUT/export-draft.log"; return 1; }
      draft=$(tail -1 "$WORK/entry-draft") ;;
  esac
  case $servers in *" plain "*) serve_one plain "$history" --mtp-draft-tokens 0 --served-model-name demo-trained ;; esac
  case $servers in *" history "*) serve_one history "$history" --history-drafts --served-model-name demo-trained ;; esac
  case $servers in *" draft "*) serve_one draft "$draft" --served-model-name demo-trained ;; esac
  case $servers in *" both "*) serve_one both "$draft" --history-drafts --served-model-name demo-trained ;; esac
  "$PY" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
print(f"{'server':<8} {'conc':>5} {'out tok/s':>10} {'TPOT p50 ms':>12}")
for label in ("plain", "history", "draft", "both"):
    try:
        levels = json.load(open(f"{out}/serve-{label}.json"))["levels"]
    except OSError:
        continue
    for level in levels:
        print(f"{label:<8} {level['concurrency']:>5} {level['output_tokens_per_s']:>10.1f} {level['tpot_ms']['p50']:>12.2f}")
PY
}

for phase in $PHASES; do
  case $phase in
    widths) phase_widths ;;
    acceptance) phase_acceptance ;;
    serve) phase_serve ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
tar -czf "$OUT/results.tgz" -C "$OUT" --exclude results.tgz . 2>/dev/null
log "done"
