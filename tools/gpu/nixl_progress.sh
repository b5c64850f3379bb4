#!/usr/bin/env bash
# NIXL's progress thread: busy poll (PDSERVE_NIXL_PROGRESS_DELAY_US=0, NIXL's Python default) vs
# event-driven with a 1 ms timeout (pdserve's default), on one GPU, after the whole GPU suite (the
# change touches the worker). One device call, ~9 minutes, from the repo root:
#
#   run(carry=[".whl"], command="bash tools/gpu/nixl_progress.sh")
#
# 1. .ci/gpu_tests.sh (limit SUITE_S, default 380 s)                      $OUT/suite/gpu-tests.txt
# 2. bench/kv_transfer.py on the card (P and D on it, cuda_ipc), NIXL only, delay 0 / 1000 / 0 /
#    1000 alternating (a repeat says the noise)                            $OUT/kv-delay-*.md
set -u
OUT=${OUT:-$PWD/gpu_nixl_progress_out}
mkdir -p "$OUT"
GPU_TESTS_LIMIT_S=${SUITE_S:-380} OUT=$OUT/suite bash .ci/gpu_tests.sh 2>&1 | tail -n 15
source tools/gpu/lib.sh
gpu_begin kv_transfer server || exit 1
for round in 1 2; do
  for delay in 0 1000; do
    echo "=== round $round, delay $delay us"
    (cd /tmp && PDSERVE_NIXL_PROGRESS_DELAY_US=$delay timeout --kill-after=10 60 $PY -m pdserve.bench.kv_transfer --device cuda \
      --ucx-tls cuda_ipc,cuda_copy,tcp --transports nixl --sizes-mib 1 16 256 --layouts contiguous real \
      --nixl-modes prepped serial --lease-registration-blocks 0 --no-descriptor-copies \
      --out "$OUT/kv-delay-$delay-r$round.md" 2>&1 | grep -v "NIXL INFO" | grep "|" | head -20)
  done
done
