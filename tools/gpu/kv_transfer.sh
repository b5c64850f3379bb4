#!/usr/bin/env bash
# KV-transfer bench on a GPU machine (issue 17), from the repo root, in about 3 minutes:
#
#   bash tools/gpu/kv_transfer.sh      # writes into $OUT (the device tool's folder), else ./kv_transfer_out
#
# 1. one GPU, VRAM -> VRAM on the same card (P and D sharing it), NIXL and TCP    kv_transfer_1gpu.md
# 2. if a second GPU is visible: cuda:0 -> cuda:1, NIXL                            kv_transfer_2gpu.md
# Each table: GB/s by size x layout (contiguous / scattered / real = after BlockManager churn,
# with its descriptor count) for NIXL with prepared and per-pull descriptor lists (and TCP),
# against the same-run torch copy; a 1-block NIXL pull taken apart; per-lease registration cost.
#
# Needs torch (the device image has it) and nixl-cu13, pyzmq, prometheus-client: each one the
# image lacks is taken from .whl/ (git-ignored; carry it): a wheel .whl/<name>-*.whl, installed
# with --no-deps into a temporary folder, or a plain package folder .whl/site/<module>.
set -u
source tools/gpu/lib.sh
# The connector imports protocol/ (pydantic, fastapi): the server stack's wheels.
gpu_begin kv_transfer server || exit 1

TLS=cuda_ipc,cuda_copy,tcp
echo "=== one GPU (same card)"
timeout --kill-after=10 150 $PY -m pdserve.bench.kv_transfer --device cuda --ucx-tls "$TLS" \
  --out "$OUT/kv_transfer_1gpu.md" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/log.txt"
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  echo "=== two GPUs (cuda:0 -> cuda:1)"
  timeout --kill-after=10 90 $PY -m pdserve.bench.kv_transfer --device cuda --cross-gpu --ucx-tls "$TLS" \
    --transports nixl --out "$OUT/kv_transfer_2gpu.md" 2>&1 | grep -v "NIXL INFO" | tee -a "$OUT/log.txt"
fi
