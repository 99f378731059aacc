# Probe runs of benchmarks/probes/prof_row.py, one process per gather variant (see there).
set -u
bash .gpu-bundle/install.sh >/dev/null || { echo install failed; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
CFGS="${CFGS:-0:0 1:0 2:0 1:1 2:1}"
for c in $CFGS; do
  (GX_GV=${c%:*} GX_TL=${c#*:} TRITON_CACHE_DIR=/tmp/tc-$c python benchmarks/probes/prof_row.py warm top_p tktp > $OUT/warm-$c.log 2>&1) &
done
wait
grep -h "ERROR" $OUT/warm-*.log | head
for c in $CFGS; do
  GX_GV=${c%:*} GX_TL=${c#*:} TRITON_CACHE_DIR=/tmp/tc-$c python benchmarks/probes/prof_row.py measure top_p tktp min_p 2>&1 | grep -v Warn | tee -a $OUT/prof2.log
done
