#!/usr/bin/env bash
# FP8 weights' GPU numbers (issue 26, items 1-2) in one device call on one H100 (~6 minutes). From the repo root:
#
#   run(kind="nvidia-h100-x4", carry=[".whl"], command="bash tools/gpu/fp8.sh")
#   (writes into $OUT, the device tool's folder; else ./gpu_fp8_out)
#
# 1. The FP8 kernel tests compiled on the GPU (quantization, block GEMM, the linear method's
#    _scaled_mm and block paths against their torch references)                          90 s
# 2. bench/fp8_gemv_tune.py: fp8_gemv's tiles per Llama-3.1-8B shape (TP=1, 2), M = 1 and 8   150 s
#    (its JSON is the table kernels/fp8_gemv_configs.py holds; step 3 runs with it)
# 3. bench/fp8.py: each Llama-3.1-8B linear alone (bf16 vs the two FP8 paths, M = 1..8192), then
#    Llama-3.1-8B-shaped random weights, bf16 vs FP8 per-channel (--quantization
#    fp8) vs FP8 block-128 (a weight_scale_inv checkpoint made from the same weights), one engine
#    after another on cuda:0: bs=1 decode ms/step, offline 1024/128 tok/s, and the first token's
#    top-5 logprob error against transformers fp32 on a 2-layer model of the same widths  420 s
# Files in $OUT: env.txt, fp8.md (the tables), fp8_log.txt, tests.txt, gemv_tune.md/.json/_log.txt.
#
#   run(kind="nvidia-h100-x4", carry=[".whl"], command="bash tools/gpu/fp8.sh blockwise")   (~6 minutes)
#
# Block-128 on torch's scaled_mm (cuBLASLt 1x128 x 128x128 block scaling) against the rest, one card:
# 1. tests/kernels/test_fp8_scaled_mm.py and test_fp8.py but its GEMV tests, compiled (the grouped
#    quantization kernel, token-major scales, the block GEMM and the linear's W8A8 paths; on sm90
#    the probe and the real cuBLASLt call against the reference)                           75 s
# 2. bench/fp8.py --only blockwise speed: each Llama-3.1-8B linear at M = 64..4096: bf16 cuBLAS,
#    per-channel _scaled_mm (quantization and GEMM apart), Triton block GEMM, scaled_mm block
#    (quantization and GEMM apart; "UNSUPPORTED" and n/a if the card cannot); then engines one after
#    another: bf16, block-128 (scaled_mm from 128 rows), block-128 (Triton GEMM only), per-channel:
#    bs=1 decode ms/step and offline 64 x 1024/128 tok/s                                       265 s
# Files in $OUT: env.txt, fp8_blockwise.md (the tables), fp8_blockwise_log.txt, tests_blockwise.txt.
#
#   run(carry=[".whl"], command="bash tools/gpu/fp8.sh fused")   (~6 minutes; one card, H100 or H200)
#
# Activation quantization fused into the RMSNorm / SiLU·mul before each FP8 linear (W8A8 path, M > 16):
# 1. tests/kernels/test_fp8_fused_quant.py compiled (the fused kernels bit for bit against the separate
#    norm / SiLU·mul + quantize_fp8, the linear given their output against the linear quantizing
#    itself, cuBLASLt's block path included on sm90; ~100 kernel compiles)               120 s
# 2. bench/fp8.py --only fused: engines one after another on cuda:0: bf16, per-channel fused off,
#    on, block-128 fused off, on: bs=1 decode ms/step and offline 64 x 1024/128 tok/s          300 s
# Files in $OUT: env.txt, fp8_fused.md (the tables), fp8_fused_log.txt, tests_fused.txt.
#
#   run(carry=[".whl"], command="bash tools/gpu/fp8.sh tiles")   (~5 minutes; one card, H100 or H200)
#
# fp8_gemv's tiles on this card and what they buy a bs=1 step (TILES_JSON=path: skip 1-2, take that table):
# 1. tests/kernels/test_fp8.py's GEMV tests compiled (the split-K sum in one launch bit for bit
#    against the second launch)                                                              30 s
# 2. bench/fp8_gemv_tune.py at M = 1, Llama-3.1-8B's linears at TP=1, both scale formats, each
#    split tile also with the sum in one launch, each tile also with its first weight tile loaded
#    before the PDL wait (EARLY_W)                                                          ~150 s
# 3. bench/fp8.py --only tiles: engines one after another: bf16, then each FP8 format with the
#    rule's tiles, the measured table without one-launch sums and early weight loads, the table
#    as it is: bs=1 decode ms/step and offline 64 x 1024/128 tok/s                              ~150 s
# FORMATS=block sweeps one scale format; COMMITTED=1 lays the sweep over kernels/fp8_gemv_configs.py
# and runs each FP8 format with the committed table, then with that (5 engines instead of 7):
#   run(carry=[".whl"], command="FORMATS=block COMMITTED=1 bash tools/gpu/fp8.sh tiles")
# Files in $OUT: env.txt, tests_tiles.txt, gemv_tune.md/.json/_log.txt, fp8_tiles.md, fp8_tiles_log.txt.
#
#   run(carry=[".whl"], command="bash tools/gpu/fp8.sh batch")   (~5-6 minutes)
#
# The W8A16 GEMV at decode batches of 17-64 rows against the W8A8 GEMMs the engine runs there:
# 1. the fp8_gemv tests compiled                                                              30 s
# 2. bench/fp8_gemv_tune.py --m 64: Llama-3.1-8B's linears, both scale formats, bf16 / W8A8 / the
#    GEMV's tiles at 64 rows, in CUDA graphs                                                 ~120 s
#    (a 64-row tile is kept only where the GEMV took <= 0.9x W8A8's time; SWEEP=0: skipped, the
#    committed table alone)
# 3. bench/fp8.py --only speed --gemv-rows $GEMV_ROWS (default "16 measured"): bf16, then each FP8
#    format with the GEMV to 16 rows on every layer, then to 64 rows on the layers whose shape has a
#    64-row tile (the engine's rule; the sweep's tiles over the committed table; "64": every layer):
#    bs=1 and offline 64 x 1024/128 (whose decode steps are 64 rows)                        ~120 s
# BLOCK_TILES=1: step 1 also runs the Triton W8A8 GEMM's tests and step 2 sweeps its tiles and K splits at
# 64 rows (fp8_block_gemm for block-128, fp8_rowwise_gemm for per-channel); BLOCK_SPLIT="off on": each
# block-128 engine with K never split, then split by the rule (the default); ROWWISE="off on": each
# per-channel engine with W8A8 below 128 rows on torch._scaled_mm, then on the Triton GEMM; PROFILE=1: one
# more offline run per engine under torch.profiler (GPU time per kernel group); SWEEP=0 BLOCK_TILES=1:
# step 2 times the W8A8 tiles alone at 64 and 96 rows (no GEMV sweep: the committed table); PROLOGUE="off on":
# each FP8 engine with one-row steps' RMSNorm / SiLU·mul apart, then inside the FP8 GEMV; FORMATS=block:
# one format.
# Files in $OUT: env.txt, tests_batch.txt, gemv_tune.md/.json/_log.txt, fp8_batch.md, fp8_batch_log.txt.
set -u
MODE=${1:-all}
source tools/gpu/lib.sh
# The engine imports protocol/ (pydantic) and the KV connector's modules: carry .whl.
gpu_begin gpu_fp8 engine || exit 1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # one card, whatever the machine has

if [ "$MODE" = fused ]; then
  step_into "$OUT/tests_fused.txt" "fp8 fused-quantization tests" 120 \
    $PY -m pytest tests/kernels/test_fp8_fused_quant.py -q -p no:cacheprovider
  tail -n 3 "$OUT/tests_fused.txt"
  cd /tmp
  step_into "$OUT/fp8_fused_log.txt" "bench fp8 fused" 300 \
    $PY -m pdserve.bench.fp8 --only fused --workdir /tmp/pdserve-fp8 --out "$OUT/fp8_fused.md"
  rm -rf /tmp/pdserve-fp8
  grep -v " INFO \|it/s\]" "$OUT/fp8_fused_log.txt" | grep -i "error\|Traceback\|FAILED" | head -n 5
  cat "$OUT/fp8_fused.md" 2>/dev/null
  exit 0
fi

if [ "$MODE" = tiles ]; then
  if [ -z "${TILES_JSON:-}" ]; then
    step_into "$OUT/tests_tiles.txt" "fp8_gemv tests" 90 \
      $PY -m pytest tests/kernels/test_fp8.py -q -k gemv -p no:cacheprovider
    tail -n 3 "$OUT/tests_tiles.txt"
    (cd /tmp && step_into "$OUT/gemv_tune_log.txt" "fp8_gemv tile sweep, M = 1" 240 \
      $PY -m pdserve.bench.fp8_gemv_tune --shapes llama-3.1-8b --m 1 --formats ${FORMATS:-channel block} \
      --out "$OUT/gemv_tune.md" --json "$OUT/gemv_tune.json")
    cat "$OUT/gemv_tune.md" 2>/dev/null
    TILES_JSON=$OUT/gemv_tune.json
    [ -s "$TILES_JSON" ] || { echo "no tile table: no engines"; exit 1; }
  fi
  JSON=$(realpath "$TILES_JSON")
  cd /tmp
  step_into "$OUT/fp8_tiles_log.txt" "bench fp8 tiles" 300 \
    $PY -m pdserve.bench.fp8 --only tiles --gemv-configs "$JSON" ${COMMITTED:+--against-committed} \
    --workdir /tmp/pdserve-fp8 --out "$OUT/fp8_tiles.md"
  rm -rf /tmp/pdserve-fp8
  grep -v " INFO \|it/s\]" "$OUT/fp8_tiles_log.txt" | grep -i "error\|Traceback\|FAILED" | head -n 5
  cat "$OUT/fp8_tiles.md" 2>/dev/null
  exit 0
fi

if [ "$MODE" = batch ]; then
  step_into "$OUT/tests_batch.txt" "fp8_gemv tests" 90 \
    $PY -m pytest tests/kernels/test_fp8.py -q -p no:cacheprovider \
    -k "gemv${BLOCK_TILES:+ or block_gemm or rowwise or kernel_path or split}"
  tail -n 3 "$OUT/tests_batch.txt"
  TUNED=()
  if [ "${SWEEP:-1}" = 1 ]; then
    (cd /tmp && step_into "$OUT/gemv_tune_log.txt" "fp8_gemv tile sweep, M = 64" 200 \
      $PY -m pdserve.bench.fp8_gemv_tune --shapes llama-3.1-8b --m 64 --out "$OUT/gemv_tune.md" \
      --json "$OUT/gemv_tune.json" --formats ${FORMATS:-channel block} ${BLOCK_TILES:+--block-tiles})
    cat "$OUT/gemv_tune.md" 2>/dev/null
  fi
  if [ "${SWEEP:-1}" = 0 ] && [ -n "${BLOCK_TILES:-}" ]; then  # the W8A8 tiles alone, the committed GEMV table
    (cd /tmp && step_into "$OUT/gemv_tune_log.txt" "W8A8 tile sweep, M = 64 and 96" 150 \
      $PY -m pdserve.bench.fp8_gemv_tune --shapes llama-3.1-8b --m 64 96 --out "$OUT/w8a8_tiles.md" \
      --formats ${FORMATS:-channel block} --block-tiles --no-gemv)
    cat "$OUT/w8a8_tiles.md" 2>/dev/null
  fi
  [ -s "$OUT/gemv_tune.json" ] && TUNED=(--gemv-configs "$(realpath "$OUT/gemv_tune.json")" --against-committed)
  cd /tmp
  step_into "$OUT/fp8_batch_log.txt" "bench fp8, GEMV to 16 / 64 rows" 380 \
    $PY -m pdserve.bench.fp8 --only speed "${TUNED[@]}" --gemv-rows ${GEMV_ROWS:-16 measured} \
    ${BLOCK_SPLIT:+--block-split $BLOCK_SPLIT} ${ROWWISE:+--rowwise-triton $ROWWISE} ${PROFILE:+--profile} \
    ${PROLOGUE:+--fp8-prologue $PROLOGUE} --workdir /tmp/pdserve-fp8 --out "$OUT/fp8_batch.md"
  rm -rf /tmp/pdserve-fp8
  grep -v " INFO \|it/s\]" "$OUT/fp8_batch_log.txt" | grep -i "error\|Traceback\|FAILED" | head -n 5
  cat "$OUT/fp8_batch.md" 2>/dev/null
  exit 0
fi

if [ "$MODE" = blockwise ]; then
  step_into "$OUT/tests_blockwise.txt" "fp8 scaled_mm tests" 75 \
    $PY -m pytest tests/kernels/test_fp8_scaled_mm.py tests/kernels/test_fp8.py -q -k "not gemv" -p no:cacheprovider
  tail -n 3 "$OUT/tests_blockwise.txt"
  cd /tmp
  step_into "$OUT/fp8_blockwise_log.txt" "bench fp8 blockwise" 265 \
    $PY -m pdserve.bench.fp8 --only blockwise speed --workdir /tmp/pdserve-fp8 --out "$OUT/fp8_blockwise.md"
  rm -rf /tmp/pdserve-fp8
  grep -v " INFO \|it/s\]" "$OUT/fp8_blockwise_log.txt" | grep -i "scaled_mm\|error\|Traceback" | head -n 5
  cat "$OUT/fp8_blockwise.md" 2>/dev/null
  exit 0
fi

step_into "$OUT/tests.txt" "fp8 kernel tests" 90 $PY -m pytest tests/kernels/test_fp8.py -q -p no:cacheprovider
tail -n 3 "$OUT/tests.txt"

cd /tmp
step_into "$OUT/gemv_tune_log.txt" "fp8_gemv tile sweep" 150 \
  $PY -m pdserve.bench.fp8_gemv_tune --out "$OUT/gemv_tune.md" --json "$OUT/gemv_tune.json"
TUNED=(); [ -s "$OUT/gemv_tune.json" ] && TUNED=(--gemv-configs "$OUT/gemv_tune.json")
step_into "$OUT/fp8_log.txt" "bench fp8" 420 \
  $PY -m pdserve.bench.fp8 --workdir /tmp/pdserve-fp8 --out "$OUT/fp8.md" "${TUNED[@]}"
rm -rf /tmp/pdserve-fp8
grep -v " INFO \|it/s\]" "$OUT/fp8_log.txt" | tail -n 40
