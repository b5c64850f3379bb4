#!/usr/bin/env bash
# gpt-oss's MXFP4 decode path (issue 46: the op vs bf16 at 1-64 tokens, bs=1 vs the roofline) in one
# device call on one H200, <= 540 s. From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/mxfp4_decode.sh", timeout_s=600)
#
# 1. tests compiled on the GPU: test_fused_moe_mxfp4.py (the split / nibble-major decode variants,
#    gpt-oss-20b's real layer) and test_fused_moe.py                                        150 s
# 2. gpt-oss-120b bs=1 engine row (--load-format dummy) with its kernel profile: tools/gpu/gpt_oss.sh
#    step a only (ONLY=a, no offline prompts)                                                130 s
# 3. tools/gpu/mxfp4_kernel.py: bf16 / old / new MXFP4 at 1 4 16 64 tokens (old = main's kernels
#    before the pre-scaled activations and [rows, groups, 4] accumulators, tools/gpu/baselines/
#    fused_moe_600a0db.py, or $OLD), then $SWEEP_ARGS (default --decode-sweep at 1 4 16 64 tokens:
#    every decode config, the op and each pass in CUDA graphs, best per token count; SWEEP_ARGS=
#    empty skips the sweep, or e.g. SWEEP_ARGS="--decode-sweep --sweep-tokens 1" for less)  the rest
# Files in $OUT: tests.txt, engine/ (gpt_oss.md, profile_120b.md, log.txt), mxfp4.md,
# decode_sweep.md, log.txt; the summary at the end of the output.
set -u
source tools/gpu/lib.sh
OLD=${OLD:-$PWD/tools/gpu/baselines/fused_moe_600a0db.py}
SWEEP_ARGS=${SWEEP_ARGS-"--decode-sweep --sweep-tokens 1 4 16 64"}  # set and empty: no sweep
BUDGET=${BUDGET:-530}
gpu_begin gpu_mxfp4_decode none triton || exit 1

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

main() {
  step "tests on the GPU" 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe_mxfp4.py \
    tests/kernels/test_fused_moe.py > "$OUT/tests.txt" 2>&1
  tail -n 8 "$OUT/tests.txt"
  local engine_s=130  # deps + configs ~20 s, the 120b engine's start ~25 s, its steps and profile seconds
  [ "$(left)" -lt 350 ] && engine_s=100
  step "gpt-oss-120b bs=1 engine + profile" $((engine_s + 10)) env OUT="$OUT/engine" ONLY=a PROMPTS_120B=0 \
    CALL_S=$engine_s bash tools/gpu/gpt_oss.sh
  cd /tmp
  step "mxfp4 op rows${SWEEP_ARGS:+ + decode sweep}" $(( $(left) - 5 )) $PY "$REPO/tools/gpu/mxfp4_kernel.py" \
    --old "$OLD" --out "$OUT" --models gpt-oss-120b --tokens 1 4 16 64 $SWEEP_ARGS
  cd "$REPO"
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
# Most wanted last (a reader of the output's tail sees it first): the sweep's table, the op rows, the
# profile, the engine row, the tests, the steps, and the best config per token count.
echo "--- decode sweep (decode_sweep.md)"; grep "^|" "$OUT/decode_sweep.md" 2>/dev/null
echo "--- op: bf16 / old (main) / new MXFP4 (mxfp4.md)"; grep "^|" "$OUT/mxfp4.md" 2>/dev/null | cut -c1-200
echo "--- profile (engine/profile_120b.md)"; head -n 22 "$OUT/engine/profile_120b.md" 2>/dev/null
echo "--- engine"; grep -E "^\[gpt-oss|^===|Error" "$OUT/engine/log.txt" 2>/dev/null | tail -n 6
grep -A2 "^| model | format" "$OUT/engine/gpt_oss.md" 2>/dev/null | tail -n 1 | cut -c1-220
echo "--- tests"; grep -E "passed|failed|error" "$OUT/tests.txt" | tail -n 3
grep -E "^(FAILED|ERROR)" "$OUT/tests.txt" | head -n 10
echo "--- steps"; grep "^===\|Error\|^total" "$OUT/log.txt" | grep -v "(limit" | tail -n 8
echo "--- best per token count"; grep "^- " "$OUT/decode_sweep.md" 2>/dev/null
