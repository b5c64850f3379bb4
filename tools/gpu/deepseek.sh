#!/usr/bin/env bash
# Issue 47's DeepSeek-V3 GPU numbers in one device call (~6-8 minutes on one H200). From the repo
# root, with .whl/ carried (git-ignored; tools/gpu/lib.sh's ENGINE_DEPS wheels):
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/deepseek.sh", timeout_s=600)
#
# Steps, one after another (seconds are each step's limit):
#   tests compiled on the GPU: kernels/mla_decode.py and kernels/mla_cache_write.py vs their
#     references (bf16 and fp8 latent caches), the tiny DeepSeek-V3 engine on the Triton backend
#     with real decode CUDA-graph capture (fp8 latent cache) and eager mixed steps vs the torch
#     engine (fp32)                                                                               150
#   kernel: the MLA decode kernel vs the torch reference at 1k/8k/32k context, batch 1/8/64, bf16
#     and fp8 latent caches: us, latent GB/s vs the same run's copy bandwidth                       150
#   checkpoint: DeepSeek-V3's config.json with $LAYERS layers (default 4: $DENSE dense, default 1,
#     the rest MoE) and a tokenizer, no weights                                                      20
#   engine, one process per row: CUDA graphs (+ its bs=1 kernels under the profiler: profile.md),
#     eager (--enforce-eager: the same-run baseline), CUDA graphs with an fp8 latent cache: random
#     FP8 128x128-block weights made on the GPU (--load-format dummy), bs=1 decode ms/step after a
#     $CONTEXT-token prompt (default 1024) vs the active-parameter roofline                   120 each
#     (engine.md is rewritten after each row: a call cut short still has the rows done)
# Files in $OUT: env.txt, tests.txt, kernel.md, engine.md (+ engine_rows.jsonl), profile.md, log.txt.
set -u
LAYERS=${LAYERS:-4}
DENSE=${DENSE:-1}
CONTEXT=${CONTEXT:-1024}
source tools/gpu/lib.sh
gpu_begin gpu_deepseek engine triton transformers zmq pdserve.worker.engine.llm_engine pdserve.bench.deepseek || exit 1

main() {
  step "tests on the GPU" 150 $PY -m pytest -q -p no:cacheprovider -n 0 tests/kernels/test_mla_decode.py \
    tests/worker/test_triton_backend.py -k "mla or deepseek or cache_write" > "$OUT/tests.txt" 2>&1
  tail -n 5 "$OUT/tests.txt"
  cd /tmp
  step "kernel" 150 $PY -m pdserve.bench.deepseek kernel --out "$OUT/kernel.md"
  CKPT=/tmp/deepseek-v3-l$LAYERS
  step "checkpoint" 20 $PY -m pdserve.bench.deepseek checkpoint --checkpoint $CKPT --layers $LAYERS --dense-layers $DENSE
  ROWS="$OUT/engine_rows.jsonl"
  rm -f "$ROWS"
  for spec in "--profile $OUT/profile.md" "--eager" "--kv-cache-dtype fp8"; do
    step "engine $spec" 120 $PY -m pdserve.bench.deepseek engine --checkpoint $CKPT --context $CONTEXT \
      --rows "$ROWS" $spec 2>&1 | grep -v " INFO "
    $PY -m pdserve.bench.deepseek report --rows "$ROWS" --out "$OUT/engine.md" > /dev/null
  done
  cat "$OUT/kernel.md" "$OUT/engine.md" "$OUT/profile.md"
  uptime
}
main > "$OUT/log.txt" 2>&1
grep -v " INFO " "$OUT/log.txt" | tail -n 100
