#!/usr/bin/env bash
# Sampler work on the GPU host (issue 4), one phase per device command. Run it from the repo
# root with the offline bundle in .gpu-bundle/ (../shared/gpu/README.md) and $OUT naming a
# folder whose files come back (at most 8 files). Output stays short; details go to $OUT.
#
#   bash benchmarks/gpu_sampler.sh jit
#       builds FlashInfer's sampling and cake_sampling JIT modules (about 80 s + 300 s on a
#       fresh host) and copies each built ~/.cache/flashinfer/*/90a/cached_ops/NAME/NAME.so
#       to $OUT/aot-NAME.so; put each at .gpu-bundle/aot/NAME/NAME.so so that later hosts
#       load it without a build. Log: $OUT/jit.log.
#   bash benchmarks/gpu_sampler.sh test
#       python -m pytest -m gpu, its test ids shared among JOBS (default 6) processes run
#       side by side; log (with the GPU and the exit code): $OUT/pytest-gpu.log.
#   bash benchmarks/gpu_sampler.sh bench [BUDGET_S] [PREVIOUS_JSON] [bench_sampler args...]
#       bench_sampler.py over its default grid (fp32 and bf16) with --time-budget BUDGET_S
#       (default 420) and --append, results in $OUT, then the issue-4 targets table. With
#       PREVIOUS_JSON (a path in the tree; "-" for none) it is copied into $OUT first and the
#       run adds --resume: blocks already in it are skipped, so the sweep goes on where it
#       stopped (--append merges only a file of the same name: same device, same date).
#       Log: $OUT/bench-sampler.log.
#   bash benchmarks/gpu_sampler.sh tune [tune_sampler args...]
#       benchmarks/tune_sampler.py --out $OUT/tune.json, then its table. Log: $OUT/tune.log.
#   bash benchmarks/gpu_sampler.sh prof [kernel_times.py args...]
#       benchmarks/probes/kernel_times.py: each kernel's time of one step per (case, B)
#       (torch.profiler); log: $OUT/prof.log.
#   bash benchmarks/gpu_sampler.sh warm
#       benchmarks/warm_sampler.py once per argument set of $WARM_SETS ("|" between sets),
#       side by side: the Triton kernels of the graphexec methods compiled in parallel
#       before the timed phases. Log: $OUT/warm.log.
#   bash benchmarks/gpu_sampler.sh all [BUDGET_S] [PREVIOUS_JSON] [...]     # test, then bench
#   Phases may be chained with commas (test,tune); ARGS go to bench, tune and prof.
#
# Without .gpu-bundle/aot/ modules the first FlashInfer call in bench builds them inside the
# timed run (the time budget only stops new blocks from starting): run `jit` first and put
# its modules under .gpu-bundle/aot/. Seen on an H100 host: in a second command on the same
# warm host, the cake module was built again (more than 5 minutes), so the JIT cache left by
# `jit` is not enough; with the modules under aot/ the first cake call took 0.1 s.
set -uo pipefail

usage="usage: bash benchmarks/gpu_sampler.sh PHASE[,PHASE...] [ARGS...] (jit test warm bench tune prof all)"
phase=${1:?$usage}
shift
: "${OUT:?OUT must name the folder whose files come back}"
mkdir -p "$OUT"
bash .gpu-bundle/install.sh >/dev/null && export PYTHONPATH=/tmp/site:$PWD MAX_JOBS=16 \
    FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1 || { echo "bundle install failed"; exit 1; }
[ -f .gpu-bundle/commit ] && export GRAPHEXEC_COMMIT=$(cat .gpu-bundle/commit)

# Triton compiles each kernel specialisation on first use (the row-draw kernel takes
# 20-30 s); a host starts with an empty cache. A cache saved by an earlier command of the
# same code (.gpu-bundle/triton-cache.txz, from $OUT) is restored first and the grown one
# saved at the end, so later commands skip the compiles. Saved whole, the cache of one
# `test` phase passed the 16 MB a returned file may hold (2026-11-25), so only what a
# cache hit loads is kept (benchmarks/prune_triton_cache.py: binaries and metadata).
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .gpu-bundle/triton-cache.txz ]; then
    tar xJf .gpu-bundle/triton-cache.txz -C "$TRITON_CACHE_DIR" 2>/dev/null ||
        echo "triton-cache.txz unreadable: kernels compile afresh"
fi
# Written under a temporary name and renamed when whole: a command cut by its time limit
# while compressing (2026-11-25: a 275 MB cache, single-threaded xz) left a truncated
# archive under the final name, which the next command could not read.
save_cache() {
    local part="$OUT/triton-cache.part"
    python benchmarks/prune_triton_cache.py "$TRITON_CACHE_DIR"
    tar cf - -C "$TRITON_CACHE_DIR" . 2>/dev/null | xz -T0 -3 >"$part" || { rm -f "$part"; return; }
    if [ "$(stat -c %s "$part")" -gt 16000000 ]; then
        rm -f "$part"
        echo "triton cache over 16 MB after pruning: not saved"
    else
        mv "$part" "$OUT/triton-cache.txz"
    fi
}
trap save_cache EXIT

jit() {
    python benchmarks/bench_sampler.py --jit-only --methods flashinfer >"$OUT/jit.log" 2>&1
    local rc=$? n=0 so name
    grep -E "ERROR|^first-call" "$OUT/jit.log" | cut -c1-300
    for so in ~/.cache/flashinfer/*/90a/cached_ops/*/*.so; do
        [ -e "$so" ] || continue
        name=$(basename "$(dirname "$so")")
        [ "$(basename "$so")" = "$name.so" ] || continue
        cp "$so" "$OUT/aot-$name.so" && n=$((n + 1))
        echo "aot-$name.so: $(stat -c %s "$so") bytes"
    done
    if [ "$n" = 0 ]; then
        echo "no module built under ~/.cache/flashinfer/*/90a/cached_ops (prebuilt ones from" \
            ".gpu-bundle/aot are not copied)"
    else
        echo "put each aot-NAME.so at .gpu-bundle/aot/NAME/NAME.so"
    fi
    echo "jit exit code: $rc (log: jit.log)"
    return "$rc"
}

run_tests() {
    # the tests compile many kernel specialisations (CPU-bound): JOBS pytest processes,
    # each a share of the test ids, so the compiles run side by side
    local log="$OUT/pytest-gpu.log" jobs=${JOBS:-6} rc=0 i
    local dir=/tmp/pytest-gpu
    rm -rf "$dir" && mkdir -p "$dir"
    python -c "import datetime, torch, triton; print(torch.cuda.get_device_name(), \
'torch', torch.__version__, 'triton', triton.__version__, datetime.date.today())" >"$log" 2>&1
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
    local budget=${1:-420} prev=${2:--} log="$OUT/bench-sampler.log" rc json
    shift $(($# < 2 ? $# : 2))
    local extra=()
    if [ "$prev" != "-" ]; then
        cp "$prev" "$OUT/" || return 1
        extra=(--resume)
    fi
    python benchmarks/bench_sampler.py --out "$OUT" --time-budget "$budget" --append \
        ${extra[@]+"${extra[@]}"} "$@" >"$log" 2>&1
    rc=$?
    grep -E "^(--append|--resume|time budget|wrote)" "$log"
    echo "$(grep -c ' ERROR ' "$log") rows with errors; first ones:"
    grep ' ERROR ' "$log" | head -n 5 | cut -c1-240
    echo "bench exit code: $rc (log: bench-sampler.log)"
    json=$(sed -n 's/^wrote \(.*\.json\) (.*/\1/p' "$log" | tail -n 1)
    [ -n "$json" ] || json=$(ls -t "$OUT"/sampler-*.json 2>/dev/null | head -n 1)
    if [ -n "$json" ]; then
        echo
        python benchmarks/plot_sampler.py "$json" --targets --no-png || rc=1
    fi
    return "$rc"
}

warm() {
    # WARM_SETS: warm_sampler.py argument sets separated by "|", run side by side (one
    # per launch-knob setting); default: its own grid
    local sets i=0
    rm -f /tmp/warm.*.log
    IFS='|' read -ra sets <<<"${WARM_SETS:- }"
    for ((i = 0; i < ${#sets[@]}; i++)); do
        python benchmarks/warm_sampler.py ${sets[$i]} >"/tmp/warm.$i.log" 2>&1 &
    done
    wait
    cat /tmp/warm.*.log >"$OUT/warm.log"
    grep -c " ok$" "$OUT/warm.log" | sed 's/$/ kernels warmed/'
    grep -E "ERROR|^warmed" "$OUT/warm.log" | cut -c1-240
}

prof() {
    python benchmarks/probes/kernel_times.py "$@" >"$OUT/prof.log" 2>&1
    local rc=$?
    grep -vi warn "$OUT/prof.log" | grep -E "@|Error" | cut -c1-300
    echo "prof exit code: $rc (log: prof.log)"
    return "$rc"
}

tune() {
    python benchmarks/tune_sampler.py --out "$OUT/tune.json" "$@" >"$OUT/tune.log" 2>&1
    local rc=$?
    tail -n 3 "$OUT/tune.log" | cut -c1-300
    [ -f "$OUT/tune.json" ] && python benchmarks/tune_sampler.py --markdown "$OUT/tune.json"
    echo "tune exit code: $rc (log: tune.log)"
    return "$rc"
}

[ "$phase" = all ] && phase=test,bench
rc=0
IFS=, read -ra phases <<<"$phase"
for p in "${phases[@]}"; do
    case "$p" in
    jit) jit || rc=1 ;;
    test) run_tests || rc=1 ;;
    bench) bench "$@" || rc=1 ;;
    tune) tune "$@" || rc=1 ;;
    prof) prof "$@" || rc=1 ;;
    warm) warm ;;
    *)
        echo "$usage"
        exit 2
        ;;
    esac
done
exit "$rc"
