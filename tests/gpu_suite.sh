#!/usr/bin/env bash
# The GPU test suite on a lent GPU machine, with every test named as it finishes.
#
#   bash tests/gpu_suite.sh OUTDIR [TIME_LIMIT_S] [pytest args / test files ...]
#   bash tests/gpu_suite.sh OUTDIR 240 tools/tests      # the tools' own GPU tests (not the product's)
#
# Why a script: pyproject's addopts carry -q, so `pytest -m gpu -n 8 -v` prints dots only, and a
# run cut by its time limit never writes its junit file, so its summary ("48 passed, 1 failed,
# 2 unfinished") names no test. Here addopts are cleared (-o addopts=), xdist prints
# one "[gwN] PASSED/FAILED <test id>" line per test as it ends, each test has its own timeout
# (pytest-timeout, when installed), and the last lines list the failures and the tests that
# never reported. Writes OUTDIR/gpu_suite.log and OUTDIR/gpu_junit.xml (when pytest ends).
set -u
OUT=${1:?usage: gpu_suite.sh OUTDIR [TIME_LIMIT_S] [pytest args ...]}
LIMIT=${2:-540}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(tests/)
PER_TEST=()
python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 240)
export PYTHONUNBUFFERED=1
timeout "$LIMIT" python3 -m pytest -o addopts= -m gpu -n 8 -v -p no:cacheprovider -rfE "${PER_TEST[@]}" \
  --junitxml="$OUT/gpu_junit.xml" "${ARGS[@]}" >"$OUT/gpu_suite.log" 2>&1
rc=$?
echo "pytest rc=$rc (124: cut by the ${LIMIT}s limit)" >>"$OUT/gpu_suite.log"
python3 - "$OUT/gpu_suite.log" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
done = {}
for m in re.finditer(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", text, re.M):
    done[m.group(2)] = m.group(1)
counts = {}
for v in done.values():
    counts[v] = counts.get(v, 0) + 1
print("by outcome:", counts)
for t, v in sorted(done.items()):
    if v in ("FAILED", "ERROR", "XPASS"):
        print(v, t)
m = re.search(r"(\d+) workers \[(\d+) items\]", text)
if m and int(m.group(2)) > len(done):
    print(f"{int(m.group(2)) - len(done)} of {m.group(2)} tests never reported (cut by the time limit)")
print(text.strip().splitlines()[-1])
EOF
exit $rc
