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
#   the model with the path on vs off, real CUDA graphs (tests/worker/test_fused_gemv_model.py) 25
# Files in $OUT: env.txt, gemv.md, gemv_step.md, tests.txt, log.txt.
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
  local xdist; xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n 4")  # parallel compiles where it exists
  step "kernel tests" 30 $PY -m pytest tests/kernels/test_fused_gemv.py -q -x $xdist -p no:cacheprovider > "$OUT/tests.txt" 2>&1
  step "model test" 60 $PY -m pytest tests/worker/test_fused_gemv_model.py -q -x -p no:cacheprovider >> "$OUT/tests.txt" 2>&1
  tail -n 5 "$OUT/tests.txt"
  ls -la "$OUT"
}
main > "$OUT/log.txt" 2>&1
grep -v "^|" "$OUT/log.txt" | tail -n 30
cat "$OUT/gemv.md" "$OUT/gemv_step.md" 2>/dev/null
