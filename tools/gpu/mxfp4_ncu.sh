#!/usr/bin/env bash
# gpt-oss-120b's MXFP4 decode GEMVs at one token: launch-shape variants timed in CUDA graphs, then
# Nsight Compute's view of the default kernels (occupancy, warp stalls, memory) where the image has
# `ncu`, in one device call on one H200 (<= 4 minutes). From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/mxfp4_ncu.sh", timeout_s=400)
#
# Files in $OUT: variants.md, ncu.txt (absent without ncu), log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin gpu_mxfp4_ncu none triton || exit 1
main() {
  cd /tmp
  local h="$REPO/tools/gpu/mxfp4_ncu.py" ncu
  step "variants" 120 $PY "$h" time --out "$OUT/variants.md"
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  if [ -z "$ncu" ]; then
    echo "no ncu in this image"
  else
    step "ncu" 150 "$ncu" -k regex:_moe_decode --launch-skip 6 --launch-count 3 --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section SchedulerStats $PY "$h" loop > "$OUT/ncu.txt" 2>&1
  fi
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep "^===\|Error\|ncu\|^total" "$OUT/log.txt" | tail -n 8
cat "$OUT/variants.md" 2>/dev/null
grep -v "^==PROF==" "$OUT/ncu.txt" 2>/dev/null | grep -E "_moe|Duration|Throughput|Occupancy|Registers|Waves|Block Limit|Stall|Warp Cycles|Issued|Eligible|Active Warps|One or More|No Eligible|L2 Hit|Mem Busy|Max Bandwidth|Dynamic Shared|Threads" | head -n 120
