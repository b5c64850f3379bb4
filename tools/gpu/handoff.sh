#!/usr/bin/env bash
# Issue 24's hand-off measurement in one device call on a 2-GPU machine (<= 10 minutes). From the
# repo root, with .whl/ rebuilt (the wheels below; git-ignored, so carried):
#
#   run(command="GIT_COMMIT=<sha> bash tools/gpu/handoff.sh", kind="nvidia-h100-x2", carry=[".whl"], timeout_s=600)
#
# (GIT_COMMIT: name the tree in the reports; a device machine's copy of .git has been seen older than
# the tree it runs.)
# Runs bench/handoff.py (its docstring has the plan): aggregated vs P/D 1+1 over NIXL and TCP,
# overlap off and on, 3000/200 at 1 and 6 req/s, the 1k-16k prompt-length sweep, the stall model.
# Extra arguments go to bench/handoff.py (e.g. --chunk-tokens 256, --stacks agg,nixl-off,nixl-on).
# The harness gets what the 600 s call has left after the setup here (~20 s), less 50 s for the last
# stack's stop, the report and a margin (~530 s; HANDOFF_BUDGET_S=N caps it). The workers run random
# weights made on their GPUs (--load-format dummy): no checkpoint is written.
# Files in $OUT (else ./gpu_handoff_out): results.md, summary.json, first_gap_vs_prompt.png (where
# the image has matplotlib; else `python -m pdserve.bench.handoff --replot DIR` here draws it),
# runs.tar.gz (every run's JSON with per-request gaps, every stack's logs), env.txt, log.txt.
set -u
source tools/gpu/lib.sh
# What the worker, the router and the load generator import that the image may lack.
gpu_begin gpu_handoff server triton transformers nixl_cu13 pdserve.router.app pdserve.bench.serve \
  pdserve.worker.server.app || exit 1
GPUS=$(sed -n 's/^imports: ok · GPUs //p' "$OUT/env.txt")
# (HANDOFF_MIN_GPUS=0 ... --smoke runs this script end to end on a CPU machine.)
[ "${GPUS:-0}" -ge "${HANDOFF_MIN_GPUS:-2}" ] || { echo "needs 2 GPUs, sees ${GPUS:-0}: stopping"; exit 1; }
echo "setup: $(( $(date +%s) - T0 ))s"
set -o pipefail
cd /tmp
# The call may run 600 s: what the setup left, less the last stack's stop and the report (~25 s)
# and a margin; HANDOFF_BUDGET_S lowers it. SIGTERM at the hard limit: the harness stops its
# stack and writes the report so far (runs.tar.gz too).
LEFT=$(( 590 - ($(date +%s) - T0) ))
BUDGET=$(( LEFT - 40 ))
[ -n "${HANDOFF_BUDGET_S:-}" ] && [ "$HANDOFF_BUDGET_S" -lt "$BUDGET" ] && BUDGET=$HANDOFF_BUDGET_S
echo "harness budget: ${BUDGET}s (hard limit $(( BUDGET + 30 ))s)"
# The checkpoint is config.json and the tokenizer only: every worker makes its random weights on
# its GPU (--load-format dummy; equal on every worker: one seed), so no 16 GB is written. Kept: a
# second run of this script in the same call reuses it. More worker flags: HANDOFF_WORKER_ARGS
# (a --worker-args among the arguments would replace --load-format dummy).
CKPT=/tmp/handoff_cfg
WORKER_ARGS="--load-format dummy ${HANDOFF_WORKER_ARGS:-}"
[ -f "$CKPT/tokenizer.json" ] || $PY -m pdserve.bench.disagg --out /tmp/handoff_ck_out --make-checkpoint "$CKPT" \
  --config-only > "$OUT/checkpoint.log" 2>&1 || { tail -n 30 "$OUT/checkpoint.log"; exit 1; }
if [ -z "${HANDOFF_CHUNKS:-}" ]; then
  timeout --kill-after=8 "$(( BUDGET + 30 ))" $PY -m pdserve.bench.handoff --out "$OUT" --budget-s "$BUDGET" \
    --checkpoint "$CKPT" --worker-args="$WORKER_ARGS" "$@" > "$OUT/log.txt" 2>&1
  echo "bench handoff: rc=$? in $(( $(date +%s) - T0 ))s (setup included)"
  grep "^\[handoff" "$OUT/log.txt" | tail -n 40
  cat "$OUT/results.md" 2>/dev/null || tail -n 60 "$OUT/log.txt"
  ls -la "$OUT"
  exit 0
fi
# HANDOFF_CHUNKS="512 256 128": the aggregated baseline and overlap on with the first size, then
# overlap on again with each other size (one config-only checkpoint; the budget split evenly,
# the first run's share doubled for its aggregated stack). Each size's report in $OUT/chunk<N>/.
EXTRA=("$@")  # bench/handoff.py's own flags (e.g. --warmup 24), for every size's run
set -- $HANDOFF_CHUNKS
N=$#
# HANDOFF_PROFILE=1 (with .whl/py_spy-*.whl carried): every process of each stack (router, workers,
# load generator) sampled by py-spy (--subprocesses: they are its descendants, so no ptrace rights
# beyond the image's are needed), idle threads included, as collapsed stacks (one line per
# process;thread;frames and its sample count) in chunk<N>/profile.txt. Sampling slows the stack:
# read its timings only against a run without it. HANDOFF_PROFILE=gil: only the thread holding each
# process's GIL is sampled (py-spy --gil, 250 Hz): who takes the GIL the engine's step thread needs.
PROF=()
if [ "${HANDOFF_PROFILE:-0}" != 0 ]; then
  $PY -m pip install -q --no-deps --target /tmp/pyspy "$REPO"/.whl/py_spy-*.whl > /dev/null 2>&1 \
    && /tmp/pyspy/bin/py-spy record --nonblocking --duration 1 -o /tmp/pyspy_probe.txt --format raw -- $PY -c "import time; time.sleep(1.5)" \
    > /dev/null 2>&1 && PROF=(/tmp/pyspy/bin/py-spy record --subprocesses --idle --threads --nonblocking --rate 100 --format raw -o)
  [ "$HANDOFF_PROFILE" = gil ] && [ ${#PROF[@]} -gt 0 ] \
    && PROF=(/tmp/pyspy/bin/py-spy record --subprocesses --gil --threads --nonblocking --rate 250 --format raw -o)
  [ ${#PROF[@]} -gt 0 ] && echo "profiling with py-spy" || echo "HANDOFF_PROFILE: py-spy did not install or cannot sample here: not profiling"
fi
first=1
for c in "$@"; do
  LEFT=$(( 590 - ($(date +%s) - T0) - 30 ))
  [ -n "${HANDOFF_BUDGET_S:-}" ] && LEFT=$(( HANDOFF_BUDGET_S - ($(date +%s) - T0) ))
  SHARE=$(( LEFT / N )); [ "$first" = 1 ] && SHARE=$(( 2 * LEFT / (N + 1) ))
  STACKS=nixl-on; [ "$first" = 1 ] && STACKS=${HANDOFF_FIRST_STACKS:-agg,nixl-on}
  mkdir -p "$OUT/chunk$c"
  timeout --kill-after=8 "$(( SHARE + 20 ))" ${PROF[@]:+"${PROF[@]}" "$OUT/chunk$c/profile.txt" --} $PY -m pdserve.bench.handoff --out "$OUT/chunk$c" --budget-s "$SHARE" \
    --chunk-tokens "$c" --stacks "$STACKS" --checkpoint "$CKPT" --worker-args="$WORKER_ARGS" \
    "${EXTRA[@]}" > "$OUT/chunk$c/log.txt" 2>&1
  echo "bench handoff chunk $c ($STACKS): rc=$? at $(( $(date +%s) - T0 ))s"
  grep "^\[handoff" "$OUT/chunk$c/log.txt" | tail -n 12
  first=0; N=$(( N - 1 ))
done
for c in $HANDOFF_CHUNKS; do sed -n '/^## 3000 in/,/^## Stall/p' "$OUT/chunk$c/results.md" 2>/dev/null; done
