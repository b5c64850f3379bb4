#!/usr/bin/env bash
# LoRA adapters' GPU numbers (issue 48's table) in one device call on one H200. From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="LORA_STEPS=tests,kernels,bench bash tools/gpu/lora.sh")
#   (writes into $OUT, the device tool's folder; else ./gpu_lora_out)
#
# .whl: tools/gpu/lib.sh's SERVER_DEPS and PEFT_DEPS (peft, accelerate, psutil: peft writes the adapters).
# 1. tests: the LoRA kernels compiled: BGMV (kernels/lora.py) and SGMV (kernels/lora_sgmv.py), packed
#    q | k | v and gate | up included, against their references, at small and Llama-3.1-8B sizes; the
#    Triton model path with captured decode graphs (prefill by segment, decode by token) against
#    transformers + PEFT merged                                                      ~60 s (limit 150)
# 2. kernels: bench/lora_kernels.py, a decode step's BGMV launches in one CUDA graph at batch 1/8/64 x
#    1/4 adapters: unfused (14 launches a layer) vs packed (8) with block-diagonal B vs B by part (the
#    engine); the shrink's K_PER_SPLIT swept over 128/256/512/1024/all of K (the "best" column picks
#    kernels/lora.py's default); beside the base GEMMs, one stream vs the shrinks forked onto a
#    second one (the engine's default)                                             ~120 s (limit 240)
# 3. bench: bench/lora.py: Llama-3.1-8B shapes (--load-format dummy: random bf16 weights made on the card),
#    8 random rank-16 PEFT adapters (q/k/v/o/gate/up/down, peft's save_pretrained); the base engine
#    (no --enable-lora) then one with --enable-lora --max-loras 8, requests spread over 0, 1, 4, 8
#    adapters: decode ms/step at batch 1, 8, 64, the prefill of 2048 tokens, offline 64 x 1024/128
#    tok/s, each against the base of the same run (issue 48's target: batch 8 with 4 adapters
#    <= 1.25x the base step); a third engine with the shrinks in line (PDSERVE_LORA_FORK_SHRINK=0)
#                                                                                    ~120 s (limit 240)
# LORA_STEPS (default tests,kernels,bench) picks the steps; all three fit one 540 s call (the limits
# add up to 630 s only if every step runs to its limit).
# Files in $OUT: env.txt, tests.txt, lora_kernels.md and lora_kernels_log.txt (step 2), lora.md (the
# table), lora.json (its rows), lora_log.txt (step 3).
set -u
source tools/gpu/lib.sh
gpu_begin gpu_lora lora peft || exit 1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # one card, whatever the machine has

STEPS=${LORA_STEPS:-tests,kernels,bench}
if [[ ,$STEPS, == *,tests,* ]]; then
  step_into "$OUT/tests.txt" "LoRA kernel and model tests" 150 \
    $PY -m pytest tests/kernels/test_lora.py tests/kernels/test_lora_sgmv.py tests/worker/test_lora.py -q -n 0 \
    -k "not tensor_parallel" -p no:cacheprovider
  tail -n 3 "$OUT/tests.txt"
fi

cd /tmp
if [[ ,$STEPS, == *,kernels,* ]]; then
  step_into "$OUT/lora_kernels_log.txt" "bench lora --kernels-only" 240 \
    $PY -m pdserve.bench.lora --kernels-only --out "$OUT/lora_kernels.md"
  cat "$OUT/lora_kernels.md" 2>/dev/null
fi
if [[ ,$STEPS, == *,bench,* ]]; then
  step_into "$OUT/lora_log.txt" "bench lora" 240 $PY -m pdserve.bench.lora --out "$OUT/lora.md"
  grep -v " INFO \|it/s\]" "$OUT/lora_log.txt" | grep -i "error\|Traceback" | head -n 5
  cat "$OUT/lora.md" 2>/dev/null
fi
echo "total: $(( $(date +%s) - T0 ))s"
