#!/usr/bin/env bash
# Prefill attention on torch's FlashAttention (PDSERVE_FLASH_PREFILL=1, worker/attention/flash_prefill.py)
# against the Triton paged kernel, in one device call on one GPU (~5 minutes). From the repo root:
#
#   run(carry=[".whl"], command="bash tools/gpu/flash_prefill.sh")
#
# 1. tests/worker/test_flash_prefill.py on the GPU (its real-FlashAttention test among them)       60 s
# 2. tools/gpu/flash_prefill.py: one layer's prefill attention, Llama-3.1-8B heads, fresh prompts
#    and chunks after cached prefixes, Triton vs flash (the gather included)                     60 s
# 3. bench/engine.py Qwen2.5-0.5B and Llama-3.1-8B, bs=1 at 128 and offline 1024/128 (256 prompts):
#    PDSERVE_FLASH_PREFILL=0, 1, 0, 1 (alternating: the host's mode moves between runs)       4 x 70 s
# Files in $OUT: env.txt, tests.txt, flash_prefill.md, engine-flash{0,1}-{a,b}.md, log.txt.
# STEPS="tests layer engines" (the default) picks steps: after .ci/gpu_tests.sh, which runs the tests,
# STEPS="layer" fits the same call; ROUNDS="a" runs the engines' A/B once.
set -u
STEPS=" ${STEPS:-tests layer engines} "
source tools/gpu/lib.sh
gpu_begin flash_prefill engine || exit 1
main() {
  [[ $STEPS == *" tests "* ]] && step_into "$OUT/tests.txt" "flash prefill tests" 120 \
    $PY -m pytest tests/worker/test_flash_prefill.py -q -p no:cacheprovider -n 0
  [[ $STEPS == *" tests "* ]] && tail -n 3 "$OUT/tests.txt"
  local round f
  cd /tmp
  [[ $STEPS == *" layer "* ]] && step "prefill attention, one layer" 120 $PY "$REPO/tools/gpu/flash_prefill.py" --out "$OUT/flash_prefill.md"
  [[ $STEPS == *" engines "* ]] || return 0
  for round in ${ROUNDS:-a b}; do
    for f in 0 1; do
      export PDSERVE_FLASH_PREFILL=$f; step "engines, flash $f ($round)" 110 $PY -m pdserve.bench.engine \
        --models qwen2.5-0.5b llama-3.1-8b --decode-inputs 128 --offline 1024 --no-hf --no-eager \
        --out "$OUT/engine-flash$f-$round.md" 2>&1 | grep -v " INFO " | grep "offline\|FAILED\|Error"
    done
  done
}
main 2>&1 | tee "$OUT/log.txt"
