#!/usr/bin/env bash
# Issue 18's GPU numbers in one device call on a 2- or 4-GPU machine (about 8 minutes). From the repo root:
#
#   run(kind="nvidia-h100-x2", carry=[".whl"], command="bash bench/gpu_tp.sh")
#
# 1. bench tp: Llama-3.1-8B with random bf16 weights at TP=1, 2 (and 4 where 4 GPUs are visible;
#    CUDA graphs): bs=1 decode ms/step, offline 1024/128 tok/s, the step's all-reduces alone, and
#    bf16 greedy/top-5 agreement with TP=1 (TP=1 is the reference, within this call only).
# 2. bench tp-pd: P/D between TP workers (2->2, 2->1, 1->2, 1->1) over TCP and NIXL, real worker
#    processes, bf16 greedy against the decode worker alone.
# ONLY_TP_PD=1 skips step 1. Writes $OUT/tp.md, $OUT/tp_pd.md and their logs. NCCL's destroy_process_group hangs on this image
# when ranks reach it at different times; the worker bounds it (worker/distributed.py).
set -u
OUT=${OUT:-$PWD/gpu_tp_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# The server (tp-pd) needs what the image lacks: carry .whl (bench/gpu_env.sh says how it is read).
source bench/gpu_env.sh zmq:pyzmq llguidance:llguidance nixl_cu13:nixl_cu13 fastapi:fastapi starlette:starlette \
  pydantic:pydantic pydantic_core:pydantic_core annotated_types:annotated_types typing_inspection:typing_inspection \
  uvicorn:uvicorn httptools:httptools opentelemetry:opentelemetry_api annotated_doc:annotated_doc || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
cd /tmp
[ -n "${ONLY_TP_PD:-}" ] || timeout --kill-after=10 300 $PY -m pdserve.bench.tp --tp 1 2 4 --num-prompts 128 \
  --checkpoint /tmp/l8b --timeout 290 --env PDSERVE_TP_COLLECTIVE_TIMEOUT_S=120 --out "$OUT/tp.md" \
  > "$OUT/tp_log.txt" 2>&1
echo "bench tp: rc=$?"
grep -v " INFO " "$OUT/tp_log.txt" | tail -n 12
timeout --kill-after=10 230 $PY -m pdserve.bench.tp_pd --ready-timeout 150 --checkpoint /tmp/tp_pd_ckpt \
  --out "$OUT/tp_pd.md" > "$OUT/tp_pd_log.txt" 2>&1
echo "bench tp-pd: rc=$?"
grep -v " INFO \|NIXL INFO" "$OUT/tp_pd_log.txt" | tail -n 16
