#!/usr/bin/env bash
# Qwen3-30B-A3B's bf16 MoE down pass split over expert slots (DOWN_SPLIT_K) vs one program a strip:
# the layer's variants in CUDA graphs, then the engine's bs=1 step (48 layers, --load-format dummy)
# with the default and with the fastest variant at one token, in one device call on one H200
# (<= 5 minutes). From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/moe_down_split.sh")
#
# Files in $OUT: variants.md, best.json, engine.md, engine_rows.jsonl, profile_{default,best}.md, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin gpu_moe_down_split engine || exit 1
LAYERS=${LAYERS:-48}
main() {
  cd /tmp
  local h="$REPO/tools/gpu/moe_down_split.py" ckpt=/tmp/qwen3-30b-a3b-l$LAYERS rows="$OUT/engine_rows.jsonl"
  step "variants" 150 $PY "$h" time --out "$OUT/variants.md" --best "$OUT/best.json"
  step "checkpoint" 20 $PY -m pdserve.bench.moe checkpoint --checkpoint $ckpt --layers $LAYERS --config-only
  rm -f "$rows"
  step "engine, default" 90 $PY "$h" engine --checkpoint $ckpt --layers $LAYERS --load-format dummy \
    --num-prompts 0 --rows "$rows" --profile "$OUT/profile_default.md"
  step "engine, $(cat "$OUT/best.json")" 90 $PY "$h" engine --knobs "$(cat "$OUT/best.json")" --checkpoint $ckpt \
    --layers $LAYERS --load-format dummy --num-prompts 0 --rows "$rows" --profile "$OUT/profile_best.md"
  $PY -m pdserve.bench.moe report --rows "$rows" --out "$OUT/engine.md" > /dev/null
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep -v " INFO " "$OUT/log.txt" | grep -E "^===|Error|total|ms/step" | tail -n 12
cat "$OUT/variants.md" "$OUT/engine.md" 2>/dev/null
grep -E "_moe_decode|kernels/step" "$OUT"/profile_*.md 2>/dev/null
