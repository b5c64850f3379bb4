#!/usr/bin/env bash
# Issue 51's "Measure" for the host KV tier (--kv-offloading-size) in one device call on one H200
# (<= 540 s): Llama-3.1-8B's shapes, random weights (--load-format dummy), no weight file written.
# From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/kv_tier.sh", timeout_s=600)
#   (writes into $OUT, the device tool's folder; else ./gpu_kv_tier_out)
#
# Steps (seconds: each one's limit, cut to what the call has left; tools/gpu/kv_tier.py has the harness):
#   config   Llama-3.1-8B-shaped config + word tokenizer, no weights                                  45
#   copy     restore bandwidth: the tier's block copies (2 MiB blocks, scattered) vs one pinned
#            host->device copy of the same 1 GiB in the same process (target >= 60%); stores vs D2H;
#            the restores beside a stand-in forward, waited for vs overlapped (the side stream)       60
#   without  one worker, device KV cache = 22% of the working set, no tier: `pdserve bench serve
#            --multi-turn 32 6 --conversation-rate 0.75 --think-time 4` (staggered chat: each turn the
#            whole history + 1024 new tokens, 128 out)                                               150
#   with     the same with --kv-offloading-size (the working set x1.25; pinning 34 GiB takes the
#            worker 50-65 s to start)                                                               220
#   peer     two workers on the card (TCP): a 2k/8k/32k-token prefix pulled from the peer vs
#            recomputed, time to first token, the crossover                                          130
#   report   kv_tier.md (TTFT p50/p90, throughput, ITL, hits per tier, bytes, TTFT per turn,
#            copies and overlap, peer pull vs recompute) and
#            kv_tier_turns.png where the image has matplotlib (else, here, from the fetched rows:
#            python tools/gpu/kv_tier.py report --rows DIR/rows.jsonl --out DIR/kv_tier.md --png DIR/kv_tier_turns.png)
# KV_TIER_ARGS: extra `serve` flags for both runs (e.g. "--conversations 24 --turns 5", or
# "--conversation-rate 0" for every conversation at once, as the first H200 run);
# PEER_ARGS: extra `peer` flags (e.g. "--transport nixl", "--prefixes 2048,8192"); PEER=0 skips it;
# SMOKE=1: the same end to end on the CPU with a tiny llama (a dry run, a few minutes).
# Files in $OUT: kv_tier.md, kv_tier_turns.png, rows.jsonl, env.txt, log.txt, runs/ (worker logs, run JSON).
set -u
source tools/gpu/lib.sh
if [ -n "${SMOKE:-}" ]; then
  gpu_begin gpu_kv_tier none || exit 1  # the CPU dry run: this checkout's own environment
else
  gpu_begin gpu_kv_tier server triton pdserve.worker.engine.llm_engine pdserve.bench.serve || exit 1
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # one card, whatever the machine has
fi
CALL_S=${CALL_S:-520}  # the whole call; each step is cut to what is left of it
H="$REPO/tools/gpu/kv_tier.py"
ROWS="$OUT/rows.jsonl"
rm -f "$ROWS"
export PY OUT

kstep() {  # kstep NAME SECONDS COMMAND...: lib.sh's step, cut to the call's time left
  local name=$1 limit=$2 left
  shift 2
  left=$(( CALL_S - ($(date +%s) - T0) - 15 ))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: skipped, ${left}s left of the call"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  step "$name" "$limit" "$@"
}

main() {
  cd /tmp  # not the repo root: its operator/ folder would shadow the standard library's
  local ckpt=/tmp/kv-tier-llama8b-cfg dev=cuda tiny="" copy=() serve=() peer=()
  if [ -n "${SMOKE:-}" ]; then
    ckpt=/tmp/kv-tier-tiny-cfg dev=cpu tiny=--tiny
    copy=(--device cpu --tiny --blocks 64 --iters 2)
    serve=(--device cpu --conversations 8 --turns 3 --message-len 32 --output-len 8 --conversation-rate 8
           --think-time 0.2)
    peer=(--device cpu --prefixes 32,64,128 --suffix 8 --reps 1 --kv-gib 0.05)
  fi
  # shellcheck disable=SC2206
  serve+=(${KV_TIER_ARGS:-})
  # shellcheck disable=SC2206
  peer+=(${PEER_ARGS:-})
  kstep "config" 45 $PY "$H" config --out $ckpt $tiny
  kstep "copy" 60 $PY "$H" copy --rows "$ROWS" "${copy[@]}"
  kstep "without the tier" 150 $PY "$H" serve --checkpoint $ckpt --rows "$ROWS" --work "$OUT/runs" "${serve[@]}"
  kstep "with the tier" 220 $PY "$H" serve --checkpoint $ckpt --rows "$ROWS" --work "$OUT/runs" --tier "${serve[@]}"
  [ "${PEER:-1}" = 0 ] || kstep "peer pull vs recompute" 130 $PY "$H" peer --checkpoint $ckpt --rows "$ROWS" \
    --work "$OUT/runs" "${peer[@]}"
  local title="one H200, Llama-3.1-8B shapes"
  [ -n "${SMOKE:-}" ] && title="CPU dry run, tiny llama"
  $PY "$H" report --rows "$ROWS" --out "$OUT/kv_tier.md" --png "$OUT/kv_tier_turns.png" --title "$title" > /dev/null
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep "^===\|^\[kv-tier\|Error\|^total" "$OUT/log.txt" | tail -n 40
cat "$OUT/kv_tier.md" 2>/dev/null
