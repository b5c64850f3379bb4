#!/usr/bin/env bash
# gpt-oss-120b's MXFP4 decode GEMVs at one token with their weights brought by TMA descriptor loads
# into a pipelined shared-memory ring (tools/gpu/mxfp4_tma.py): each gate|up and split-down variant
# against the default kernel in CUDA graphs, same run, on one H200 (<= 4 minutes). The down variants
# and then the warp-specialized ones run in a second process, so that a compiler abort in the latter
# loses only them. From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/mxfp4_tma.sh", timeout_s=300)
#
# Files in $OUT: tma.md (both tables), tma_ws.md, log.txt, env.txt.
set -u
source tools/gpu/lib.sh
gpu_begin gpu_mxfp4_tma none triton || exit 1
main() {
  cd /tmp
  local h="$REPO/tools/gpu/mxfp4_tma.py"
  step "gate|up" 135 $PY "$h" time --only 0 1 2 3 4 5 6 7 8 9 --budget 100 --out "$OUT/tma.md"
  step "down, warp-specialized gate|up" 85 $PY "$h" time --only 12 13 14 10 11 --budget 55 --out "$OUT/tma_ws.md"
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
[ -f "$OUT/tma_ws.md" ] && { echo; echo "Second process:"; echo; cat "$OUT/tma_ws.md"; } >> "$OUT/tma.md"
grep "^===\|Error\|Abort\|^total" "$OUT/log.txt" | tail -n 8
cat "$OUT/tma.md" 2>/dev/null
