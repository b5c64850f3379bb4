#!/usr/bin/env bash
# P/D with --async-scheduling against synchronous P/D and an aggregated engine, in one device call
# (<= 10 minutes). From the repo root:
#
#   run(kind="nvidia-h100-x4", carry=[".whl"], command="bash tools/gpu/pd_async.sh")
#   (writes into $OUT, the device tool's folder; else ./gpu_pd_async_out)
#
# bench/pd_async.py (its docstring has the plan): Llama-3.1-8B-shaped random bf16 weights, 3000 in /
# 64 out, the streamed hand-off in 512-token chunks, the tail split (two prefill steps) and then
# the even split (six), prefill on cuda:0 and decode on cuda:1 over NIXL; the aggregated engine
# synchronous and async is the same-run baseline. Extra arguments go to both runs (e.g.
# --model qwen2.5-0.5b: the 8B checkpoint's writing and two-engine starts may not leave the even
# split time). Each row is printed as soon as its mode ends. Files in $OUT: env.txt, pd_async_tail.md, pd_async_even.md, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin gpu_pd_async server triton nixl_cu13 pdserve.worker.engine.llm_engine || exit 1
main() {
  cd /tmp
  # The tail split first (the default, issue 24's numbers); the even split if time is left.
  timeout --kill-after=10 420 $PY -m pdserve.bench.pd_async --split tail --checkpoint /tmp/pd_async_ckpt \
    --out "$OUT/pd_async_tail.md" "$@" 2>&1 \
    | grep -v " INFO "
  LEFT=$(( 580 - ($(date +%s) - T0) ))
  [ "$LEFT" -gt 120 ] && timeout --kill-after=10 "$LEFT" $PY -m pdserve.bench.pd_async --split even \
    --checkpoint /tmp/pd_async_ckpt --modes agg-sync,pd-sync,pd-async --out "$OUT/pd_async_even.md" "$@" 2>&1 \
    | grep -v " INFO "
}
main "$@" > "$OUT/log.txt" 2>&1
echo "total: $(( $(date +%s) - T0 ))s"
tail -n 40 "$OUT/log.txt"
