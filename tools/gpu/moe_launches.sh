#!/usr/bin/env bash
# Two launches a layer fewer in an MoE model's bs=1 step, A/B on one card in one device call
# (<= 9 minutes): Qwen3-30B-A3B's config, all 48 layers, random bf16 weights made on the GPU,
# bench/moe.py engine at bs=1 (CUDA graphs), these rows in turn, then each again (the repeats say
# how much two runs of one tree differ):
#   default                       (main: the split down pass's finish launch, a separate norm)
#   DOWN_REDUCE_HERE              (the down partials summed by the last program to arrive)
#   --gate-norm                   (the add + RMSNorm before the router inside moe_gate's launch)
#   both
# then the kernel tests of the two kernels compiled on the GPU. From the repo root:
#
#   run(carry=[".whl"], command="bash tools/gpu/moe_launches.sh")
#
# ROUNDS (2) and LAYERS (48; 24 fits an 80 GB card) size it; GEMV_SWEEP=1 adds bench/gemv.py for
# Qwen3's attention shapes at M = 1.
# Files in $OUT: engine.md, engine_rows.jsonl, tests.txt, log.txt; profile_{default,both}.md; gemv_qwen3.md.
set -u
source tools/gpu/lib.sh
gpu_begin gpu_moe_launches engine || exit 1
LAYERS=${LAYERS:-48}
main() {
  local repo=$PWD ckpt=/tmp/qwen3-30b-a3b-l$LAYERS rows="$OUT/engine_rows.jsonl"
  local common=(--checkpoint $ckpt --layers $LAYERS --load-format dummy --num-prompts 0 --rows "$rows")
  local here='{"DOWN_REDUCE_HERE": true}'
  cd /tmp
  step "checkpoint" 20 $PY -m pdserve.bench.moe checkpoint --checkpoint $ckpt --layers $LAYERS --config-only
  rm -f "$rows"
  for round in $(seq 1 ${ROUNDS:-2}); do
    local prof=() prof_both=()
    [ $round = 1 ] && prof=(--profile "$OUT/profile_default.md") && prof_both=(--profile "$OUT/profile_both.md")
    step "default, round $round" 90 $PY -m pdserve.bench.moe engine "${common[@]}" "${prof[@]}"
    step "down sum in the launch, round $round" 80 $PY -m pdserve.bench.moe engine "${common[@]}" --down-knobs "$here"
    step "norm in the router's launch, round $round" 80 $PY -m pdserve.bench.moe engine "${common[@]}" --gate-norm
    step "both, round $round" 90 $PY -m pdserve.bench.moe engine "${common[@]}" --gate-norm --down-knobs "$here" \
      "${prof_both[@]}"
  done
  $PY -m pdserve.bench.moe report --rows "$rows" --out "$OUT/engine.md" > /dev/null
  # GEMV_SWEEP=1: also the fused GEMV against cuBLAS for Qwen3's attention shapes at M = 1 (the
  # MEASURED entry for this card, where kernels/fused_gemv.py has none).
  [ "${GEMV_SWEEP:-0}" = 1 ] && step "gemv sweep" 150 $PY -m pdserve.bench.gemv --models qwen3-30b-a3b --rows 1 \
    --out "$OUT/gemv_qwen3.md"
  cd "$repo"
  step "kernel tests" 60 $PY -m pytest tests/kernels/test_moe_gate.py tests/kernels/test_fused_moe.py -q -x \
    -k "norm or reduce_here or split" -p no:cacheprovider > "$OUT/tests.txt" 2>&1
  tail -n 2 "$OUT/tests.txt"
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep -v " INFO " "$OUT/log.txt" | grep -E "^===|Error|total|passed|failed" | tail -n 16
cat "$OUT/engine.md" "$OUT/gemv_qwen3.md" 2>/dev/null
grep -E "_moe_|rms_norm|kernels/step" "$OUT"/profile_*.md 2>/dev/null | head -30
