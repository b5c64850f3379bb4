#!/usr/bin/env bash
# Issue 47's DeepSeek-V3 GPU numbers in one device call (at most ~10 minutes on one H200). From the repo
# root, with .whl/ carried (git-ignored; tools/gpu/lib.sh's SERVER_DEPS wheels: the hand-off part
# runs the KV connector):
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/deepseek.sh", timeout_s=600)
#
# Steps, most wanted first (seconds are each step's limit, cut to what is left of BUDGET, default
# 570 s from the start: a step with under 30 s left is skipped and says so; PARTS picks steps for
# a second call, e.g. PARTS="kernel fp8"):
#   tests: compiled on the GPU, kernels/mla_decode.py and kernels/mla_cache_write.py vs their
#     references (bf16 and fp8 latent caches), the tiny DeepSeek-V3 engine on the Triton backend
#     with real decode CUDA-graph capture (fp8 latent cache) and eager mixed steps vs the torch
#     engine (fp32)                                                                               150
#   graphs, eager: DeepSeek-V3's config.json with $LAYERS layers (default 4: $DENSE dense, default 1,
#     the rest MoE) and a tokenizer, no weights; one engine process per row, random FP8
#     128x128-block weights made on the GPU (--load-format dummy): bs=1 decode ms/step after a
#     $CONTEXT-token prompt (default 1024) with decode CUDA graphs (+ its bs=1 kernels under the
#     profiler: profile.md, and offline 1024/128 of $OFFLINE prompts, default 32), then eager (--enforce-eager: the same-run baseline), vs the
#     active-parameter roofline (engine.md is rewritten after each row)                       150 each
#   sweep (not in the default PARTS): the MLA decode kernel's tiles (bench/deepseek.py SWEEP_TILES) at a
#     few shapes, the best per shape (what picks kernels/mla_decode.py's default tile)            240
#   kernel: the MLA decode kernel vs the torch reference at 1k/8k/32k context, batch 1/8/64, bf16
#     and fp8 latent caches: us, latent GB/s vs the same run's copy bandwidth                       120
#     and beside it $OLD_MLA (default: tools/gpu/baselines/mla_decode_600a0db.py), the same-run baseline
#   fp8: the engine row with CUDA graphs and an fp8 latent cache                                    150
#   handoff (not in the default PARTS): a 3000-token prompt's KV pulled through the real connector
#     (bench/kv_transfer.py, the real churned layout, NIXL prepped and TCP, on this one card), as
#     DeepSeek-V3 holds it (61 layers x 576 bf16 values a token: 1098 KiB a 16-token block) and as
#     Llama-3.1-8B does (32 layers x 8 KV heads x 128 x K and V: 2048 KiB), one after the other   2 x 90
# Files in $OUT: env.txt, tests.txt, sweep.md, kernel.md, engine.md (+ engine_rows.jsonl), profile.md,
# handoff_deepseek.md, handoff_llama.md, log.txt.
set -u
LAYERS=${LAYERS:-4}
DENSE=${DENSE:-1}
CONTEXT=${CONTEXT:-1024}
OFFLINE=${OFFLINE:-32}
BUDGET=${BUDGET:-570}
PARTS=${PARTS:-tests graphs eager kernel fp8}
OLD_MLA=${OLD_MLA:-$PWD/tools/gpu/baselines/mla_decode_600a0db.py}
source tools/gpu/lib.sh
gpu_begin gpu_deepseek server triton transformers zmq pdserve.worker.engine.llm_engine pdserve.bench.deepseek || exit 1

limited() {  # limited NAME SECONDS COMMAND...: step with the limit cut to the budget left; skipped under 30 s
  local name=$1 limit=$2 left
  shift 2
  left=$(( BUDGET - ($(date +%s) - T0) ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    echo "=== $name: skipped, ${left}s of the ${BUDGET}s budget left (PARTS=... in another call)"
    return 0
  fi
  step "$name" "$limit" "$@"
}

wanted() { [[ " $PARTS " == *" $1 "* ]]; }

main() {
  if wanted tests; then
    limited "tests on the GPU" 150 $PY -m pytest -q -p no:cacheprovider -n 0 tests/kernels/test_mla_decode.py \
      tests/worker/test_triton_backend.py -k "mla or deepseek or cache_write" > "$OUT/tests.txt" 2>&1
    tail -n 5 "$OUT/tests.txt"
  fi
  cd /tmp
  CKPT=/tmp/deepseek-v3-l$LAYERS
  $PY -m pdserve.bench.deepseek checkpoint --checkpoint $CKPT --layers $LAYERS --dense-layers $DENSE
  ROWS="$OUT/engine_rows.jsonl"
  if wanted handoff; then
    # 188 blocks of 16 tokens: a 3000-token prompt (sizes in whole MiB: 202 MiB / 1098 KiB -> 188).
    for model in "deepseek 1098 202" "llama 2048 376"; do
      set -- $model
      limited "hand-off $1" 90 $PY -m pdserve.bench.kv_transfer --device cuda --ucx-tls cuda_ipc,cuda_copy,tcp \
        --block-kib $2 --sizes-mib $3 --layouts real --nixl-modes prepped --breakdown-iters 0 \
        --lease-registration-blocks 0 --out "$OUT/handoff_$1.md" 2>&1 | grep -v "NIXL INFO" | tail -n 3
    done
  fi
  for part in sweep graphs eager kernel fp8; do
    wanted $part || continue
    case $part in
      graphs) args="--profile $OUT/profile.md --offline $OFFLINE" ;;
      eager) args="--eager" ;;
      fp8) args="--kv-cache-dtype fp8" ;;
      kernel)
        limited "kernel" 120 $PY -m pdserve.bench.deepseek kernel --old "$OLD_MLA" --out "$OUT/kernel.md"
        continue ;;
      sweep)
        limited "kernel tiles" 240 $PY -m pdserve.bench.deepseek kernel --sweep --out "$OUT/sweep.md"
        continue ;;
    esac
    limited "engine $part" 150 $PY -m pdserve.bench.deepseek engine --checkpoint $CKPT --context $CONTEXT \
      --rows "$ROWS" $args 2>&1 | grep -v " INFO "
    $PY -m pdserve.bench.deepseek report --rows "$ROWS" --out "$OUT/engine.md" > /dev/null
  done
  cat "$OUT/handoff_deepseek.md" "$OUT/handoff_llama.md" "$OUT/sweep.md" "$OUT/kernel.md" "$OUT/engine.md" \
    "$OUT/profile.md" 2>/dev/null
  uptime
}
main > "$OUT/log.txt" 2>&1
grep -v " INFO " "$OUT/log.txt" | tail -n 100
