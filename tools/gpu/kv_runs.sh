#!/usr/bin/env bash
# Issue 24 item 3 (NIXL on the real block layout) on a GPU machine, from the repo root, in about
# 2-3 minutes (tools/gpu/perf.sh has the same real-layout rows among all of issue 17's):
#
#   run(kind="nvidia-h100-x2", carry=[".whl"], command="bash tools/gpu/kv_runs.sh")
#   (writes into $OUT, the device tool's folder; else ./kv_runs_out)
#
# 1. block runs after churn by eviction slack, CPU only (bench/block_churn.py)      block_churn.md
# 2. one card: NIXL pulls, contiguous vs real layout after churn, prepared vs per-pull
#    descriptors, against the same-run copy and the same descriptors copied without NIXL (one
#    cudaMemcpyAsync each, issued and from a CUDA graph, from a local and from a CUDA-IPC-mapped
#    source: is UCX the bound, or the copy engine?); real layout churned with strict LRU (slack 0)
#    and with eviction_slack 1                                  kv_runs_1gpu_slack0.md, ..._slack1.md
# 3. if a second GPU is visible: the same cuda:0 -> cuda:1      kv_runs_2gpu_slack0.md, ..._slack1.md
set -u
source tools/gpu/lib.sh
# The connector imports protocol/ (pydantic, fastapi): the server stack's wheels.
gpu_begin kv_runs server || exit 1
SLACKS=${KV_RUNS_SLACKS:-0 1}  # eviction slacks to measure (KV_RUNS_SLACKS=0: strict LRU only)

TLS=cuda_ipc,cuda_copy,tcp
KV=(--device cuda --ucx-tls "$TLS" --transports nixl --nixl-modes prepped dlist --layouts contiguous real
    --sizes-mib 64 256 1024 --breakdown-iters 0 --lease-registration-blocks 0)
main() {
  cd /tmp
  if [ -z "${KV_RUNS_SKIP_CHURN:-}" ]; then
    echo "=== block runs after churn (CPU)"
    timeout --kill-after=10 60 $PY -m pdserve.bench.block_churn --out "$OUT/block_churn.md"
  fi
  for slack in $SLACKS; do
    echo "=== one card, eviction slack $slack"
    timeout --kill-after=10 120 $PY -m pdserve.bench.kv_transfer "${KV[@]}" --eviction-slack $slack \
      --out "$OUT/kv_runs_1gpu_slack$slack.md" 2>&1 | grep -v "NIXL INFO"
  done
  if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    for slack in $SLACKS; do
      echo "=== cuda:0 -> cuda:1, eviction slack $slack"
      timeout --kill-after=10 120 $PY -m pdserve.bench.kv_transfer "${KV[@]}" --cross-gpu --eviction-slack $slack \
        --out "$OUT/kv_runs_2gpu_slack$slack.md" 2>&1 | grep -v "NIXL INFO"
    done
  fi
}
main 2>&1 | tee "$OUT/log.txt"
