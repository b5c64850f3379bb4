#!/usr/bin/env bash
# The TCP KV senders in the engine's process or their own (--kv-tcp-io, issue 50 item 5), on
# one GPU machine in one call (~8 min with SENDERS_HANDOFF=1), from the repo root:
#
#   run(carry=[".whl"], command="bash tools/gpu/tcp_senders.sh")
#
# 1. `pdserve bench tcp-senders` on the card: the step thread (small CUDA ops, synchronized per
#    step) beside a reader pulling a kept pin over the real TCP data path, VRAM to VRAM, with no
#    senders / sender threads / the senders' child, every mode each round.       tcp_senders.md
# 2. SENDERS_HANDOFF=1 (the default): the hand-off on real workers, both on this card
#    (tools/gpu/handoff_ab.sh: TCP with thread senders, TCP with the child, NIXL; Llama-3.1-8B
#    shaped random weights, 3000/200): TTFT and the first gap each way.        ab.tar.gz
# Issue 50's target: P/D over TCP within +10 ms of NIXL in TTFT. Run the GPU suite before this
# in the same session (the child's CUDA IPC path: test_pd_engines.py[async-tcp-sender-process]).
set -u
source tools/gpu/lib.sh
gpu_begin tcp_senders server || exit 1
step_into "$OUT/bench.log" bench 200 $PY -m pdserve.bench.tcp_senders --device cuda --reader-device cuda \
  --mib 256 --gbps 5 --seconds 5 --rounds 3 --out "$OUT/tcp_senders.md"
cat "$OUT/tcp_senders.md" 2>/dev/null
if [ "${SENDERS_HANDOFF:-1}" = 1 ]; then
  OUT=$OUT HANDOFF_MIN_GPUS=1 B1=${B1:-200} B2=${B2:-130} bash tools/gpu/handoff_ab.sh new-auto new-senders-process \
    new-auto:nixl-on 2>&1 | tee "$OUT/handoff_ab.log" | grep "^=="
fi
echo "total $(( $(date +%s) - T0 ))s"
