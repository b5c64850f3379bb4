#!/usr/bin/env bash
# gpt-oss's MXFP4 experts on tl.dot_scaled (the MX_DOT / MX_DOT_SCALED knobs of kernels/fused_moe.py)
# against the integer-decoding GEMVs and bf16, one device call on one H200, <= 560 s. From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/mxfp4_dot.sh", timeout_s=600)
#
# 1. the whole GPU suite (.ci/gpu_tests.sh; SUITE=0 skips it)                               ~280 s
# 2. tools/gpu/mxfp4_kernel.py, gpt-oss-120b's layer: bf16 / old / new rows at 1, 64 and 512 tokens
#    with the sorted tiles swept (the tl.dot_scaled ones among them), then --decode-sweep at 1 4 16 64
#    tokens (the decode configs, MX_DOT ones included, and the sorted dot_scaled path in CUDA graphs)
# Files in $OUT: gpu-tests.txt, mxfp4.md, sweep.md, decode_sweep.md, log.txt.
set -u
source tools/gpu/lib.sh
BUDGET=${BUDGET:-560}
gpu_begin gpu_mxfp4_dot none triton || exit 1

main() {
  if [ "${SUITE:-1}" = 1 ]; then
    step "GPU suite" 330 env GPU_TESTS_LIMIT_S=310 OUT="$OUT" bash .ci/gpu_tests.sh > "$OUT/suite_stdout.txt" 2>&1
  fi
  cd /tmp
  step "mxfp4 rows + sweeps" $(( BUDGET - ($(date +%s) - T0) - 5 )) $PY "$REPO/tools/gpu/mxfp4_kernel.py" \
    --old "$REPO/tools/gpu/baselines/fused_moe_8c8c064.py" --out "$OUT" --models gpt-oss-120b --tokens 1 64 512 \
    --sweep --decode-sweep --sweep-tokens 1 4 16 64
  cd "$REPO"
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
echo "--- GPU suite"; grep -E "passed|failed" "$OUT/gpu-tests.txt" 2>/dev/null | tail -n 3
grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.txt" 2>/dev/null | head -n 10
echo "--- steps"; grep "^===\|^total" "$OUT/log.txt" | grep -v "(limit"
echo "--- best per token count"; grep "^- " "$OUT/decode_sweep.md" 2>/dev/null
echo "--- dot rows"; grep -E "dot|bf16 \||default \|" "$OUT/decode_sweep.md" 2>/dev/null | cut -c1-140
echo "--- sorted sweep"; grep -v "^| model" "$OUT/sweep.md" 2>/dev/null | cut -c1-150
echo "--- op rows"; grep "^| gpt" "$OUT/mxfp4.md" 2>/dev/null | cut -c1-170
tail -n 5 "$OUT/log.txt"
