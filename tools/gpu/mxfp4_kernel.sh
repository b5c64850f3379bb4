#!/usr/bin/env bash
# The MXFP4 fused MoE op before/after (tools/gpu/mxfp4_kernel.py) in one device call on one H200
# (~5 minutes with SWEEP=1, ~3 without). From the repo root, with OLD naming a copy of the
# previous kernels/fused_moe.py (default: the tree's own file as it is when the script starts):
#
#   run(carry=[".whl"], command="bash tools/gpu/mxfp4_kernel.sh")
#
# 1. tests compiled on the GPU, real sizes: test_fused_moe_mxfp4.py (gpt-oss-20b's layer, the word
#    decoder on every byte and exponent, subnormals kept) and test_fused_moe.py             150 s
# 2. bf16 / old MXFP4 / new MXFP4 at 1..512 tokens, gpt-oss-120b and -20b (+ the tile sweep) 300 s
# Files in $OUT: env.txt, tests.txt, mxfp4.md, sweep.md, log.txt.
set -u
source tools/gpu/lib.sh
OLD=${OLD:-/tmp/fused_moe_old.py}
[ -f "$OLD" ] || cp kernels/fused_moe.py "$OLD"
gpu_begin gpu_mxfp4 none || exit 1

main() {
  step "tests on the GPU" 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe_mxfp4.py \
    tests/kernels/test_fused_moe.py > "$OUT/tests.txt" 2>&1
  tail -n 15 "$OUT/tests.txt"
  cd /tmp
  step "mxfp4 kernel" 300 $PY "$REPO/tools/gpu/mxfp4_kernel.py" --old "$OLD" --out "$OUT" ${SWEEP:+--sweep}
  cat "$OUT/mxfp4.md"
  [ -f "$OUT/sweep.md" ] && cat "$OUT/sweep.md"
}
main > "$OUT/log.txt" 2>&1
cat "$OUT/log.txt" | tail -n 120
