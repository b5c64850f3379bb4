#!/usr/bin/env bash
# Where a split prefill's time goes (tools/gpu/prefill_split.py) in one device call, one GPU, ~4 min:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/prefill_split.sh")
#
# Files in $OUT: env.txt, split.md, log.txt. PROMPTS: prompt lengths (default 1024 3000 8192).
set -u
source tools/gpu/lib.sh
gpu_begin gpu_prefill_split engine || exit 1
cd /tmp && timeout 540 $PY "$REPO/tools/gpu/prefill_split.py" --prompt ${PROMPTS:-1024 3000 8192} \
  --out "$OUT/split.md" ${SPLIT_ARGS:-} 2>&1 | tee "$OUT/log.txt" | grep -v "^Writing\|it/s\]"
echo "rc=${PIPESTATUS[0]}"
