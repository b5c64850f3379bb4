#!/usr/bin/env bash
# Issue 49's migration measurement on one GPU, in one device call (<= 540 s). From the repo root,
# with .whl/ rebuilt (lib.sh's SERVER_DEPS wheels; git-ignored, so carried):
#
#   run(command="GIT_COMMIT=<sha> bash tools/gpu/migration.sh", kind="nvidia-h200", carry=[".whl"], timeout_s=600)
#
# bench/migration.py (its docstring has the plan) on Llama-3.1-8B shapes with random weights made
# on the card (--load-format dummy: config and word tokenizer only, nothing written): a router, one
# prefill and two decode workers sharing the card (0.30 of its memory each, as `pdserve up` splits
# it), 3000-token prompts, 200 out, a closed loop of MIGRATION_CONCURRENCY (16) streams; the decode
# worker serving a chosen stream is SIGKILLed and replaced until MIGRATION_HITS (40) streams were
# hit or the budget ends. Reported: failed requests, answers equal to their twins (every stream
# hit and 40 others, re-run on the prefill worker, never killed), the client-visible gap at each
# migration p50/p99/max against the re-prefill of prompt + generated tokens, the router's
# migration metrics. Random weights give near-flat logits: bf16 greedy ties may break differently in
# another batch shape, so an unequal answer here is read against the CPU run's exactness.
# Files in $OUT (else ./gpu_migration_out): results.md, summary.json, gaps.png, logs/, env.txt, log.txt.
# (MIGRATION_MIN_GPUS=0 MIGRATION_SMOKE=1 runs this script's path on a CPU machine with a tiny model.)
set -u
source tools/gpu/lib.sh
gpu_begin gpu_migration server triton transformers pdserve.router.app pdserve.worker.server.app \
  pdserve.bench.migration || exit 1
GPUS=$(sed -n 's/^imports: ok · GPUs //p' "$OUT/env.txt")
[ "${GPUS:-0}" -ge "${MIGRATION_MIN_GPUS:-1}" ] || { echo "needs a GPU, sees ${GPUS:-0}: stopping"; exit 1; }
echo "setup: $(( $(date +%s) - T0 ))s"
cd /tmp
# The whole call: 540 s; the harness gets what the setup left less 20 s (its own stop of the
# workers and the report are inside its --deadline-s; kills end --reserve-s before it).
DEADLINE=$(( ${MIGRATION_CALL_S:-540} - ($(date +%s) - T0) - 20 ))
if [ "${MIGRATION_SMOKE:-0}" = 1 ]; then
  CKPT=/tmp/migration_tiny
  SHAPE=(--shape tiny) SIZES=(--prompt-tokens 48 --max-tokens 48 --max-model-len 512 --device cpu --kv-transfer tcp)
  WORKER_ARGS=""
else
  CKPT=/tmp/migration_cfg
  SHAPE=(--shape llama-3.1-8b --config-only)
  SIZES=(--prompt-tokens 3000 --max-tokens 200 --max-model-len 3300 --device cuda)
  WORKER_ARGS="--load-format dummy ${MIGRATION_WORKER_ARGS:-}"
fi
[ -f "$CKPT/tokenizer.json" ] || $PY -m pdserve.bench.migration --make-checkpoint "$CKPT" "${SHAPE[@]}" \
  > "$OUT/checkpoint.log" 2>&1 || { tail -n 30 "$OUT/checkpoint.log"; exit 1; }
echo "harness deadline: ${DEADLINE}s"
timeout --kill-after=8 "$(( DEADLINE + 10 ))" $PY -m pdserve.bench.migration --out "$OUT" --checkpoint "$CKPT" \
  --prefill 1 --decode 2 "${SIZES[@]}" --worker-args="$WORKER_ARGS" \
  --hits "${MIGRATION_HITS:-40}" --concurrency "${MIGRATION_CONCURRENCY:-16}" --twins 40 \
  --deadline-s "$DEADLINE" --reserve-s "${MIGRATION_RESERVE_S:-90}" --ready-timeout-s 240 \
  --machine "${MIGRATION_MACHINE:-one H200, the prefill and both decode workers on it}" "$@" > "$OUT/log.txt" 2>&1
echo "bench migration: rc=$? in $(( $(date +%s) - T0 ))s (setup included)"
grep "^\[migration" "$OUT/log.txt" | tail -n 30
cat "$OUT/results.md" 2>/dev/null || tail -n 60 "$OUT/log.txt"
ls -la "$OUT"
