#!/usr/bin/env bash
# Qwen2.5-0.5B offline 1024/128 step by step (tools/gpu/offline_steps.py) on this tree, on an older
# one, and on this tree with the GEMV path off, in one device call (~2 minutes): which steps a
# change of the offline number lives in. From the repo root:
#
#   git archive -o .gpu-old.tar.gz REV worker kernels bench protocol
#   run(carry=[".whl", ".gpu-old.tar.gz"], command="OLD_TREE=.gpu-old.tar.gz bash tools/gpu/offline_steps.sh")
#
# The card's SM clock, power and throttle reasons are sampled every 200 ms meanwhile and summed up
# per run (a GPU that clocks down mid-call moves every step alike, whichever tree runs).
# Files in $OUT: new.md, old.md, new-gemv-off.md, clocks.csv, phases.txt, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin offline_steps engine || exit 1
main() {
  tree_farm "$OLD_TREE" /tmp/offline-steps-old || return 1
  cd /tmp
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 200 > "$OUT/clocks.csv" 2>&1 &
  local smi=$!
  phase() { echo "$1 $(date +%s.%N)" >> "$OUT/phases.txt"; }
  phase "gemv-off"
  step "new, GEMV off" 100 $PY "$REPO/tools/gpu/offline_steps.py" --fused-gemv off --label "this tree, GEMV off" \
    > "$OUT/new-gemv-off.md"
  phase "new"
  step "new" 100 $PY "$REPO/tools/gpu/offline_steps.py" --label "this tree" > "$OUT/new.md"
  PYTHONPATH=/tmp/offline-steps-old:$PDSERVE_DEPS step "old" 100 $PY "$REPO/tools/gpu/offline_steps.py" \
    --label "$OLD_TREE" > "$OUT/old.md"
  phase "end"
  kill $smi
  # Per phase: the SM clock's median and minimum, the power's median, the throttle reasons seen.
  $PY - "$OUT/clocks.csv" "$OUT/phases.txt" <<'PYEOF'
import datetime, statistics, sys
rows = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(f[1].split()[0]), float(f[3].split()[0]), f[5]))
    except (ValueError, IndexError):
        continue
marks = [(l.split()[0], float(l.split()[1])) for l in open(sys.argv[2])]
for (name, t0), (_, t1) in zip(marks, marks[1:]):
    r = [x for x in rows if t0 <= x[0] < t1]
    if r:
        print(f"{name}: SM clock median {statistics.median(x[1] for x in r):.0f} MHz, min {min(x[1] for x in r):.0f}; "
              f"power median {statistics.median(x[2] for x in r):.0f} W; throttle reasons {sorted(set(x[3] for x in r))}")
PYEOF
}
main > "$OUT/log.txt" 2>&1
grep -E "^===|Error" "$OUT/log.txt" | tail -n 10
grep -E "clock" "$OUT/log.txt"
cat "$OUT/new-gemv-off.md" "$OUT/new.md" "$OUT/old.md" | grep -E "^##|^run|^\| (256|257)|^under|^\| [^0-9]"
