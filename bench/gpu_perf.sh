#!/usr/bin/env bash
# One device run (1x H100, <= 10 minutes) for issue 17's decode numbers. From the repo root:
#
#   run(kind="nvidia-h100-x1", carry=[".bench-structured"], command="bash bench/gpu_perf.sh")
#   (writes into $OUT, the device tool's folder; else ./gpu_perf_out)
#
# Steps, each under its own time limit so a slow one cannot starve the rest (seconds):
#   1. kernel tests compiled on the GPU (fused kernels, the fused decode merge against the
#      reduce kernel over 50 back-to-back launches, the compile-count test), then the
#      Triton-backend engine tests (greedy tokens = the torch engine's, real CUDA graphs)   100 + 60
#   2. per-kernel profile of a bs=1 decode graph, fused vs v4, both models (profile_decode)  110
#   3. engine: bs=1 decode ms/step (CUDA graphs) for both models with the same-run copy
#      bandwidth and roofline %, offline 1024/128 against its floor, and the engine's own
#      bs=1 graph on the unfused vs fused decode path, per kernel (bench.engine --decode-paths) 330
# Files in $OUT (<= 8): env.txt, tests.txt, profile_decode.md, engine.md, log.txt.
# Needs what the device image has (torch, triton, transformers, safetensors, tokenizers, pytest,
# pytest-xdist) plus the carried pyzmq and llguidance wheels: the engine bench never imports the
# server (fastapi, pydantic).
set -u
OUT=${OUT:-$PWD/gpu_perf_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# The engine needs pyzmq and llguidance, which the device image lacks: carry their wheels
# (run(..., carry=[".bench-structured"]) — see bench/structured_gpu.sh for how it is staged).
source bench/gpu_env.sh zmq:pyzmq llguidance:llguidance || exit 1
PY=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: runs, reports rc and wall time, never aborts the script
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
}

main() {
  {
    date -u
    echo "commit: ${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $PY -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '· torch', torch.__version__, '· triton', triton.__version__, '· transformers', transformers.__version__)"
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"

  # 1. Correctness on the GPU. Kernel tests in 6 processes (Triton compiles dominate); the
  #    engine tests serially (each engine sizes its KV cache from a share of the card).
  step "kernel tests (GPU)" 100 $PY -m pytest tests/kernels -q -n 6 -p no:cacheprovider > "$OUT/tests.txt" 2>&1
  tail -n 25 "$OUT/tests.txt"
  step "triton backend (GPU)" 150 $PY -m pytest -q -p no:cacheprovider tests/worker/test_triton_backend.py \
    >> "$OUT/tests.txt" 2>&1
  tail -n 15 "$OUT/tests.txt"

  # 2. Where a decode step's GPU time goes, this version against v4, in one process.
  step "profile_decode" 110 $PY -m pdserve.bench.profile_decode --models qwen2.5-0.5b llama-3.1-8b \
    --context 128 --out "$OUT/profile_decode.md"

  # 3. The engine numbers (no HF baselines, no eager rows: the time goes to what the
  #    targets need). Qwen first: it is quick, so its numbers survive a timeout of the Llama part.
  step "engine bench" 330 $PY -m pdserve.bench.engine --models qwen2.5-0.5b llama-3.1-8b \
    --decode-inputs 128 --offline 1024 --no-hf --no-eager --decode-paths --out "$OUT/engine.md"

  ls -la "$OUT"
}

main 2>&1 | tee "$OUT/log.txt"
