#!/usr/bin/env bash
# Issue 27's GPU numbers (mixture of experts) in one device call: ~5 minutes on one GPU
# (CUDA_VISIBLE_DEVICES=<one card>: the TP=1 rows only), ~7 on 4. From the repo root:
#
#   run(kind="nvidia-h100-x4", carry=[".whl"], command="bash tools/gpu/moe.sh")
#
# Steps, one after another (seconds are each step's limit):
#   tests compiled on the GPU: the fused MoE kernel (both paths) and routing vs their references,
#     and an MoE engine on Triton with real CUDA-graph capture vs the torch engine (fp32)        120
#   decode: before/after at 1/2/4/8/16 tokens inside CUDA graphs: the sorted path vs the decode
#     path (default tiles, best of a sweep), routing with 4 warps vs 1, the MoE layer old vs new   120
#   kernel: fused MoE vs a per-expert loop of cuBLAS matmuls at 1/8/64/512 tokens, Qwen3-30B-A3B's
#     layer shape (E=128, k=8, H=2048, I=768), default tiles and the best of a sweep, the kernel in
#     a CUDA graph, bytes of the experts hit per second vs copy bandwidth                          90
#   fp8: the model's MoE op with FP8 expert weights (128x128 block, per-channel) vs bf16 at
#     1/8/64/512 tokens, the same layer shape                                                       90
#   checkpoint: Qwen3-30B-A3B's config.json with $LAYERS (default all 48) layers and a tokenizer,
#     no weights: the engines make random bf16 weights on the GPU (--load-format dummy), so
#     nothing is written to disk (LAYERS=12 for the 12-layer rows of earlier runs)                 20
#   engine, one process tree per row, most wanted first: TP=1 (+ its bs=1 kernels under the
#     profiler: profile.md); TP=1 with --moe-path sorted (the kernels as before the decode path,
#     bs=1 only: the same-run baseline); TP=2 with expert parallelism; TP=4 with it (where 4 GPUs
#     are visible); TP=2 without it: bs=1 decode ms/step vs the active-parameter roofline,
#     offline 1024/128 tok/s ($PROMPTS prompts, default 64)                                90 each
#     (engine.md is rewritten after each row: a call cut short still has the rows done)
# Files in $OUT: env.txt, tests.txt, decode.md, kernel.md, fp8.md, engine.md (+ engine_rows.jsonl),
# profile.md, log.txt.
set -u
LAYERS=${LAYERS:-48}
PROMPTS=${PROMPTS:-64}
source tools/gpu/lib.sh
gpu_begin gpu_moe engine || exit 1

main() {
  step "tests on the GPU" 120 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe.py \
    tests/kernels/test_fused_moe_fp8.py tests/kernels/test_fused_moe_mxfp4.py tests/kernels/test_moe_route.py "tests/worker/test_triton_backend.py::test_moe_triton_backend_with_decode_graphs_matches_torch" > "$OUT/tests.txt" 2>&1
  tail -n 5 "$OUT/tests.txt"
  cd /tmp
  step "decode" 120 $PY -m pdserve.bench.moe decode --out "$OUT/decode.md"
  step "kernel" 90 $PY -m pdserve.bench.moe kernel --out "$OUT/kernel.md"
  step "fp8" 90 $PY -m pdserve.bench.moe fp8 --out "$OUT/fp8.md"
  step "mxfp4" 150 $PY -m pdserve.bench.moe mxfp4 --out "$OUT/mxfp4.md"
  CKPT=/tmp/qwen3-30b-a3b-l$LAYERS
  step "checkpoint" 20 $PY -m pdserve.bench.moe checkpoint --checkpoint $CKPT --layers $LAYERS --config-only
  ROWS="$OUT/engine_rows.jsonl"
  rm -f "$ROWS"
  NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
  # A spec's own --num-prompts (after the default) wins: the "before" row is bs=1 only.
  for spec in "1 --profile $OUT/profile.md" "1 --moe-path sorted --num-prompts 0" "2 --ep" "4 --ep" "2"; do
    set -- $spec
    [ "$1" -le "$NGPU" ] || continue
    step "engine TP=$spec" 90 $PY -m pdserve.bench.moe engine --checkpoint $CKPT --layers $LAYERS \
      --load-format dummy --num-prompts $PROMPTS --rows "$ROWS" --tp $spec 2>&1 | grep -v " INFO "
    $PY -m pdserve.bench.moe report --rows "$ROWS" --out "$OUT/engine.md" > /dev/null
  done
  cat "$OUT/decode.md" "$OUT/fp8.md" "$OUT/engine.md" "$OUT/profile.md"
  uptime
}
main > "$OUT/log.txt" 2>&1
grep -v " INFO " "$OUT/log.txt" | tail -n 100
