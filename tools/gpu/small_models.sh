#!/usr/bin/env bash
# Issue 50's small-model rows (Qwen2.5-0.5B bs=1 decode and offline 1024/128) in one device call on
# one H200, optionally after the whole GPU test suite, with async scheduling on (the default) and
# off, and an older tree beside this one (same card, same call). From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="SUITE_LIMIT_S=380 OLD_TREE=.gpu-old bash tools/gpu/small_models.sh")
#
# OLD_TREE: a folder holding another commit's worker/ kernels/ bench/ protocol/ router/ cli/
# (`git archive REV worker kernels bench protocol router cli | tar -x -C .gpu-old`; untracked, so it
# travels with the tree); its bench runs with its own defaults. BASE_TREE: another such folder of
# a commit that has --async-scheduling, run with it off: the synchronous step before and after a
# change, beside OLD_TREE, in the same call.
# 1. .ci/gpu_tests.sh with $SUITE_LIMIT_S (skipped when unset)                            ~330 s
# 2. bench/engine.py, Qwen2.5-0.5B: bs=1 at 128 tokens and offline 1024/128 (256 prompts), with
#    cProfile summaries of both, async scheduling default then off                      2 x ~50 s
# 3. the same on OLD_TREE, then BASE_TREE with async scheduling off (each when given)     ~50 s each
# Files in $OUT: suite/gpu-tests.txt, suite.log, engine-{default,off,old,base-off}.md, prof-*/, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin small_models engine || exit 1
main() {
  if [ -n "${SUITE_LIMIT_S:-}" ]; then
    GPU_TESTS_LIMIT_S=$SUITE_LIMIT_S OUT=$OUT/suite bash .ci/gpu_tests.sh > "$OUT/suite.log" 2>&1
    grep -E "passed|failed|error" "$OUT/suite.log" | tail -n 4
  fi
  cd /tmp
  local args=(--models qwen2.5-0.5b --decode-inputs 128 --offline 1024 --no-hf --no-eager)
  for mode in default off; do
    mkdir -p "$OUT/prof-$mode"
    step "0.5B, async scheduling $mode" 100 $PY -m pdserve.bench.engine "${args[@]}" --async-scheduling $mode \
      --profile-dir "$OUT/prof-$mode" --out "$OUT/engine-$mode.md" 2>&1 | grep -v " INFO "
  done
  local name tree extra farm
  for name in old base-off; do
    if [ $name = old ]; then tree=${OLD_TREE:-} extra=(); else tree=${BASE_TREE:-} extra=(--async-scheduling off); fi
    [ -n "$tree" ] || continue
    farm=/tmp/pdserve-$name
    tree_farm "$tree" $farm && mkdir -p "$OUT/prof-$name" || continue
    PYTHONPATH=$farm:$PDSERVE_DEPS step "0.5B, $tree ${extra[*]}" 100 $PY -m pdserve.bench.engine "${args[@]}" \
      "${extra[@]}" --profile-dir "$OUT/prof-$name" --out "$OUT/engine-$name.md" 2>&1 | grep -v " INFO "
  done
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep -E "^===|passed|failed|error|Error|total|qwen" "$OUT/log.txt" | tail -n 40
