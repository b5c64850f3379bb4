#!/usr/bin/env bash
# gpt-oss's layers outside the experts (issue 46's bs=1 row): the attention projections and the
# router on cuBLAS vs the fused Triton GEMV, in one device call on one H200 (<= 6 minutes). From the
# repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/gpt_oss_dense.sh", timeout_s=600)
#
# 1. bench/gemv.py at gpt-oss's shapes (qkv with its norm, o_proj, the router; biases) at
#    $GEMV_ROWS tokens: cuBLAS vs the fused GEMV, each in CUDA graphs, weights rotated past L2  150 s
# 2. gpt-oss-120b bs=1 (--load-format dummy, MXFP4 experts), each with its kernel profile
#    (tools/gpu/gpt_oss.py engine): the router as F.linear + moe_route (before kernels/moe_gate.py),
#    as it runs now (gate: the GEMV where measured), with the GEMV path on for every shape
#    (gemv) or off (nogemv)                                                                 n x 100 s
# GEMV_ROWS= (empty) skips step 1; STEPS="linear gate" picks engine rows (default: linear gate gemv).
# Files in $OUT: gemv.md, rows.jsonl, profile_{linear,gate,gemv}.md, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin gpu_gpt_oss_dense engine triton transformers || exit 1
GEMV_ROWS=${GEMV_ROWS-1 2 4 8}
STEPS=${STEPS:-linear gate gemv}
main() {
  cd /tmp  # not the repo root: its operator/ folder would shadow the standard library's
  local h="$REPO/tools/gpu/gpt_oss.py" cfg=/tmp/gpt-oss-120b-cfg
  [ -n "$GEMV_ROWS" ] && step "gemv shapes" 150 $PY -m pdserve.bench.gemv --models gpt-oss --rows $GEMV_ROWS \
    --out "$OUT/gemv.md"
  step "config" 30 $PY "$h" config --size 120b --out $cfg
  local name flags
  for name in $STEPS; do
    case $name in
      linear) flags=(--router-linear) ;;
      gate) flags=() ;;
      gemv) flags=(--fused-gemv on) ;;
      nogemv) flags=(--fused-gemv off) ;;
    esac
    step "120b, $name" 100 $PY "$h" engine --checkpoint $cfg --name "gpt-oss-120b $name" "${flags[@]}" \
      --rows "$OUT/rows.jsonl" --num-prompts 0 --profile "$OUT/profile_$name.md"
  done
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep "^===\|Error\|^total" "$OUT/log.txt" | tail -n 12
cat "$OUT/gemv.md" 2>/dev/null
cat "$OUT/rows.jsonl" 2>/dev/null | cut -c1-400
head -n 20 "$OUT"/profile_*.md 2>/dev/null
