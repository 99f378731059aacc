#!/usr/bin/env bash
# The GPU host's phases, one device command each (or chained with commas). Run from the
# repo root with the offline bundle in .gpu-bundle/ (../shared/gpu/README.md: FlashInfer,
# xgrammar, prebuilt FlashInfer modules) and $OUT naming the folder whose files come back.
# Output stays short; logs and results go to $OUT.
#
#   bash benchmarks/gpu/run.sh test
#       python -m pytest -m "gpu and not multigpu", the test ids shared among JOBS (default
#       6) processes so the kernels' compiles run side by side, the processes spread over
#       the visible GPUs; log: $OUT/pytest-gpu.log. TEST_FILES (paths) and TEST_SKIP (an
#       extended regex of ids to leave out) split the suite over several commands; each
#       process stops after TEST_TIMEOUT s (default 500: exit code 124 in its log);
#       TEST_SPREAD=rr deals the ids round-robin (default: consecutive ids together);
#       TEST_ALONE (an extended regex) gives each id it matches a process of its own, out
#       of JOBS (the tests that compile for minutes: on a fresh 2 x H200 host with JOBS=28,
#       test_every_arrangement_gives_the_same_streams and test_memory_is_flat_over_20000_
#       churn_steps ran past 540 s beside four others and not alone)
#       Each process logs its Triton compiles (`gpu/compile_log.py`); all of them end up in
#       $OUT/compiles.log, to refresh benchmarks/gpu/compiles.log.gz with
#   bash benchmarks/gpu/run.sh precompile
#       every kernel variant in benchmarks/gpu/compiles.log.gz (and the logs named in
#       PRECOMPILE_LOGS) compiled into Triton's disk cache side by side, in PRECOMPILE_JOBS
#       processes (default: the host's cores), before `test` on a fresh host: there each
#       variant of the sampler's row kernels takes 60-100 s, one after another inside a
#       test; log: $OUT/precompile.log
#   bash benchmarks/gpu/run.sh multigpu
#       python -m pytest -m "gpu and multigpu" on every visible GPU, one file at a time
#       (MULTIGPU_FILES, default every test file with such tests), each under `timeout`
#       (MULTIGPU_TIMEOUT s, default 300); log: $OUT/pytest-multigpu.log
#   bash benchmarks/gpu/run.sh tpsample
#       benchmarks/bench_distributed.py --worlds T (T = the visible GPUs), under `timeout`
#       (TP_TIMEOUT s, default 240); log: $OUT/bench-tp.log
#   bash benchmarks/gpu/run.sh tpstep
#       benchmarks/bench_tp_step.py --model TP_MODEL (default llama-3.2-1b) --worlds 1 T,
#       under `timeout` (TP_TIMEOUT s, default 240); log: $OUT/bench-tp.log
#   bash benchmarks/gpu/run.sh bench [BUDGET_S] [bench_sampler args...]
#       benchmarks/bench_sampler.py --out $OUT --time-budget BUDGET_S (default 420), then
#       its tables and targets (plot_sampler.py); log: $OUT/bench-sampler.log. To go on
#       with a sweep in a later command, carry the day's JSON in the tree, name it in
#       SAMPLER_RESUME (copied into $OUT first) and pass --resume.
#   bash benchmarks/gpu/run.sh verify [BUDGET_S] [bench_verify args...]
#       benchmarks/bench_verify.py --out $OUT --time-budget BUDGET_S (default 420), then
#       its table (plot_verify.py --markdown); log: $OUT/bench-verify.log
#   bash benchmarks/gpu/run.sh step [bench_step args...]
#       benchmarks/bench_step.py --out $OUT; log: $OUT/bench-step.log
#   bash benchmarks/gpu/run.sh matmul [bench_matmul args...]
#       benchmarks/bench_matmul.py --out $OUT; log: $OUT/bench-matmul.log
#   bash benchmarks/gpu/run.sh check [determinism_check args...]
#       tools/determinism_check.py; log: $OUT/determinism-check.log
#   bash benchmarks/gpu/run.sh phases [sampler_phases args...]
#       benchmarks/sampler_phases.py --out $OUT (the row tail's phase clocks); log:
#       $OUT/sampler-phases.log
#   bash benchmarks/gpu/run.sh prims [row_primitives args...]
#       benchmarks/row_primitives.py --out $OUT (the cycles of a row program's block-level
#       primitives: scans, sums, histograms, sorts); log: $OUT/row-primitives.log
#   bash benchmarks/gpu/run.sh serve [bench_serve args...]
#       benchmarks/bench_serve.py --out $OUT (the server's load test); log: $OUT/bench-serve.log
#   bash benchmarks/gpu/run.sh pack
#       everything under $OUT into $OUT/out.tgz, the rest removed: the device tool brings
#       back 8 files at most (a command that writes more loses the others); run it last
set -uo pipefail

usage="usage: bash benchmarks/gpu/run.sh PHASE[,PHASE...] [ARGS...] (test precompile multigpu tpsample tpstep bench verify step matmul check serve phases prims pack)"
phases=${1:?$usage}
shift
: "${OUT:?OUT must name the folder whose files come back}"
mkdir -p "$OUT"
# once per host and bundle, under a lock: run.sh calls started side by side (one per GPU)
# would each reinstall it, and pip's --target upgrade removes the packages another's
# Python has loaded
stamp="/tmp/site/.bundle-$(ls -l .gpu-bundle | cksum | cut -d' ' -f1)"
lock=() && command -v flock >/dev/null && lock=(flock /tmp/gpu-bundle.lock)  # util-linux
"${lock[@]}" bash -c "[ -f $stamp ] || { bash .gpu-bundle/install.sh && touch $stamp; }" \
    >/dev/null && export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks/gpu MAX_JOBS=16 \
    FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1 || { echo "bundle install failed"; exit 1; }
[ -f .gpu-bundle/commit ] && export GRAPHEXEC_COMMIT=$(cat .gpu-bundle/commit)
ngpu=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")

run_tests() {
    local log="$OUT/pytest-gpu.log" jobs=${JOBS:-6} rc=0 i dir=/tmp/pytest-gpu
    rm -rf "$dir" && mkdir -p "$dir"
    python -c "import datetime, torch, triton; print(torch.cuda.get_device_name(), \
'torch', torch.__version__, 'triton', triton.__version__, datetime.date.today())" >"$log" 2>&1
    [ -n "${GRAPHEXEC_COMMIT:-}" ] && echo "commit $GRAPHEXEC_COMMIT" >>"$log"
    # TEST_FILES (default tests) splits the suite over several device commands
    python -m pytest -m "gpu and not multigpu" --collect-only -q ${TEST_FILES:-tests} \
        2>/dev/null | grep '::' | grep -v -E "${TEST_SKIP:-^$}" >"$dir/ids"
    echo "python -m pytest -m 'gpu and not multigpu': $(wc -l <"$dir/ids") tests in $jobs" \
        "processes on $ngpu GPUs" | tee -a "$log"
    # consecutive ids (one file's tests share kernel specialisations) in one process: a
    # Triton kernel is compiled by each process that needs it before the shared cache has
    # it, and a fresh host compiles everything (tens of seconds a variant); TEST_SPREAD=rr
    # deals them round-robin instead (a file whose cases each compile their own kernels)
    grep -E "${TEST_ALONE:-^$}" "$dir/ids" >"$dir/alone"
    grep -v -E "${TEST_ALONE:-^$}" "$dir/ids" >"$dir/rest"
    local alone=$(wc -l <"$dir/alone")
    local rest=$(( jobs > alone ? jobs - alone : 1 ))
    # TEST_ALONE is for single ids: matching whole files leaves the rest few processes
    (( alone > jobs / 2 )) && echo "warning: TEST_ALONE matches $alone ids; the other" \
        "$(wc -l <"$dir/rest") share $rest process(es)" | tee -a "$log"
    local per=$(( ($(wc -l <"$dir/rest") + rest - 1) / rest ))
    [ "${TEST_SPREAD:-}" = rr ] && per=0
    local groups=$(( jobs > alone ? jobs : alone + 1 ))
    for ((i = 0; i < groups; i++)); do
        if ((i < alone)); then
            sed -n "$((i + 1))p" "$dir/alone" >"$dir/ids.$i"
        else
            awk -v per="$per" -v i="$((i - alone))" -v jobs="$rest" \
                '(per ? int((NR - 1) / per) : (NR - 1) % jobs) == i' "$dir/rest" >"$dir/ids.$i"
        fi
        [ -s "$dir/ids.$i" ] || continue
        # each group under TEST_TIMEOUT s (default 500), so that the log below still comes
        # back inside one device command's limit when a group overruns or hangs; without
        # pytest's 240 s traceback dump, which segfaulted a compiling test there (Python
        # 3.12, in a "<shim>" frame)
        (CUDA_VISIBLE_DEVICES=$((i % ngpu)) COMPILE_LOG="$dir/compiles.$i" \
            timeout -k 10 "${TEST_TIMEOUT:-500}" \
            xargs -a "$dir/ids.$i" -d '\n' python -m pytest -q -p no:cacheprovider -rA \
            -o faulthandler_timeout=0 -p compile_log \
            --durations=5 >"$dir/log.$i" 2>&1; echo "exit code: $?" >>"$dir/log.$i") &
    done
    wait
    for ((i = 0; i < groups; i++)); do
        [ -f "$dir/log.$i" ] || continue
        { echo "== group $i"; cat "$dir/log.$i"; } >>"$log"
        grep -E "passed|failed|error|skipped" "$dir/log.$i" | tail -n 1
        grep -E "^(FAILED|ERROR) " "$dir/log.$i" | cut -c1-200
        grep -q "exit code: 0$" "$dir/log.$i" || rc=1
    done
    cat "$dir"/compiles.* >"$OUT/compiles.log" 2>/dev/null
    echo "pytest -m gpu exit code: $rc" | tee -a "$log"
    return "$rc"
}

precompile() {
    local log="$OUT/precompile.log" code
    python benchmarks/gpu/precompile.py --jobs "${PRECOMPILE_JOBS:-$(nproc)}" \
        benchmarks/gpu/compiles.log.gz ${PRECOMPILE_LOGS:-} >"$log" 2>&1
    code=$?
    echo "precompile exit code: $code"
    grep -E "^precompiled|not compiled" "$log" | head -n 12 | cut -c1-200
    [ "$code" = 0 ]
}

run_multigpu() {
    local log="$OUT/pytest-multigpu.log" rc=0 f
    python -c "import datetime, torch; print(torch.cuda.device_count(), 'x', \
torch.cuda.get_device_name(), 'torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), \
datetime.date.today())" 2>&1 | tee "$log"
    nvidia-smi topo -m >>"$log" 2>&1
    for f in ${MULTIGPU_FILES:-$(grep -rl --include="test_*.py" "mark.multigpu" tests)}; do
        timeout -k 10 "${MULTIGPU_TIMEOUT:-300}" python -m pytest -m "gpu and multigpu" -q \
            -p no:cacheprovider -rA --durations=10 "$f" >>"$log" 2>&1
        local code=$?
        echo "$f: exit code $code$([ $code = 124 ] && echo ' (timed out)')" | tee -a "$log"
        [ $code = 0 ] || rc=1
        tail -n 4 "$log" | grep -E "passed|failed|skipped" | cut -c1-200
    done
    grep -E "^(FAILED|ERROR) " "$log" | cut -c1-300
    echo "pytest -m 'gpu and multigpu' exit code: $rc" | tee -a "$log"
    return "$rc"
}

tpsample() {
    local log="$OUT/bench-tp.log" code
    timeout -k 10 "${TP_TIMEOUT:-240}" python benchmarks/bench_distributed.py \
        --worlds "$ngpu" --out "$OUT" >>"$log" 2>&1
    code=$?
    echo "bench_distributed exit code: $code"
    grep -A 12 "^| T | B | V" "$log"
    [ "$code" = 0 ]
}

tpstep() {
    local log="$OUT/bench-tp.log" code
    timeout -k 10 "${TP_TIMEOUT:-240}" python benchmarks/bench_tp_step.py \
        --model "${TP_MODEL:-llama-3.2-1b}" --worlds 1 "$ngpu" --out "$OUT" >>"$log" 2>&1
    code=$?
    echo "bench_tp_step exit code: $code"
    grep -A 12 "^| T | B | step" "$log"
    [ "$code" = 0 ]
}

bench() {
    local budget=${1:-420} log="$OUT/bench-sampler.log" json
    shift $(($# < 1 ? $# : 1))
    if [ -n "${SAMPLER_RESUME:-}" ]; then
        cp "$SAMPLER_RESUME" "$OUT"/ || { echo "SAMPLER_RESUME: no $SAMPLER_RESUME"; return 1; }
    fi
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

# a benchmark script with --out "$OUT" and ARGS: its log ($OUT/LOG), exit code and last
# LINES lines
script() {
    local py=$1 log="$OUT/$2" lines=$3 code
    shift 3
    python "$py" --out "$OUT" "$@" >"$log" 2>&1
    code=$?
    echo "$(basename "$py" .py) exit code: $code"
    tail -n "$lines" "$log"
}

step() { script benchmarks/bench_step.py bench-step.log 25 "$@"; }
matmul() { script benchmarks/bench_matmul.py bench-matmul.log 30 "$@"; }
phases() { script benchmarks/sampler_phases.py sampler-phases.log 40 "$@"; }
prims() { script benchmarks/row_primitives.py row-primitives.log 40 "$@"; }
serve() { script benchmarks/bench_serve.py bench-serve.log 20 "$@"; }

check() {
    python tools/determinism_check.py "$@" >"$OUT/determinism-check.log" 2>&1
    echo "determinism_check exit code: $?"
    grep -v "^INFO" "$OUT/determinism-check.log" | tail -n 40
}

rc=0
for phase in ${phases//,/ }; do
    case "$phase" in
    test) run_tests || rc=1 ;;
    precompile) precompile || rc=1 ;;
    multigpu) run_multigpu || rc=1 ;;
    tpsample) tpsample || rc=1 ;;
    tpstep) tpstep || rc=1 ;;
    bench) bench "$@" || rc=1 ;;
    verify) verify "$@" || rc=1 ;;
    step) step "$@" || rc=1 ;;
    matmul) matmul "$@" || rc=1 ;;
    check) check "$@" || rc=1 ;;
    serve) serve "$@" || rc=1 ;;
    phases) phases "$@" || rc=1 ;;
    prims) prims "$@" || rc=1 ;;
    pack) tar czf /tmp/out.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete \
        && mv /tmp/out.tgz "$OUT"/ || rc=1 ;;
    *) echo "$usage"; exit 2 ;;
    esac
done
exit "$rc"
