#!/usr/bin/env bash
# The MXFP4 decode GEMVs with and without the bulk L2 prefetch (kernels/l2_prefetch.py), in one
# device call on one H200 (<= 9 minutes with the suite). From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/l2_prefetch.sh", timeout_s=600)
#
# 0. SUITE=1: the whole GPU test suite first (.ci/gpu_tests.sh, 330 s), as a session touching
#    kernels does in its first call
# 1. tools/gpu/mxfp4_ncu.py time: gpt-oss-120b's layer at one token, the variants in CUDA graphs  60 s
# 1b. NCU=1: the gate|up GEMV under Nsight Compute without and with $KNOBS                 2 x 60 s
# 2. ENGINE=1: gpt-oss-120b bs=1 (--load-format dummy) without and with the prefetch knobs
#    (PDSERVE_MXFP4_DECODE_KNOBS), each with its kernel profile                                2 x 100 s
# Files in $OUT: suite/, variants.md, rows.jsonl, profile_{off,on}.md, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin gpu_l2_prefetch engine triton transformers || exit 1
SUITE=${SUITE:-0}
ENGINE=${ENGINE:-0}
NCU=${NCU:-0}
[ -n "${KNOBS:-}" ] || KNOBS='{"GU_L2_PREFETCH": true, "DOWN_L2_PREFETCH": true}'
main() {
  if [ "$SUITE" = 1 ]; then
    GPU_TESTS_LIMIT_S=${SUITE_LIMIT_S:-330} OUT=$OUT/suite bash .ci/gpu_tests.sh > "$OUT/suite.log" 2>&1
    grep -E "passed|failed|error" "$OUT/suite.log" | tail -n 4
  fi
  cd /tmp  # not the repo root: its operator/ folder would shadow the standard library's
  step "variants" 150 $PY "$REPO/tools/gpu/mxfp4_ncu.py" time --out "$OUT/variants.md"
  if [ "$NCU" = 1 ]; then  # the gate|up GEMV under Nsight Compute, without and with the prefetch
    local ncu knobs name
    ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
    for name in off on; do
      knobs='{}'
      [ $name = on ] && knobs=$KNOBS
      step "ncu $name" 120 "$ncu" -k regex:_moe_decode_gate_up --launch-skip 6 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section SchedulerStats $PY "$REPO/tools/gpu/mxfp4_ncu.py" loop --knobs "$knobs" > "$OUT/ncu_$name.txt" 2>&1
    done
  fi
  if [ "$ENGINE" = 1 ]; then
    local h="$REPO/tools/gpu/gpt_oss.py" cfg=/tmp/gpt-oss-120b-cfg
    step "config" 30 $PY "$h" config --size 120b --out $cfg
    step "120b, prefetch off" 100 $PY "$h" engine --checkpoint $cfg --name "gpt-oss-120b off" \
      --rows "$OUT/rows.jsonl" --num-prompts 0 --profile "$OUT/profile_off.md"
    step "120b, prefetch on" 100 env PDSERVE_MXFP4_DECODE_KNOBS="$KNOBS" $PY "$h" engine --checkpoint $cfg \
      --name "gpt-oss-120b on $KNOBS" --rows "$OUT/rows.jsonl" --num-prompts 0 --profile "$OUT/profile_on.md"
  fi
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep "^===\|Error\|^total\|passed\|failed" "$OUT/log.txt" | tail -n 12
cat "$OUT/variants.md" 2>/dev/null
cat "$OUT/rows.jsonl" 2>/dev/null | cut -c1-400
head -n 16 "$OUT"/profile_*.md 2>/dev/null
for f in "$OUT"/ncu_*.txt; do
  [ -f "$f" ] && { echo "== $f"; grep -v "^==PROF==" "$f" | grep -E "Duration|Throughput|Occupancy|Stall|Warp Cycles|Issued|Eligible|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth" | head -n 30; }
done
