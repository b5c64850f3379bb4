#!/usr/bin/env bash
# The whole GPU test suite, uncapped, then Qwen3-30B-A3B's bs=1 step with kernels/moe_gate.py's
# router (the default) and without it (--router-linear, the same-run baseline), in one device
# call on one H200 (<= 10 minutes). From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/suite_and_moe_gate.sh")
#
# 1. .ci/gpu_tests.sh with $SUITE_LIMIT_S (default 400)                                   ~330 s
# 2. Qwen3-30B-A3B ($LAYERS layers, default 48; --load-format dummy): bs=1 decode, TP=1, gate on
#    (with its kernel profile) and off; no offline rows                                  2 x 90 s
# Files in $OUT: suite/gpu-tests.txt, suite.log, engine.md, engine_rows.jsonl, profile.md, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin gpu_suite_moe_gate engine || exit 1
LAYERS=${LAYERS:-48}
main() {
  GPU_TESTS_LIMIT_S=${SUITE_LIMIT_S:-400} OUT=$OUT/suite bash .ci/gpu_tests.sh > "$OUT/suite.log" 2>&1
  grep -E "passed|failed|error" "$OUT/suite.log" | tail -n 4
  cd /tmp
  local ckpt=/tmp/qwen3-30b-a3b-l$LAYERS rows="$OUT/engine_rows.jsonl"
  step "checkpoint" 20 $PY -m pdserve.bench.moe checkpoint --checkpoint $ckpt --layers $LAYERS --config-only
  rm -f "$rows"
  step "engine, gate" 90 $PY -m pdserve.bench.moe engine --checkpoint $ckpt --layers $LAYERS \
    --load-format dummy --num-prompts 0 --rows "$rows" --profile "$OUT/profile.md"
  step "engine, router linear" 90 $PY -m pdserve.bench.moe engine --checkpoint $ckpt --layers $LAYERS \
    --load-format dummy --num-prompts 0 --rows "$rows" --router-linear
  $PY -m pdserve.bench.moe report --rows "$rows" --out "$OUT/engine.md" > /dev/null
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep -v " INFO " "$OUT/log.txt" | grep -E "^===|passed|failed|error|Error|total|ms/step" | tail -n 20
cat "$OUT/engine.md" 2>/dev/null
head -n 30 "$OUT/profile.md" 2>/dev/null
