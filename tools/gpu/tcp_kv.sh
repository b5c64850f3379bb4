#!/usr/bin/env bash
# Issue 30 in one device call on 2 GPUs of one host (<= 10 minutes), from the repo root:
#
#   run(command="bash tools/gpu/tcp_kv.sh", kind="nvidia-h100-x4", carry=[".whl"], timeout_s=600)
#
# 1. bench/tcp_kv.py, cuda:0 -> cuda:1: the KV pull of 64 MiB, 375 MiB and 1 GiB on the real
#    Llama-3.1-8B block layout over the TCP data path (and its stream counts), the inline TCP
#    read it replaced, NIXL with UCX_TLS=tcp and tcp,cuda_copy, against a raw socket between the
#    same two processes (1 and 4 streams) in the same run                              tcp_kv.md
# 2. with what the call has left (TCP_KV_HANDOFF=0 skips it): bench/handoff.py's tcp-off and
#    tcp-on stacks (`pdserve up --kv-transfer tcp`, 3000/200 at 1 req/s): the first gap after
#    token 1 without and with the streamed hand-off                        handoff/results.md
# Extra arguments go to bench/tcp_kv.py. Files in $OUT (else ./tcp_kv_out); env.txt, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin tcp_kv server || exit 1
cd /tmp  # not the repo root: its operator/ folder would shadow the standard library's
echo "=== KV pull over TCP (setup $(( $(date +%s) - T0 ))s)"
timeout --kill-after=10 "${TCP_KV_PULL_S:-240}" $PY -m pdserve.bench.tcp_kv --server-device cuda:0 \
  --client-device cuda:1 --out "$OUT/tcp_kv.md" "$@" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/log.txt"
LEFT=$(( ${TCP_KV_CALL_S:-590} - ($(date +%s) - T0) ))
if [ "${TCP_KV_HANDOFF:-1}" = 1 ] && [ "$LEFT" -gt 150 ]; then
  BUDGET=$(( LEFT - 45 ))
  echo "=== first gap over TCP, overlap off and on (budget ${BUDGET}s)"
  timeout --kill-after=8 "$(( BUDGET + 30 ))" $PY -m pdserve.bench.handoff --out "$OUT/handoff" \
    --stacks "${TCP_KV_STACKS:-tcp-on,tcp-off}" --seconds 15 --budget-s "$BUDGET" > "$OUT/handoff.log" 2>&1
  echo "handoff: rc=$?"
  grep "^\[handoff" "$OUT/handoff.log" | tail -n 20
  cat "$OUT/handoff/results.md" 2>/dev/null | head -n 40
else
  echo "first gap: skipped (${LEFT}s left)"
fi
echo "total $(( $(date +%s) - T0 ))s"
