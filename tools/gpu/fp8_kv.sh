#!/usr/bin/env bash
# Issue 26's FP8 KV cache measurement in one device call (~4-5 minutes). From the repo root, with
# .whl/ carried (git-ignored; the server stack's wheels, nixl-cu13 included):
#
#   run(command="bash tools/gpu/fp8_kv.sh", kind="nvidia-h100-x4", carry=[".whl"], timeout_s=600)
#
# One GPU is enough (prefill and decode engines then share it, 0.4 / 0.45 of its memory); with two
# or more, the prefill engine runs on cuda:1 and the decode engine on cuda:0 (a P/D pair on two
# cards, as tools/gpu/handoff.sh), 0.85 each. bench/fp8_kv.py's docstring has the plan:
# Llama-3.1-8B-shaped random bf16 weights; bf16 KV then fp8 KV: KV bytes per token and cache
# tokens, the hand-off of a 3000-token prompt over NIXL and TCP, decode tok/s at 8k context (bs 1
# and 8). Extra arguments go to it (e.g. --handoffs 3 --batch 16).
# Files in $OUT (else ./gpu_fp8_kv_out): results.md, results.json, env.txt, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin gpu_fp8_kv server triton transformers nixl_cu13 zmq pdserve.worker.engine.llm_engine pdserve.bench.fp8_kv || exit 1
echo "setup: $(( $(date +%s) - T0 ))s"
set -o pipefail
cd /tmp
LEFT=$(( 590 - ($(date +%s) - T0) ))
timeout --kill-after=10 "$LEFT" $PY -m pdserve.bench.fp8_kv --out "$OUT/results.md" "$@" > "$OUT/log.txt" 2>&1
echo "bench fp8 kv: rc=$? in $(( $(date +%s) - T0 ))s (setup included)"
grep "^\[fp8kv\]" "$OUT/log.txt"
cat "$OUT/results.md" 2>/dev/null || tail -n 60 "$OUT/log.txt"
ls -la "$OUT"
