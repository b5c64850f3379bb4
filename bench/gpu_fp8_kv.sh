#!/usr/bin/env bash
# Issue 26's FP8 KV cache measurement in one device call (~4-5 minutes). From the repo root, with
# .whl/ carried (git-ignored; the server stack's wheels, nixl-cu13 included):
#
#   run(command="bash bench/gpu_fp8_kv.sh", kind="nvidia-h100-x4", carry=[".whl"], timeout_s=600)
#
# One GPU is enough (prefill and decode engines then share it, 0.4 / 0.45 of its memory); with two
# or more, the prefill engine runs on cuda:1 and the decode engine on cuda:0 (a P/D pair on two
# cards, as bench/gpu_handoff.sh), 0.85 each. bench/gpu_fp8_kv.py's docstring has the plan:
# Llama-3.1-8B-shaped random bf16 weights; bf16 KV then fp8 KV: KV bytes per token and cache
# tokens, the hand-off of a 3000-token prompt over NIXL and TCP, decode tok/s at 8k context (bs 1
# and 8). Extra arguments go to it (e.g. --handoffs 3 --batch 16).
# Files in $OUT (else ./gpu_fp8_kv_out): results.md, results.json, env.txt, log.txt.
set -u
OUT=${OUT:-$PWD/gpu_fp8_kv_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the bench runs from /tmp
PY=${PYTHON:-python3}
T0=$(date +%s)
source bench/gpu_server_deps.sh
source bench/gpu_env.sh "${SERVER_DEPS[@]}" > "$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; exit 1; }
{
  date -u
  echo "commit: $(git describe --always --dirty 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv
  nvidia-smi topo -m 2>/dev/null | head -n 4
  echo "cores: $(nproc)"
  cd /tmp  # python from the repo root would find its operator/ folder before the standard library's
  # The imports the engines need, before any model is made: a missing wheel fails here in seconds.
  $PY -c "import sys, torch, triton, transformers, nixl_cu13, zmq, pdserve.worker.engine, pdserve.bench.gpu_fp8_kv
print('python', sys.version.split()[0], '· torch', torch.__version__, '· triton', triton.__version__,
      '· transformers', transformers.__version__)
print('fp8 KV dtype:', torch.float8_e4m3fn, '· GPU', torch.cuda.get_device_name(0), '· capability', torch.cuda.get_device_capability(0))
print('imports: ok · GPUs', torch.cuda.device_count())"
  cd "$OLDPWD"
} >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
grep -q "imports: ok" "$OUT/env.txt" || { echo "an import failed (env.txt above): stopping before any model is made"; exit 1; }
echo "setup: $(( $(date +%s) - T0 ))s"
set -o pipefail
cd /tmp
LEFT=$(( 590 - ($(date +%s) - T0) ))
timeout --kill-after=10 "$LEFT" $PY -m pdserve.bench.gpu_fp8_kv --out "$OUT/results.md" "$@" > "$OUT/log.txt" 2>&1
echo "bench fp8 kv: rc=$? in $(( $(date +%s) - T0 ))s (setup included)"
grep "^\[fp8kv\]" "$OUT/log.txt"
cat "$OUT/results.md" 2>/dev/null || tail -n 60 "$OUT/log.txt"
ls -la "$OUT"
