#!/usr/bin/env bash
# The GPU host's phases, one device command each (or chained with commas). Run from the
# repo root with the offline bundle in .gpu-bundle/ (../shared/gpu/README.md: FlashInfer,
# xgrammar, prebuilt FlashInfer modules) and $OUT naming the folder whose files come back.
# Output stays short; logs and results go to $OUT.
#
#   bash benchmarks/gpu/run.sh test
#       python -m pytest -m gpu, the test ids shared among JOBS (default 6) processes so
#       the kernels' compiles run side by side; log: $OUT/pytest-gpu.log
#   bash benchmarks/gpu/run.sh bench [BUDGET_S] [bench_sampler args...]
#       benchmarks/bench_sampler.py --out $OUT --time-budget BUDGET_S (default 420), then
#       its tables and targets (plot_sampler.py); log: $OUT/bench-sampler.log
#   bash benchmarks/gpu/run.sh verify [BUDGET_S] [bench_verify args...]
#       benchmarks/bench_verify.py --out $OUT --time-budget BUDGET_S (default 420), then
#       its table (plot_verify.py --markdown); log: $OUT/bench-verify.log
#   bash benchmarks/gpu/run.sh step [bench_step args...]
#       benchmarks/bench_step.py --out $OUT; log: $OUT/bench-step.log
#   bash benchmarks/gpu/run.sh matmul [bench_matmul args...]
#       benchmarks/bench_matmul.py --out $OUT; log: $OUT/bench-matmul.log
#   bash benchmarks/gpu/run.sh check [determinism_check args...]
#       tools/determinism_check.py; log: $OUT/determinism-check.log
#   bash benchmarks/gpu/run.sh serve [bench_serve args...]
#       benchmarks/bench_serve.py --out $OUT (the server's load test); log: $OUT/bench-serve.log
set -uo pipefail

usage="usage: bash benchmarks/gpu/run.sh PHASE[,PHASE...] [ARGS...] (test bench verify step matmul check serve)"
phases=${1:?$usage}
shift
: "${OUT:?OUT must name the folder whose files come back}"
mkdir -p "$OUT"
bash .gpu-bundle/install.sh >/dev/null && export PYTHONPATH=/tmp/site:$PWD MAX_JOBS=16 \
    FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1 || { echo "bundle install failed"; exit 1; }
[ -f .gpu-bundle/commit ] && export GRAPHEXEC_COMMIT=$(cat .gpu-bundle/commit)

run_tests() {
    local log="$OUT/pytest-gpu.log" jobs=${JOBS:-6} rc=0 i dir=/tmp/pytest-gpu
    rm -rf "$dir" && mkdir -p "$dir"
    python -c "import datetime, torch, triton; print(torch.cuda.get_device_name(), \
'torch', torch.__version__, 'triton', triton.__version__, datetime.date.today())" >"$log" 2>&1
    [ -n "${GRAPHEXEC_COMMIT:-}" ] && echo "commit $GRAPHEXEC_COMMIT" >>"$log"
    python -m pytest -m gpu --collect-only -q 2>/dev/null | grep '::' >"$dir/ids"
    echo "python -m pytest -m gpu: $(wc -l <"$dir/ids") tests in $jobs processes" | tee -a "$log"
    for ((i = 0; i < jobs; i++)); do
        awk -v n="$jobs" -v i="$i" '(NR - 1) % n == i' "$dir/ids" >"$dir/ids.$i"
        [ -s "$dir/ids.$i" ] || continue
        (xargs -a "$dir/ids.$i" -d '\n' python -m pytest -q -p no:cacheprovider -rA \
            >"$dir/log.$i" 2>&1; echo "exit code: $?" >>"$dir/log.$i") &
    done
    wait
    for ((i = 0; i < jobs; i++)); do
        [ -f "$dir/log.$i" ] || continue
        { echo "== group $i"; cat "$dir/log.$i"; } >>"$log"
        grep -E "passed|failed|error|skipped" "$dir/log.$i" | tail -n 1
        grep -E "^(FAILED|ERROR) " "$dir/log.$i" | cut -c1-200
        grep -q "exit code: 0$" "$dir/log.$i" || rc=1
    done
    echo "pytest -m gpu exit code: $rc" | tee -a "$log"
    return "$rc"
}

bench() {
    local budget=${1:-420} log="$OUT/bench-sampler.log" json
    shift $(($# < 1 ? $# : 1))
    python benchmarks/bench_sampler.py --out "$OUT" --time-budget "$budget" "$@" >"$log" 2>&1
    echo "bench_sampler exit code: $?"
    grep -E "ERROR|skipped|^wrote" "$log" | cut -c1-240
    for json in "$OUT"/sampler-*.json; do
        [ -e "$json" ] || continue
        python benchmarks/plot_sampler.py "$json" --markdown --targets 2>&1 | tee -a "$log"
    done
}

verify() {
    local budget=${1:-420} log="$OUT/bench-verify.log" json
    shift $(($# < 1 ? $# : 1))
    python benchmarks/bench_verify.py --out "$OUT" --time-budget "$budget" "$@" >"$log" 2>&1
    echo "bench_verify exit code: $?"
    grep -E "ERROR|WARNING|skipped|^wrote|^no plot" "$log" | cut -c1-240 | head -n 30
    for json in "$OUT"/verify-*.json; do
        [ -e "$json" ] || continue
        python benchmarks/plot_verify.py "$json" --markdown --no-png 2>&1 | tee -a "$log"
    done
}

step() {
    python benchmarks/bench_step.py --out "$OUT" "$@" >"$OUT/bench-step.log" 2>&1
    echo "bench_step exit code: $?"
    tail -n 25 "$OUT/bench-step.log"
}

matmul() {
    python benchmarks/bench_matmul.py --out "$OUT" "$@" >"$OUT/bench-matmul.log" 2>&1
    echo "bench_matmul exit code: $?"
    tail -n 30 "$OUT/bench-matmul.log"
}

check() {
    python tools/determinism_check.py "$@" >"$OUT/determinism-check.log" 2>&1
    echo "determinism_check exit code: $?"
    grep -v "^INFO" "$OUT/determinism-check.log" | tail -n 40
}

serve() {
    python benchmarks/bench_serve.py --out "$OUT" "$@" >"$OUT/bench-serve.log" 2>&1
    echo "bench_serve exit code: $?"
    tail -n 20 "$OUT/bench-serve.log"
}

rc=0
for phase in ${phases//,/ }; do
    case "$phase" in
    test) run_tests || rc=1 ;;
    bench) bench "$@" || rc=1 ;;
    verify) verify "$@" || rc=1 ;;
    step) step "$@" || rc=1 ;;
    matmul) matmul "$@" || rc=1 ;;
    check) check "$@" || rc=1 ;;
    serve) serve "$@" || rc=1 ;;
    *) echo "$usage"; exit 2 ;;
    esac
done
exit "$rc"
