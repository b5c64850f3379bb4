#!/usr/bin/env bash
# Where a streamed NIXL pull's tail goes (issue 50: the first gap's p99 on one card is the pull's
# tail, `pdserve_kv_pull_tail_seconds`): the hand-off bench's nixl-on stack, both workers on one
# GPU at --log-level debug, then `pdserve bench pull-timeline` over the decode worker's log: per
# pull, its layered READs before and after the prefill's end (count, MiB, post and wait ms) beside
# its tail. One device call (~5 minutes, HANDOFF_BUDGET_S caps the bench):
#
#   run(carry=[".whl"], command="bash tools/gpu/nixl_tail.sh")
#
# Debug logging costs the workers little (a few lines per pull step) but is not free: read the
# bench's TTFT and gaps here against a run without it. Files in $OUT: the bench's (results.md,
# runs.tar.gz with every process's log) and pull-timeline.md.
set -u
OUT=${OUT:-$PWD/gpu_nixl_tail_out}
mkdir -p "$OUT"
HANDOFF_MIN_GPUS=${HANDOFF_MIN_GPUS:-1} HANDOFF_BUDGET_S=${HANDOFF_BUDGET_S:-220} \
  HANDOFF_WORKER_ARGS="--log-level debug ${HANDOFF_WORKER_ARGS:-}" OUT=$OUT GIT_COMMIT=${GIT_COMMIT:-} \
  bash tools/gpu/handoff.sh --stacks nixl-on --seconds "${TAIL_SECONDS:-5}" --warmup 6 "$@" | tail -n 25
rm -rf /tmp/nixl_tail_runs && mkdir -p /tmp/nixl_tail_runs \
  && tar xzf "$OUT/runs.tar.gz" -C /tmp/nixl_tail_runs || { echo "no runs.tar.gz: the bench did not run"; exit 1; }
# By path: the parser needs nothing beyond the standard library (no link farm, no repo root on the path).
python3 bench/pull_timeline.py /tmp/nixl_tail_runs | tee "$OUT/pull-timeline.md"
