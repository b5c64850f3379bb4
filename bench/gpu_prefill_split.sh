#!/usr/bin/env bash
# Where a split prefill's time goes (bench/prefill_split.py) in one device call, one GPU, ~4 min:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash bench/gpu_prefill_split.sh")
#
# Files in $OUT: env.txt, split.md, log.txt. PROMPTS: prompt lengths (default 1024 3000 8192).
set -u
OUT=${OUT:-$PWD/gpu_prefill_split_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
source bench/gpu_server_deps.sh
source bench/gpu_env.sh "${ENGINE_DEPS[@]}" || exit 1
gpu_env_report > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
cd /tmp && timeout 540 $PY -m pdserve.bench.prefill_split --prompt ${PROMPTS:-1024 3000 8192} \
  --out "$OUT/split.md" ${SPLIT_ARGS:-} 2>&1 | tee "$OUT/log.txt" | grep -v "^Writing\|it/s\]"
echo "rc=${PIPESTATUS[0]}"
