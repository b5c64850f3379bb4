#!/usr/bin/env bash
# The small-batch GEMV on by default (kernels/fused_gemv.MEASURED's shapes) in one device call on
# one H200 (<= 10 minutes), with the whole GPU test suite. From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/gemv_default.sh")
#
# 1. bench/gemv.py --step: the bs=1 decode step of Llama-3.1-8B and Qwen2.5-0.5B (random weights,
#    context 128, one CUDA graph), the GEMV path off vs on                                  ~60 s
# 2. .ci/gpu_tests.sh with $SUITE_LIMIT_S (default 360)                                    ~330 s
# 3. bench/engine.py, Qwen2.5-0.5B: bs=1 at 128 and offline 1024/128, the GEMV off then the
#    engine's default                                                                    2 x ~25 s
# Files in $OUT: gemv_step.md, suite/gpu-tests.txt, suite.log, engine-{off,default}.md, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin gemv_default engine || exit 1
main() {
  (cd /tmp && step "gemv step" 90 $PY -m pdserve.bench.gemv --step --models llama-3.1-8b qwen2.5-0.5b \
    --out "$OUT/gemv_step.md")
  GPU_TESTS_LIMIT_S=${SUITE_LIMIT_S:-360} OUT=$OUT/suite bash .ci/gpu_tests.sh > "$OUT/suite.log" 2>&1
  grep -E "passed|failed|error" "$OUT/suite.log" | tail -n 4
  cd /tmp
  for mode in off default; do
    step "0.5B, GEMV $mode" 80 $PY -m pdserve.bench.engine --models qwen2.5-0.5b --decode-inputs 128 --offline 1024 \
      --no-hf --no-eager --fused-gemv $mode --out "$OUT/engine-$mode.md" 2>&1 | grep -v " INFO "
  done
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep -E "^===|passed|failed|error|Error|total" "$OUT/log.txt" | tail -n 30
cat "$OUT/gemv_step.md" 2>/dev/null
for f in "$OUT"/engine-*.md; do echo "## $f"; grep "^| Qwen" "$f"; done
