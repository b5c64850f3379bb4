#!/usr/bin/env bash
# Narrow-strip tiles at one token, measured in one device call on one H200 (<= 6 minutes): the
# sweeps print the tables the kernels read; paste them in, then measure the step. From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/narrow_tiles.sh")
#
# 1. bench/gemv.py --rows 1: Llama-3.1-8B, Qwen2.5-0.5B, gpt-oss and Qwen3-30B-A3B's attention
#    shapes, the fused GEMV's sweep (narrow strips, and narrow strips with the prologue apart)
#    against cuBLAS: the M = 1 entries of kernels/fused_gemv.MEASURED                   ~90 s
# 2. bench/fp8_gemv_tune.py for Llama-3.1-8B (per-channel and block scales; narrow strips at
#    M = 1): the entries of kernels/fp8_gemv_configs.py                                 ~200 s
# Files in $OUT: gemv.md, fp8_tune.md, fp8_tune.json, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin narrow_tiles engine || exit 1
main() {
  cd /tmp
  step "gemv sweep, M = 1" 150 $PY -m pdserve.bench.gemv --rows 1 \
    --models llama-3.1-8b qwen2.5-0.5b gpt-oss qwen3-30b-a3b --out "$OUT/gemv.md"
  step "fp8 tiles" 300 $PY -m pdserve.bench.fp8_gemv_tune --shapes llama-3.1-8b --formats channel block \
    --out "$OUT/fp8_tune.md" --json "$OUT/fp8_tune.json"
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep -E "^===|Error|total" "$OUT/log.txt" | tail -n 8
sed -n '/^MEASURED/,$p' "$OUT/gemv.md" 2>/dev/null
cat "$OUT/fp8_tune.md" 2>/dev/null
