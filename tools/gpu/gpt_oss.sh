#!/usr/bin/env bash
# Issue 46's "Measure" (gpt-oss) in one device call on one H200 (~8 minutes), no checkpoint written:
# every model is random weights of the published config's shapes and formats (--load-format dummy).
# From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="bash tools/gpu/gpt_oss.sh", timeout_s=600)
#   (writes into $OUT, the device tool's folder; else ./gpu_gpt_oss_out)
#
# Steps, most wanted first (seconds: each one's limit, cut to what the call has left; a failed or
# timed-out step is recorded and the next one runs; tools/gpu/gpt_oss.py has the harness):
#   a. gpt-oss-120b, MXFP4 experts: bs=1 decode ms/step vs the active-parameter roofline (attention,
#      router, 4 experts per layer, lm_head bytes / the same run's copy bandwidth; target >= 50%),
#      offline 1024/128 output tok/s ($PROMPTS_120B prompts, default 32)                         150
#   c. gpt-oss-20b, MXFP4 experts: the same                                                        90
#   b. bench/moe.py's MXFP4 vs bf16 MoE op rows at 1/8/64/512 tokens (gpt-oss-120b's layer shape),
#      if this tree's bench/moe.py has the subcommand (else skipped, said in the log)               60
#   c. gpt-oss-20b: one aggregated worker, then 1 prefill + 1 decode sharing the card (`pdserve up`,
#      NIXL where it imports, else TCP), 1 req/s of 3000/200 for $PD_SECONDS s (default 25):
#      TTFT, steady ITL, first gap after the first token                                          220
#   d. gpt-oss-20b KV capacity at 32k-token prompts in 8 GiB of KV memory, window-aware release on
#      and off (where this tree has --disable-hybrid-kv-cache-manager; else one mode, said)        110
# ONLY="a c": only the steps of those letters (the configs step always runs). Step a also writes
# profile_120b.md: one bs=1 decode step's kernels by GPU time (torch.profiler, bench/engine.py's table).
# Files in $OUT: gpt_oss.md (the tables, the card and date), gpt_oss.json (every row, every step's
# rc and seconds), rows.jsonl, steps.jsonl, env.txt, log.txt, moe_mxfp4.md, pd/ (stack logs, runs).
set -u
source tools/gpu/lib.sh
gpu_begin gpu_gpt_oss server triton transformers pdserve.worker.engine.llm_engine pdserve.bench.serve \
  pdserve.router.app || exit 1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # one card, whatever the machine has
CALL_S=${CALL_S:-480}  # the whole call's target; each step is cut to what is left of it
H="$REPO/tools/gpu/gpt_oss.py"
ROWS="$OUT/rows.jsonl" STEPS="$OUT/steps.jsonl"
rm -f "$ROWS" "$STEPS"

gstep() {  # gstep NAME SECONDS COMMAND...: lib.sh's step, cut to the call's time left, its rc and time recorded
  local name=$1 limit=$2 t0 rc left
  shift 2
  if [ -n "${ONLY:-}" ] && [[ "$name" =~ ^([a-z])\. ]] && [[ " $ONLY " != *" ${BASH_REMATCH[1]} "* ]]; then
    echo "=== $name: not in ONLY=$ONLY"
    return 0
  fi
  left=$(( CALL_S - ($(date +%s) - T0) - 15 ))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: skipped, ${left}s left of the call"
    echo "{\"step\": \"$name\", \"rc\": \"skipped\", \"seconds\": 0}" >> "$STEPS"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@"
  rc=$?  # 124/137: cut at its limit
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$STEPS"
  return 0
}

moe_mxfp4() {  # bench/moe.py's MXFP4 rows, at gpt-oss-120b's layer shape where it takes one
  if ! $PY -m pdserve.bench.moe --help 2>/dev/null | grep -q mxfp4; then
    echo "skipped: this tree's bench/moe.py has no mxfp4 subcommand (the MXFP4 fused MoE op is not merged)"
    return 3
  fi
  local help flags=()
  help=$($PY -m pdserve.bench.moe mxfp4 --help 2>&1)
  grep -q -- "--tokens" <<< "$help" && flags+=(--tokens 1 8 64 512)
  grep -q -- "--hidden" <<< "$help" && flags+=(--hidden 2880 --inter 2880 --experts 128 --top-k 4)
  $PY -m pdserve.bench.moe mxfp4 "${flags[@]}" --out "$OUT/moe_mxfp4.md"
}
export -f moe_mxfp4  # run by `timeout` through bash -c
export PY OUT

main() {
  cd /tmp  # not the repo root: its operator/ folder would shadow the standard library's
  local c120=/tmp/gpt-oss-120b-cfg c20=/tmp/gpt-oss-20b-cfg
  gstep "configs (published shapes, no weights)" 60 bash -c \
    "$PY $H config --size 120b --out $c120 && $PY $H config --size 20b --out $c20"
  gstep "a. 120b mxfp4 engine" 150 $PY "$H" engine --checkpoint $c120 --name gpt-oss-120b --rows "$ROWS" \
    --num-prompts "${PROMPTS_120B:-32}" --profile "$OUT/profile_120b.md"
  gstep "c. 20b mxfp4 engine" 90 $PY "$H" engine --checkpoint $c20 --name gpt-oss-20b --rows "$ROWS" \
    --num-prompts "${PROMPTS_20B:-64}"
  gstep "b. MoE op, MXFP4 vs bf16" 60 bash -c moe_mxfp4
  gstep "c. 20b 1P1D on one card vs aggregated" 220 $PY "$H" pd --checkpoint $c20 --name gpt-oss-20b \
    --rows "$ROWS" --work "$OUT/pd" --seconds "${PD_SECONDS:-25}"
  gstep "d. 20b KV capacity at 32k" 110 $PY "$H" capacity --checkpoint $c20 --name gpt-oss-20b --rows "$ROWS" \
    --prompt-len 32768 --kv-gib 8 --requests 14 --timeout 40
  $PY "$H" report --rows "$ROWS" --steps "$STEPS" --out "$OUT/gpt_oss.md" --json "$OUT/gpt_oss.json" > /dev/null
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep "^===\|^\[gpt-oss\|^skipped\|Error\|^total" "$OUT/log.txt" | tail -n 60
cat "$OUT/gpt_oss.md" "$OUT/moe_mxfp4.md" "$OUT/profile_120b.md" 2>/dev/null
