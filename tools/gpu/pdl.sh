#!/usr/bin/env bash
# Programmatic dependent launch (kernels/pdl.py) on and off, same call, one H200. Two parts, each one
# device call (<= 10 minutes). From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="PART=suite bash tools/gpu/pdl.sh")
#   run(kind="nvidia-h200", carry=[".whl"], command="PART=engines bash tools/gpu/pdl.sh")
#
# PART=suite:   .ci/gpu_tests.sh (PDL on: the default) with $SUITE_LIMIT_S (default 400)   ~360 s
#               bench/gemv.py --step (Llama-3.1-8B, Qwen2.5-0.5B bs=1 step in one CUDA graph,
#               the GEMV path off / on), PDSERVE_PDL=0 then 1, twice, alternating         4 x ~35 s
# PART=engines: gpt-oss-120b bs=1 (--load-format dummy, MXFP4 experts), PDL off / on, the on
#               row profiled per kernel                                                  2 x ~100 s
#               Qwen3-30B-A3B bs=1 (dummy, 48 layers), PDL off / on                        2 x ~60 s
#               bench/engine.py Qwen2.5-0.5B bs=1 at 128 and offline 1024/128, PDL off / on      2 x ~40 s
# Files in $OUT: suite/gpu-tests.txt, suite.log, step-pdl{0,1}-{a,b}.md, engine-pdl{0,1}.md,
# rows.jsonl (gpt-oss), moe_rows.jsonl (Qwen3), profile_gpt_oss_pdl1.md, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin pdl engine || exit 1
PART=${PART:-suite}
suite() {
  GPU_TESTS_LIMIT_S=${SUITE_LIMIT_S:-400} OUT=$OUT/suite bash .ci/gpu_tests.sh > "$OUT/suite.log" 2>&1
  grep -E "passed|failed|error" "$OUT/suite.log" | tail -n 4
  cd /tmp
  local round p
  for round in a b; do
    for p in 0 1; do
      export PDSERVE_PDL=$p; step "step, PDL $p ($round)" 80 $PY -m pdserve.bench.gemv --step \
        --models llama-3.1-8b qwen2.5-0.5b --out "$OUT/step-pdl$p-$round.md"
    done
  done
}
engines() {
  cd /tmp
  local p h="$REPO/tools/gpu/gpt_oss.py" cfg=/tmp/gpt-oss-120b-cfg
  step "gpt-oss config" 30 $PY "$h" config --size 120b --out $cfg
  export PDSERVE_PDL=0; step "120b, PDL 0" 110 $PY "$h" engine --checkpoint $cfg --name "gpt-oss-120b pdl0" \
    --rows "$OUT/rows.jsonl" --num-prompts 0
  export PDSERVE_PDL=1; step "120b, PDL 1" 130 $PY "$h" engine --checkpoint $cfg --name "gpt-oss-120b pdl1" \
    --rows "$OUT/rows.jsonl" --num-prompts 0 --profile "$OUT/profile_gpt_oss_pdl1.md"
  local ckpt=/tmp/qwen3-30b-a3b-l48
  step "qwen3 checkpoint" 30 $PY -m pdserve.bench.moe checkpoint --checkpoint $ckpt --layers 48 --config-only
  for p in 0 1; do
    export PDSERVE_PDL=$p; step "Qwen3-30B-A3B, PDL $p" 90 $PY -m pdserve.bench.moe engine --checkpoint $ckpt --layers 48 \
      --load-format dummy --num-prompts 0 --rows "$OUT/moe_rows.jsonl" 2>&1 | grep -v " INFO "
  done
  for p in 0 1; do
    export PDSERVE_PDL=$p; step "0.5B engine, PDL $p" 90 $PY -m pdserve.bench.engine --models qwen2.5-0.5b \
      --decode-inputs 128 --offline 1024 --no-hf --no-eager --out "$OUT/engine-pdl$p.md" 2>&1 | grep -v " INFO "
  done
}
main() {
  case $PART in
    suite) suite ;;
    engines) engines ;;
    *) echo "PART must be suite or engines, got $PART"; return 2 ;;
  esac
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep -E "^===|passed|failed|error|Error|total" "$OUT/log.txt" | tail -n 30
for f in "$OUT"/step-*.md; do [ -f "$f" ] && { echo "## $f"; grep "^|" "$f"; }; done
for f in "$OUT"/engine-*.md; do [ -f "$f" ] && { echo "## $f"; grep "^| Qwen" "$f"; }; done
cut -c1-300 "$OUT"/rows.jsonl "$OUT"/moe_rows.jsonl 2>/dev/null
true
