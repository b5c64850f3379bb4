#!/usr/bin/env bash
# Issue 17's whole table in one device call on a 2-GPU machine (<= 10 minutes). From the repo root:
#
#   run(kind="nvidia-h100-x2", carry=[".whl"], command="bash tools/gpu/perf.sh")
#   (writes into $OUT, the device tool's folder; else ./gpu_perf_out)
#
# One step after another, each alone on the machine (seconds are each step's limit; ~5 min in all):
#   engine: bs=1 decode ms/step (CUDA graphs) for both models with the same-run copy bandwidth
#           and roofline %, offline 1024/128 against its floor, and the engine's own bs=1 graph
#           on the unfused vs fused decode path, per kernel (bench.engine --decode-paths)      200
#   KV transfer on one card (NIXL and TCP; contiguous / scattered / real layout after churn;
#           fixed cost per pull) against the same-run copy_                                   150
#   KV transfer cuda:0 -> cuda:1 (NIXL) against the same-run peer copy_ (needs 2 GPUs)        90
#   per-kernel profile of a bs=1 decode graph, fused vs v4, both models (profile_decode)      80
#   kernel tests compiled on the GPU (fused kernels, decode merge, compile count)             70
# (Run as two concurrent lanes, one card each, the KV rows lost a third: the side-channel round
# trip is host work, and it felt the other lane. Hence sequential.)
# Files in $OUT: env.txt, engine.md, kv_transfer_1gpu.md, kv_transfer_2gpu.md, profile_decode.md,
# tests.txt, log.txt.
set -u
source tools/gpu/lib.sh
# The engine imports protocol/ (kv_transfer_params: pydantic) and the KV bench the server's
# modules: without them a fresh device machine fails at the first import.
gpu_begin gpu_perf engine || exit 1
TLS=cuda_ipc,cuda_copy,tcp
main() {
  cd /tmp
  step "engine bench" 200 $PY -m pdserve.bench.engine --models qwen2.5-0.5b llama-3.1-8b --decode-inputs 128 \
    --offline 1024 --no-hf --no-eager --decode-paths --out "$OUT/engine.md" 2>&1 | grep -v " INFO "
  step "kv transfer, one card" 150 $PY -m pdserve.bench.kv_transfer --device cuda --ucx-tls "$TLS" \
    --out "$OUT/kv_transfer_1gpu.md" 2>&1 | grep -v "NIXL INFO"
  step "kv transfer, cuda:0 -> cuda:1" 90 $PY -m pdserve.bench.kv_transfer --device cuda --cross-gpu \
    --ucx-tls "$TLS" --transports nixl --out "$OUT/kv_transfer_2gpu.md" 2>&1 | grep -v "NIXL INFO"
  step "profile_decode" 80 $PY -m pdserve.bench.profile_decode --models qwen2.5-0.5b llama-3.1-8b \
    --context 128 --out "$OUT/profile_decode.md"
  cd "$OLDPWD" && step "kernel tests" 70 $PY -m pytest tests/kernels -q -n 4 -p no:cacheprovider > "$OUT/tests.txt" 2>&1
  tail -n 3 "$OUT/tests.txt"
  uptime
  ls -la "$OUT"
}
main > "$OUT/log.txt" 2>&1
grep -v "^|" "$OUT/log.txt" | tail -n 40
