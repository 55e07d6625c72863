#!/usr/bin/env bash
# Nsight Compute summaries of moeflow's hot kernels (GPU): one ncu process per case of
# tools/ncu_kernels.py, then a table of every profiled kernel (OUTDIR/ncu_summary.md).
#
#   bash tools/ncu_profile.sh OUTDIR [CASE...]      # no CASE: every case, in --names order
#
# Writes OUTDIR/ncu_CASE.txt (ncu's text report + the case's own lines), OUTDIR/info_CASE.json
# (shape, T, path, tiles, un-profiled time, Triton registers / spills), OUTDIR/ncu_runs.tsv (case,
# exit status, wall seconds, note), OUTDIR/ncu_version.txt, OUTDIR/ncu_summary.md (rewritten after
# every case, so a cut-short run still has its summary).
# Clocks are never touched (--clock-control none); each case profiles one forward
# (--profile-from-start off: only the launches between cudaProfilerStart and Stop) of the python
# process alone (--target-processes application-only: no injection into Triton's ptxas / gcc).
# Environment: NCU (the ncu binary, default ncu), PYTHON (default python3), NCU_CASE_TIMEOUT (s per
# case, default 60), NCU_BUDGET_S (no case starts after this many seconds and none runs past it,
# default 225; the pre-compile counts), NCU_PREWARM_JOBS (parallel pre-compile processes, default 4;
# 0: none), NCU_PREWARM_S (the pre-compile's time limit, default 90), NCU_EXTRA (more ncu arguments,
# word-split), NCU_CASE_ARGS (more ncu_kernels.py arguments, word-split; the CPU test passes --tiny
# with a stand-in ncu). A case that times out with PDL on is profiled once more with --no-pdl
# (ncu_kernels.py: KernelOptions(pdl=False); ncu_runs.tsv says so; the first report is kept as
# OUTDIR/pdl_timeout_CASE.txt).
set -u
OUT=${1:?usage: ncu_profile.sh OUTDIR [CASE...]}
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PY=${PYTHON:-python3}
NCU=${NCU:-ncu}
CASE_TIMEOUT=${NCU_CASE_TIMEOUT:-60}
BUDGET=${NCU_BUDGET_S:-225}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
mkdir -p "$OUT"
if ! command -v "$NCU" >/dev/null 2>&1; then
  echo "ncu_profile: '$NCU' not found on PATH (set NCU=/path/to/ncu)" >&2
  exit 2
fi
if [ $# -gt 0 ]; then
  CASES=("$@")
else
  mapfile -t CASES < <("$PY" "$HERE/ncu_kernels.py" --names)
fi
"$NCU" --version 2>&1 | tail -n 1 > "$OUT/ncu_version.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv \
  > "$OUT/gpu.txt" 2>/dev/null || rm -f "$OUT/gpu.txt"
echo "ncu_profile: $(cat "$OUT/ncu_version.txt"); ${#CASES[@]} cases; budget ${BUDGET}s, ${CASE_TIMEOUT}s a case"

# shellcheck disable=SC2206
EXTRA=(${NCU_EXTRA:-})
# shellcheck disable=SC2206
CASE_ARGS=(${NCU_CASE_ARGS:-})

# Sections: the standard identifiers, less any this ncu does not list (an unknown one is an error).
SECTIONS=(SpeedOfLight MemoryWorkloadAnalysis ComputeWorkloadAnalysis Occupancy LaunchStats WarpStateStats)
SECTION_ARGS=()
known_sections=$(timeout 20 "$NCU" --list-sections 2>/dev/null || true)
for s in "${SECTIONS[@]}"; do
  if [ -z "$known_sections" ] || grep -qw -- "$s" <<<"$known_sections"; then
    SECTION_ARGS+=(--section "$s")
  else
    echo "ncu_profile: this ncu has no section $s: left out" >&2
  fi
done
# Tensor-pipe utilisation and DRAM bytes: only metrics this ncu knows for this GPU (an unknown metric is an error).
METRIC_ARGS=()
known_metrics=$(timeout 20 "$NCU" --query-metrics 2>/dev/null || true)
metrics=""
for m in sm__pipe_tensor_op_gmma_cycles_active sm__pipe_tensor_op_hmma_cycles_active; do
  if grep -qw -- "$m" <<<"$known_metrics"; then
    metrics="${metrics:+$metrics,}$m.avg.pct_of_peak_sustained_active"
  fi
done
# DRAM bytes read and written (which operand a kernel re-reads shows here, not in a throughput %)
for m in dram__bytes_read dram__bytes_write; do
  if grep -qw -- "$m" <<<"$known_metrics"; then
    metrics="${metrics:+$metrics,}$m.sum"
  fi
done
if [ -n "$metrics" ]; then
  METRIC_ARGS=(--metrics "$metrics")
fi
echo "ncu_profile: sections ${SECTION_ARGS[*]}; extra metrics: ${metrics:-none}"
NCU_ARGS=(--clock-control none --target-processes application-only --profile-from-start off
  ${SECTION_ARGS[@]+"${SECTION_ARGS[@]}"} ${METRIC_ARGS[@]+"${METRIC_ARGS[@]}"} --print-summary none
  ${EXTRA[@]+"${EXTRA[@]}"})
echo "ncu ${NCU_ARGS[*]} $PY tools/ncu_kernels.py CASE --info-json OUTDIR/info_CASE.json" \
  > "$OUT/ncu_command.txt"

# Pre-compile: every case's warm-up forward in NCU_PREWARM_JOBS parallel processes without ncu
# (at most NCU_PREWARM_S seconds), so the profiled processes find their kernels in Triton's disk
# cache instead of compiling one case at a time. Four at once stay under ~120 GB of GPU memory
# (the deepseek-v3 cases hold 34-38 GB each while they build). 0 turns it off.
PREWARM_JOBS=${NCU_PREWARM_JOBS:-4}
if [ "$PREWARM_JOBS" -gt 0 ]; then
  pw0=$(date +%s)
  printf '%s\n' "${CASES[@]}" | timeout -k 5 "${NCU_PREWARM_S:-90}" xargs -P "$PREWARM_JOBS" -I{} \
    "$PY" "$HERE/ncu_kernels.py" {} --compile-only ${CASE_ARGS[@]+"${CASE_ARGS[@]}"} > "$OUT/prewarm.log" 2>&1
  echo "ncu_profile: pre-compile rc=$? in $(( $(date +%s) - pw0 ))s ($PREWARM_JOBS at once; log $OUT/prewarm.log)"
fi

profile_case() {  # CASE TIMEOUT_S [ncu_kernels.py ARGS...]: one ncu process, its text report in OUTDIR/ncu_CASE.txt
  local c=$1 t=$2
  shift 2
  timeout -k 5 "$t" "$NCU" "${NCU_ARGS[@]}" \
    "$PY" "$HERE/ncu_kernels.py" "$c" --info-json "$OUT/info_$c.json" ${CASE_ARGS[@]+"${CASE_ARGS[@]}"} "$@" \
    > "$OUT/ncu_$c.txt" 2>&1
}
case " ${CASE_ARGS[*]-} " in *" --no-pdl "*) PDL_ON=0 ;; *) PDL_ON=1 ;; esac

printf 'case\trc\twall_s\tnote\n' > "$OUT/ncu_runs.tsv"
for c in "${CASES[@]}"; do
  now=$(date +%s)
  left=$((BUDGET - (now - START)))
  if [ "$left" -lt 15 ]; then
    printf '%s\t-\t0\tskipped: %ss budget spent\n' "$c" "$BUDGET" >> "$OUT/ncu_runs.tsv"
    echo "ncu_profile: $c skipped (budget of ${BUDGET}s spent)"
    continue
  fi
  to=$CASE_TIMEOUT
  if [ "$left" -lt "$to" ]; then to=$left; fi
  t0=$(date +%s.%N)
  profile_case "$c" "$to"
  rc=$?
  if [ -n "$metrics" ] && grep -qiE "==ERROR==.*metric" "$OUT/ncu_$c.txt"; then
    # this ncu refused the extra metrics after all: drop them for this case and the rest
    echo "ncu_profile: ncu refused --metrics $metrics: profiling without them" >&2
    metrics=""
    NCU_ARGS=(--clock-control none --target-processes application-only --profile-from-start off
      ${SECTION_ARGS[@]+"${SECTION_ARGS[@]}"} --print-summary none ${EXTRA[@]+"${EXTRA[@]}"})
    echo "ncu ${NCU_ARGS[*]} $PY tools/ncu_kernels.py CASE --info-json OUTDIR/info_CASE.json" \
      > "$OUT/ncu_command.txt"
    left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt "$to" ]; then to=$left; fi
    if [ "$to" -gt 5 ]; then
      profile_case "$c" "$to"
      rc=$?
    fi
  fi
  pdl_note=""
  if { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && [ "$PDL_ON" = 1 ]; then
    # A case that timed out gets one more try, with programmatic dependent launch off: under ncu's kernel
    # replay the Gluon fp8 gate_up at qwen3-235b T=8192 hung in 2 of 10 H100 runs with PDL on (never outside
    # ncu, 2000 forwards), and the retry without PDL profiled it (`bash tools/ncu_profile.sh OUT
    # quant_fp8_prefill_t8192_qwen3_235b`). PDL changes when a kernel may start, not what it computes, so
    # the per-kernel sections stay comparable; the note and the kept report (pdl_timeout_CASE.txt, a name
    # the summary does not read as a case) say so.
    left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt "$to" ]; then to=$left; fi
    if [ "$to" -ge 15 ]; then
      mv "$OUT/ncu_$c.txt" "$OUT/pdl_timeout_${c}.txt"
      echo "ncu_profile: $c timed out with PDL on: profiling it again with --no-pdl" >&2
      profile_case "$c" "$to" --no-pdl
      rc=$?
      pdl_note="timed out with PDL on; profiled with --no-pdl"
    fi
  fi
  wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  note=$pdl_note
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    note="timeout after ${to}s${pdl_note:+, with PDL on and again with --no-pdl}"
  elif grep -q "No kernels were profiled" "$OUT/ncu_$c.txt"; then
    note="no kernels profiled"
  elif [ "$rc" -ne 0 ]; then
    note=$(grep -m1 -E "Error|ERROR|error:" "$OUT/ncu_$c.txt" | tr '\t' ' ' | cut -c1-160)
  fi
  printf '%s\t%s\t%s\t%s\n' "$c" "$rc" "$wall" "$note" >> "$OUT/ncu_runs.tsv"
  echo "ncu_profile: $c rc=$rc ${wall}s ${note}"
  "$PY" "$HERE/ncu_kernels.py" summarize "$OUT" > /dev/null 2>&1 || true
  if grep -q "ERR_NVGPUCTRPERM" "$OUT/ncu_$c.txt"; then
    echo "ncu_profile: no permission for GPU performance counters (ERR_NVGPUCTRPERM): stopping" >&2
    break
  fi
done
"$PY" "$HERE/ncu_kernels.py" summarize "$OUT"
echo "ncu_profile: done in $(( $(date +%s) - START ))s; summary in $OUT/ncu_summary.md"
