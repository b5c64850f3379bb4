#!/usr/bin/env bash
# gpt-oss's layers outside the experts (issue 46's bs=1 row): the attention projections and the
# router on cuBLAS vs the fused Triton GEMV, in one device call on one H200 (<= 6 minutes). From the
# repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/gpt_oss_dense.sh", timeout_s=600)
#
# 1. bench/gemv.py at gpt-oss's shapes (qkv with its norm, o_proj, the router; biases) at
#    $GEMV_ROWS tokens: cuBLAS vs the fused GEMV, each in CUDA graphs, weights rotated past L2  150 s
# 2. gpt-oss-120b bs=1 (--load-format dummy, MXFP4 experts) with the GEMV path off, then on, each
#    with its kernel profile (tools/gpu/gpt_oss.py engine)                                  2 x 100 s
# Files in $OUT: gemv.md, rows.jsonl, profile_off.md, profile_on.md, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin gpu_gpt_oss_dense engine triton transformers || exit 1
GEMV_ROWS=${GEMV_ROWS:-1 2 4 8}
main() {
  cd /tmp  # not the repo root: its operator/ folder would shadow the standard library's
  local h="$REPO/tools/gpu/gpt_oss.py" cfg=/tmp/gpt-oss-120b-cfg
  step "gemv shapes" 150 $PY -m pdserve.bench.gemv --models gpt-oss --rows $GEMV_ROWS --out "$OUT/gemv.md"
  step "config" 30 $PY "$h" config --size 120b --out $cfg
  step "120b, GEMV path off" 100 $PY "$h" engine --checkpoint $cfg --name gpt-oss-120b --rows "$OUT/rows.jsonl" \
    --num-prompts 0 --profile "$OUT/profile_off.md"
  step "120b, GEMV path on" 100 $PY "$h" engine --checkpoint $cfg --name "gpt-oss-120b fused-gemv" --fused-gemv \
    --rows "$OUT/rows.jsonl" --num-prompts 0 --profile "$OUT/profile_on.md"
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep "^===\|Error\|^total" "$OUT/log.txt" | tail -n 12
cat "$OUT/gemv.md" 2>/dev/null
cat "$OUT/rows.jsonl" 2>/dev/null | cut -c1-400
head -n 24 "$OUT/profile_off.md" "$OUT/profile_on.md" 2>/dev/null
