#!/usr/bin/env bash
# Host time per decode step, synchronous engine vs --async-scheduling, in one device call
# (<= 5 minutes). From the repo root:
#
#   run(kind="nvidia-h100-x4", carry=[".whl"], command="bash tools/gpu/step_overlap.sh")
#   (writes into $OUT, the device tool's folder; else ./gpu_step_overlap_out)
#
# Files in $OUT: env.txt, step_overlap.md (Qwen2.5-0.5B and Llama-3.1-8B, batch 1 and 8, both
# engines in the same run on the same card, and whether their greedy tokens agree), log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin gpu_step_overlap engine || exit 1
main() {
  cd /tmp
  timeout --kill-after=10 240 $PY -m pdserve.bench.step_overlap --models qwen2.5-0.5b llama-3.1-8b --batch 1 8 \
    --steps 200 --out "$OUT/step_overlap.md" 2>&1 | grep -v " INFO "
}
main > "$OUT/log.txt" 2>&1
cat "$OUT/log.txt" | tail -n 30
