#!/usr/bin/env bash
# Issue 25 item 3 (the small-batch GEMV) in one device call on one GPU (<= 10 minutes). From the
# repo root:
#
#   run(kind="nvidia-h100-x4", carry=[".whl"], command="bash tools/gpu/gemv.sh")
#   (writes into $OUT, the device tool's folder; else ./gpu_gemv_out)
#
# One step after another (seconds are each step's limit; a failed or timed-out step never stops
# the next, and the bench rewrites its file after every row, so a cut-off step keeps its rows):
#   shapes: per Llama-3.1-8B / Qwen2.5-0.5B projection at M = 1, 2, 4, 8: unfused (norm or
#           SiLU·mul, then cuBLAS) vs the fused GEMV, µs and % of same-run copy bandwidth, the
#           best config and the MEASURED table for kernels/fused_gemv.py (bench/gemv.py; 90
#           configs a shape, the one-launch split-K and the early weight load among them: ~45 s
#           for M = 1 on an H100 before the early-load twins doubled the sweep)                420
#   step:   the bs=1 decode step of both models, GEMV path off vs on vs on with the sweep's
#           table (same process: the new table judged beside the shipped one), against its roofline 90
# MODELS (default: Llama-3.1-8B and Qwen2.5-0.5B), ROWS (default 1 2 4 8) and STEP_MODELS narrow it,
# e.g. ROWS=1 MODELS="llama-3.1-8b qwen2.5-0.5b gpt-oss qwen3-30b-a3b" for every M = 1 shape.
#   kernel tests compiled on the GPU (tests/kernels/test_fused_gemv.py)                        30
#   the model with the path on vs off, real CUDA graphs (tests/worker/test_fused_gemv_model.py) 60
# TESTS=0 leaves both test steps out (the whole GPU suite runs them too).
# ENGINE=1 adds the engines, each table judged where it counts (the swept one laid over the shipped
# one for that run only: --gemv-table), one process after another:
#   bench/engine.py, STEP_MODELS at bs=1 (input 128, CUDA graphs): shipped table, swept table,
#   GEMV path off                                                                          3 x 110
#   MOE_LAYERS > 0 (e.g. 48 on an H200, 24 to fit an H100): bench/moe.py engine on Qwen3-30B-A3B's
#   configuration cut to that many layers (dummy weights), bs=1: shipped, swept, attention on
#   cuBLAS; MOE_ROUNDS (default 1) times over (a repeat says the noise)                   3 x 80
#   e.g. ROWS=1 MODELS="qwen2.5-0.5b llama-3.1-8b qwen3-30b-a3b gpt-oss" ENGINE=1 MOE_LAYERS=48 (~9 min
#   on an H200)
# Files in $OUT: env.txt, gemv.md, gemv_step.md, tests.txt, log.txt; with ENGINE=1 engine-*.md and
# moe_rows.jsonl / moe.md.
set -u
# Own link farm and deps folder, so this can run beside another GPU script (tools/gpu/lib.sh).
export PDSERVE_PATH=${PDSERVE_PATH:-/tmp/pdserve-path-gemv} PDSERVE_DEPS=${PDSERVE_DEPS:-/tmp/pdserve-deps-gemv}
# The model test starts an engine: protocol/ (pydantic), the KV side channel (zmq), structured
# outputs (llguidance), metrics; the same set as tools/gpu/perf.sh.
source tools/gpu/lib.sh
MODELS=${MODELS:-llama-3.1-8b qwen2.5-0.5b} ROWS=${ROWS:-1 2 4 8} STEP_MODELS=${STEP_MODELS:-llama-3.1-8b qwen2.5-0.5b}
gpu_begin gpu_gemv engine || echo "gpu_deps: some modules missing; going on"
main() {
  local repo=$PWD
  cd /tmp
  # shellcheck disable=SC2086  # word lists
  step "gemv shapes" 420 $PY -m pdserve.bench.gemv --models $MODELS --rows $ROWS --out "$OUT/gemv.md"
  local table=(); grep -q "MEASURED for kernels" "$OUT/gemv.md" 2>/dev/null && table=(--table "$OUT/gemv.md")
  # shellcheck disable=SC2086
  step "gemv step" 90 $PY -m pdserve.bench.gemv --step --models $STEP_MODELS "${table[@]}" --out "$OUT/gemv_step.md"
  cd "$repo"
  if [ "${TESTS:-1}" = 1 ]; then
    local xdist; xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n 4")  # parallel compiles where it exists
    step "kernel tests" 30 $PY -m pytest tests/kernels/test_fused_gemv.py -q -x $xdist -p no:cacheprovider > "$OUT/tests.txt" 2>&1
    step "model test" 60 $PY -m pytest tests/worker/test_fused_gemv_model.py -q -x -p no:cacheprovider >> "$OUT/tests.txt" 2>&1
    tail -n 5 "$OUT/tests.txt"
  fi
  [ "${ENGINE:-0}" = 1 ] && engines "${table[@]}"
  ls -la "$OUT"
}
engines() {  # engines [--table FILE]: the engine rows with the shipped table, the swept one (if any), none
  local swept=(); [ $# = 2 ] && swept=(--gemv-table "$2")
  cd /tmp
  local args=(--decode-inputs 128 --offline --no-hf --no-eager)
  # shellcheck disable=SC2086
  step "engine, shipped table" 110 $PY -m pdserve.bench.engine --models $STEP_MODELS "${args[@]}" --out "$OUT/engine-shipped.md"
  # shellcheck disable=SC2086
  [ ${#swept[@]} = 2 ] && step "engine, swept table" 110 $PY -m pdserve.bench.engine --models $STEP_MODELS "${args[@]}" \
    "${swept[@]}" --out "$OUT/engine-swept.md"
  # shellcheck disable=SC2086
  step "engine, GEMV path off" 110 $PY -m pdserve.bench.engine --models $STEP_MODELS "${args[@]}" --fused-gemv off \
    --out "$OUT/engine-off.md"
  local layers=${MOE_LAYERS:-0} ckpt=/tmp/qwen3-30b-a3b-l${MOE_LAYERS:-0}
  [ "$layers" -gt 0 ] || return 0
  step "moe checkpoint" 20 $PY -m pdserve.bench.moe checkpoint --checkpoint $ckpt --layers $layers --config-only
  local common=(--checkpoint $ckpt --layers $layers --load-format dummy --num-prompts 0 --rows "$OUT/moe_rows.jsonl")
  for round in $(seq 1 "${MOE_ROUNDS:-1}"); do
    step "moe, shipped table, round $round" 80 $PY -m pdserve.bench.moe engine "${common[@]}"
    [ ${#swept[@]} = 2 ] && step "moe, swept table, round $round" 80 $PY -m pdserve.bench.moe engine "${common[@]}" "${swept[@]}"
    step "moe, attention on cuBLAS, round $round" 80 $PY -m pdserve.bench.moe engine "${common[@]}" --no-fused-gemv
  done
  $PY -m pdserve.bench.moe report --rows "$OUT/moe_rows.jsonl" --out "$OUT/moe.md"
}
main > "$OUT/log.txt" 2>&1
grep -v "^|" "$OUT/log.txt" | tail -n 30
cat "$OUT/gemv.md" "$OUT/gemv_step.md" 2>/dev/null
for f in "$OUT"/engine-*.md; do [ -f "$f" ] && echo "== $f" && grep -E "bs=1" "$f"; done
[ -f "$OUT/moe.md" ] && grep "^|" "$OUT/moe.md"
true
