#!/usr/bin/env bash
# One GPU run that validates a branch and measures what it changes.
#
#   bash tools/gpu_validate.sh OUTDIR [STEP ...]      steps: suite tools align host e2e tune tunebi
#                                                     (default: suite align host e2e)
#
# Each step has its own time limit and writes OUTDIR/<step>.log, so a cut step still leaves the
# others' logs: the GPU suite (tests/gpu_suite.sh, SUITE_LIMIT_S, default 420), the tools' own GPU tests
# (tools/tests through tests/gpu_suite.sh, TOOLS_LIMIT_S), the alignment sweep, the launch / layer host
# A/B, and end-to-end prefill and decode with and without layer graphs (E2E_SHAPES, default qwen3 and
# mixtral, 8 layers; E2E_T prefill lengths; E2E_ROUNDS round-robin passes of the variants; E2E_LIMIT_S).
# The default four's limits add up to ~14 min (suite 440 s, align 90, host 90, e2e 240).
set -u
OUT=${1:?usage: gpu_validate.sh OUTDIR [STEP ...]}
shift
STEPS=${*:-suite align host e2e}
SUITE=${SUITE_LIMIT_S:-420}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
step() {  # step NAME LIMIT_S CMD...   (skipped unless NAME is in STEPS)
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  eval "RC_$name=$rc"
  echo "== $name: rc $rc in $((SECONDS - t0)) s (limit $limit s)"
}
step suite "$((SUITE + 20))" bash tests/gpu_suite.sh "$OUT/suite" "$SUITE"
[ -f "$OUT/suite/gpu_suite.log" ] && tail -4 "$OUT/suite/gpu_suite.log"
TOOLS=${TOOLS_LIMIT_S:-240}
step tools "$((TOOLS + 20))" bash tests/gpu_suite.sh "$OUT/tools" "$TOOLS" tools/tests
[ -f "$OUT/tools/gpu_suite.log" ] && tail -4 "$OUT/tools/gpu_suite.log"
step align 90 python3 tools/diag_align.py --reps 20 --json "$OUT/align.json"
[ -f "$OUT/align.log" ] && grep -v MISMATCH "$OUT/align.log" | tail -14
step host 90 python3 tools/diag_host_and_graphs.py --sections launch layer --no-profile
[ -f "$OUT/host.log" ] && grep -E '^(T=|--|jit|Fast|direct)' "$OUT/host.log"
step e2e "${E2E_LIMIT_S:-240}" python3 benchmarks/bench_e2e.py --shapes "${E2E_SHAPES:-qwen3-30b-a3b,mixtral-8x7b}" \
  --points prefill,decode --prefill-T "${E2E_T:-512,2048,8192}" --decode-batches 1,16 --new-tokens 16 \
  --variants hf,auto,auto+eager,no_moe --repeats 5 --rounds "${E2E_ROUNDS:-1}" --no-accuracy \
  --out "$OUT/e2e.json" --md "$OUT/e2e.md"
[ -f "$OUT/e2e.log" ] && tail -14 "$OUT/e2e.log"
# tune: tile tables for the TMA kernels (persistent forms too), written under OUT/tuning (copy the JSON
# files into moeflow/tuning/ after reading the log); TUNE_SHAPES, TUNE_LIMIT_S.
step tune "${TUNE_LIMIT_S:-420}" python3 benchmarks/tune_experts.py --shapes "${TUNE_SHAPES:-all}" --tma \
  --reps 6 --budget-s "$(( ${TUNE_LIMIT_S:-420} - 60 ))" --out-dir "$OUT/tuning" --log-json "$OUT/tune.json"
[ -f "$OUT/tune.log" ] && grep -E "T= |refused|tuning" "$OUT/tune.log" | tail -40
# tunebi: every T of TUNEBI_SHAPES (default: the shapes whose batch-invariant mode cost > 10% on the H100,
# `python3 benchmarks/bench_experts.py --rotation 5`)
# re-tuned with their batch-invariant families replaced (the free-BK family checked bit for bit first),
# merged into this device's own tables, written under OUT/tuning.
step tunebi "${TUNEBI_LIMIT_S:-420}" python3 benchmarks/tune_experts.py --shapes "${TUNEBI_SHAPES:-mixtral-8x7b,deepseek-v3}" \
  --tma --reps 6 --merge-from moeflow/tuning --replace-bi --budget-s "$(( ${TUNEBI_LIMIT_S:-420} - 60 ))" \
  --out-dir "$OUT/tuning" --log-json "$OUT/tunebi.json"
[ -f "$OUT/tunebi.log" ] && grep -E "batch-invariant|T= |tuning" "$OUT/tunebi.log" | tail -40
exit 0
