#!/usr/bin/env bash
# Tensor parallelism's GPU numbers in one device call on a 2- or 4-GPU machine. From the repo root:
#
#   run(kind="nvidia-h100-x4", carry=[".whl"], command="bash tools/gpu/tp.sh")
#
# 1. bench tp: Llama-3.1-8B with random bf16 weights at TP=1, 2 (and 4 where 4 GPUs are visible;
#    CUDA graphs), each TP>1 size once per all-reduce method ($ALL_REDUCE: "nccl", the worker's
#    default; "auto" is symmetric memory for small messages; with QUICK=1 "nccl auto", NCCL alone then
#    auto, same run, same cards): bs=1 decode ms/step, the step's 2L+1 all-reduces alone (one CUDA graph) and
#    per all-reduce, bf16 greedy/top-5 agreement with TP=1 (TP=1 is the reference, within this
#    call only), offline 1024/128 tok/s and the fp32 transformers check.
# 2. bench tp-pd: P/D between TP workers (2->2, 2->1, 1->2, 1->1) over TCP and NIXL, real worker
#    processes, bf16 greedy against the decode worker alone.
# TP_SIZES="1 2" limits the sizes; TP_EXTRA adds arguments (e.g. "--profile DIR": rank 0's kernels
# per step, one table per engine). QUICK=1: step 1 without the offline run and the fp32 check, and no step 2 (about 6 minutes:
# issue 25's all-reduce comparison). ONLY_TP_PD=1 skips step 1. Writes $OUT/env.txt, $OUT/tp.md,
# $OUT/tp_pd.md and their logs. NCCL's destroy_process_group hangs on this image when ranks reach
# it at different times; the worker bounds it (worker/parallel/group.py).
set -u
source tools/gpu/lib.sh
# The engine imports protocol/ (pydantic); the server (tp-pd) needs the rest the image lacks.
gpu_begin gpu_tp server || exit 1
cd /tmp
if [ -n "${QUICK:-}" ]; then
  TP_ARGS="--num-prompts 0 --no-fp32-check --decode-steps 64" LIMIT=420 ALL_REDUCE=${ALL_REDUCE:-nccl auto}
else  # one engine per TP size: the offline runs and tp-pd must fit the same 10-minute call
  TP_ARGS="--num-prompts 128" LIMIT=400 ALL_REDUCE=${ALL_REDUCE:-nccl}
fi
[ -n "${ONLY_TP_PD:-}" ] || timeout --kill-after=10 $LIMIT $PY -m pdserve.bench.tp --tp ${TP_SIZES:-1 2 4} $TP_ARGS ${TP_EXTRA:-} \
  --all-reduce $ALL_REDUCE --checkpoint /tmp/l8b --timeout $((LIMIT - 10)) --env PDSERVE_TP_COLLECTIVE_TIMEOUT_S=120 \
  --out "$OUT/tp.md" > "$OUT/tp_log.txt" 2>&1
echo "bench tp: rc=$?"
grep -v " INFO " "$OUT/tp_log.txt" | tail -n 40
grep "symmetric-memory\|all-reduce of" "$OUT/tp_log.txt" | sed "s/^.* \(INFO\|WARNING\) //" | sort | uniq -c | sort -rn | head -n 12
[ -n "${QUICK:-}" ] && exit 0
timeout --kill-after=10 230 $PY -m pdserve.bench.tp_pd --ready-timeout 150 --checkpoint /tmp/tp_pd_ckpt \
  --out "$OUT/tp_pd.md" > "$OUT/tp_pd_log.txt" 2>&1
echo "bench tp-pd: rc=$?"
grep -v " INFO \|NIXL INFO" "$OUT/tp_pd_log.txt" | tail -n 16
