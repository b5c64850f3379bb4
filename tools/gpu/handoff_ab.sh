#!/usr/bin/env bash
# A/B of the hand-off in one device call: an earlier tree against this one, one `tcp-on` stack
# (AB_STACKS: another, e.g. nixl-on) per (tree, split), each a run of tools/gpu/handoff.sh;
# AB_FIRST_STACKS: the first run's stacks instead (e.g. agg,nixl-on: the aggregated baseline
# once). Before the call, here:
#
#   mkdir -p .whl/base && git archive <base-sha> | tar -x -C .whl/base
#   run(command="B1=220 B2=135 bash tools/gpu/handoff_ab.sh base-tail new-auto", carry=[".whl"], ...)
#
# Runs (in the order given): base-tail, base-taper, base-auto (the earlier tree), new-tail,
# new-taper, new-taper256, new-auto, new-none, new-io-process (this tree; none: no streamed
# split, the step budget's chunks only; io-process: --kv-tcp-io process). B1: the first run's budget in seconds (it also writes the
# checkpoint), B2: each later run's; AB_EXTRA: more bench/handoff.py flags (--tcp-high-rate);
# HANDOFF_MIN_GPUS=1 runs both workers on one GPU; AB_PROFILE=<run name> samples that run with py-spy. Each run's report lands in /tmp/ab/<run>/, all
# of them in $OUT/ab.tar.gz (rewritten after each run: a call cut short keeps what ran).
set -u
OUT=${OUT:-$PWD/gpu_handoff_ab_out}
mkdir -p "$OUT" /tmp/ab
handoff_script() {  # in the tree run() is in: a tree from before tools/gpu/ has it in bench/
  if [ -f tools/gpu/handoff.sh ]; then echo tools/gpu/handoff.sh; else echo tools/gpu/handoff.sh; fi
}
run() {  # name dir worker-args [chunk tokens]
  local name=$1$SUFFIX dir=$2 args=$3 chunk=${4:-512}
  local profile=0; [ "$name" = "${AB_PROFILE:-}" ] && profile=${AB_PROFILE_MODE:-1}  # AB_PROFILE=<run>: that run under py-spy (AB_PROFILE_MODE=gil: GIL holders only)
  (cd "$dir" && GIT_COMMIT=$name OUT=/tmp/ab/$name HANDOFF_CHUNKS=$chunk HANDOFF_FIRST_STACKS=$STACKS HANDOFF_PROFILE=$profile \
     HANDOFF_BUDGET_S=$B HANDOFF_WORKER_ARGS="$args" bash "$(handoff_script)" --warmup 24 ${AB_EXTRA:-} \
     > /tmp/ab/$name.out 2>&1)
  echo "== $name: $(grep -h '^\[handoff' /tmp/ab/$name/chunk$chunk/log.txt | grep 'first gap' \
     | sed 's/^\[handoff *[0-9]*s\] //' | tr '\n' ';')"
}
[ -d .whl/base ] && (cd .whl/base && ln -sfn .. .whl)  # the earlier tree installs the same carried wheels
B=${B1:-220}
STACKS=${AB_FIRST_STACKS:-${AB_STACKS:-tcp-on}}
for spec in "$@"; do
  what=${spec%%:*}  # new-auto:nixl-on runs new-auto on that stack (its report in /tmp/ab/new-auto-nixl-on)
  if [ "$what" != "$spec" ]; then STACKS=${spec#*:}; SUFFIX=-$STACKS; else SUFFIX=; fi
  case $what in
    base-tail) run base-tail .whl/base "--kv-stream-split tail" ;;
    base-taper) run base-taper .whl/base "--kv-stream-split taper" ;;
    base-auto) run base-auto .whl/base "" ;;
    new-tail) run new-tail . "--kv-stream-split tail" ;;
    new-taper) run new-taper . "--kv-stream-split taper" ;;
    new-taper256) run new-taper256 . "--kv-stream-split taper" 256 ;;
    new-auto) run new-auto . "" ;;
    new-none) run new-none . "" 0 ;;
    new-io-process) run new-io-process . "--kv-tcp-io process" ;;  # TCP's data connections in children
    *) echo "unknown run: $what"; exit 2 ;;
  esac
  B=${B2:-135}
  STACKS=${AB_STACKS:-tcp-on}
  (cd /tmp/ab && tar czf "$OUT/ab.tar.gz" --exclude='*.png' .)
done
ls -la "$OUT"
