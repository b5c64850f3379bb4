#!/usr/bin/env bash
# The TCP KV data connections in the engine's process or their own (--kv-tcp-io, issue 50 item
# 5), on one GPU machine, from the repo root. Two parts, each fits one device call:
#
#   run(carry=[".whl"], command="TCP_IO_PARTS=bench bash tools/gpu/tcp_io.sh")    # ~4 min
#   run(carry=[".whl"], command="TCP_IO_PARTS=handoff bash tools/gpu/tcp_io.sh")  # ~8 min
#
# bench: `pdserve bench tcp-io` on the card, each side: the step thread (small CUDA ops,
#   synchronized per step) beside a reader pulling a kept pin over the real TCP data path, VRAM
#   to VRAM, with no reader / this side's connections as threads / in their own process.
#   $OUT/tcp_io_{prefill,decode}.md
# handoff: the hand-off on real workers, both on this card (tools/gpu/handoff_ab.sh: the
#   aggregated baseline, TCP with threads, TCP with --kv-tcp-io process, NIXL; Llama-3.1-8B
#   shaped random weights, 3000/200): TTFT, the first gap and the KV tail each way. $OUT/ab.tar.gz
# Issue 50's target: P/D over TCP within +10 ms of NIXL in TTFT. The GPU suite runs first in the
# session (the children's CUDA IPC path: test_pd_engines.py[async-tcp-io-process]); the bench
# part fits in the suite's call after it.
set -u
source tools/gpu/lib.sh
gpu_begin tcp_io server || exit 1
PARTS=${TCP_IO_PARTS:-bench handoff}
if [[ " $PARTS " == *" bench "* ]]; then
  for side in prefill decode; do
    step_into "$OUT/bench_$side.log" "bench $side" 120 $PY -m pdserve.bench.tcp_io --side $side --device cuda \
      --reader-device cuda --mib 256 --gbps 5 --seconds 4 --rounds 3 --out "$OUT/tcp_io_$side.md"
    cat "$OUT/tcp_io_$side.md" 2>/dev/null
  done
fi
if [[ " $PARTS " == *" handoff "* ]]; then
  OUT=$OUT HANDOFF_MIN_GPUS=1 B1=${B1:-200} B2=${B2:-130} AB_FIRST_STACKS=${AB_FIRST_STACKS:-agg,tcp-on} \
    bash tools/gpu/handoff_ab.sh new-auto new-io-process new-auto:nixl-on 2>&1 | tee "$OUT/handoff_ab.log" | grep "^=="
fi
echo "total $(( $(date +%s) - T0 ))s"
