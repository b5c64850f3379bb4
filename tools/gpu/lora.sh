#!/usr/bin/env bash
# LoRA adapters' GPU numbers (issue 48's table) in one device call on one H200 (~7 minutes). From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/lora.sh")
#   (writes into $OUT, the device tool's folder; else ./gpu_lora_out)
#
# .whl: tools/gpu/lib.sh's ENGINE_DEPS and PEFT_DEPS (peft, accelerate, psutil: peft writes the adapters).
# 1. The LoRA kernels compiled: BGMV (kernels/lora.py) and SGMV (kernels/lora_sgmv.py) against their
#    references, at small and Llama-3.1-8B sizes; the Triton model path with captured decode graphs
#    (prefill by segment, decode by token) against transformers + PEFT merged             120 s
# 2. bench/lora.py: Llama-3.1-8B shapes (--load-format dummy: random bf16 weights made on the card),
#    8 random rank-16 PEFT adapters (q/k/v/o/gate/up/down, peft's save_pretrained); the base engine
#    (no --enable-lora) then one with --enable-lora --max-loras 8, requests spread over 0, 1, 4, 8
#    adapters: decode ms/step at batch 1, 8, 64, the prefill of 2048 tokens, offline 64 x 1024/128
#    tok/s, each against the base of the same run (issue 48's target: batch 8 with 4 adapters
#    <= 1.25x the base step)                                                               420 s
# 3. (LORA_STEPS=...,kernels) bench/lora_kernels.py: a decode step's BGMV launches alone in one CUDA
#    graph, split-K shrink vs one program per token, batch 1/8/64 x 0/1/4 adapters         ~60 s
# LORA_STEPS (default tests,bench) picks the steps; 1+3 and 2 fit one 600 s device call each:
#   LORA_STEPS=tests,kernels bash tools/gpu/lora.sh   then   LORA_STEPS=bench bash tools/gpu/lora.sh
# Files in $OUT: env.txt, tests.txt, lora.md (the table), lora.json (its rows), lora_log.txt,
# lora_kernels.md and lora_kernels_log.txt (step 3).
set -u
source tools/gpu/lib.sh
gpu_begin gpu_lora lora peft || exit 1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # one card, whatever the machine has

STEPS=${LORA_STEPS:-tests,bench}
if [[ ,$STEPS, == *,tests,* ]]; then
  step_into "$OUT/tests.txt" "LoRA kernel and model tests" 150 \
    $PY -m pytest tests/kernels/test_lora.py tests/kernels/test_lora_sgmv.py tests/worker/test_lora.py -q -n 0 \
    -k "not tensor_parallel" -p no:cacheprovider
  tail -n 3 "$OUT/tests.txt"
fi

cd /tmp
if [[ ,$STEPS, == *,kernels,* ]]; then
  step_into "$OUT/lora_kernels_log.txt" "bench lora --kernels-only" 200 \
    $PY -m pdserve.bench.lora --kernels-only --out "$OUT/lora_kernels.md"
  cat "$OUT/lora_kernels.md" 2>/dev/null
fi
if [[ ,$STEPS, == *,bench,* ]]; then
  step_into "$OUT/lora_log.txt" "bench lora" 480 $PY -m pdserve.bench.lora --out "$OUT/lora.md"
  grep -v " INFO \|it/s\]" "$OUT/lora_log.txt" | grep -i "error\|Traceback" | head -n 5
  cat "$OUT/lora.md" 2>/dev/null
fi
echo "total: $(( $(date +%s) - T0 ))s"
