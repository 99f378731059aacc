#!/usr/bin/env bash
# The executor's GPU session in one command (each part logged to $OUT, none stops the rest):
# demo, pytest -m gpu (executor tests), determinism check, step benchmark, graph inspection.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
part() {  # part NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    local t0=$(date +%s)
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
}
part demo 240 python -m graphexec demo --quiet
part pytest_executor 400 python -m pytest -m gpu -q tests/gpu/test_executor_gpu.py
part determinism 400 python tools/determinism_check.py --key-steps 6
part bench_step 300 python benchmarks/bench_step.py --out "$OUT"
part inspect 200 python tools/inspect_graphs.py --max-batch-size 32 --steps 40 --dot top_k_top_p/b8/lp --dot-path "$OUT/top_k_top_p-b8-lp.dot"
cat "$OUT/summary.txt"
