#!/usr/bin/env bash
# Issue 18's GPU table in one device call on a 4-GPU machine (about 6 minutes). From the repo root:
#
#   run(kind="nvidia-h100-x4", carry=[".bench-structured"], command="bash bench/gpu_tp.sh")
#
# Llama-3.1-8B with random bf16 weights at TP=1, 2, 4 (CUDA graphs): bs=1 decode ms/step, offline
# 1024/128 tok/s, the step's all-reduces alone, and bf16 greedy/top-5 agreement with TP=1 (only
# within one call: TP=1 is the reference). Writes $OUT/tp.md and $OUT/tp_log.txt.
# NCCL's destroy_process_group hangs on this image when ranks reach it at different times; the
# worker bounds it (worker/distributed.py) and the bench prints each size's rows as it goes.
set -u
OUT=${OUT:-$PWD/gpu_tp_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
source bench/gpu_env.sh zmq:pyzmq llguidance:llguidance || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
cd /tmp && timeout --kill-after=10 480 $PY -m pdserve.bench.tp --tp 1 2 4 --num-prompts 128 \
  --checkpoint /tmp/l8b --timeout 460 --env PDSERVE_TP_COLLECTIVE_TIMEOUT_S=120 --out "$OUT/tp.md" \
  > "$OUT/tp_log.txt" 2>&1
echo "bench tp: rc=$?"
grep -v " INFO " "$OUT/tp_log.txt" | tail -n 30
