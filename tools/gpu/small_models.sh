#!/usr/bin/env bash
# Issue 50's small-model rows (Qwen2.5-0.5B bs=1 decode and offline 1024/128) in one device call on
# one H200, optionally after the whole GPU test suite, with async scheduling on (the default) and
# off, and an older tree beside this one (same card, same call). From the repo root:
#
#   run(kind="nvidia-h200", carry=[".whl"], command="SUITE_LIMIT_S=380 OLD_TREE=.gpu-old bash tools/gpu/small_models.sh")
#
# OLD_TREE: a folder holding another commit's worker/ kernels/ bench/ protocol/ router/ cli/
# (`git archive REV worker kernels bench protocol router cli | tar -x -C .gpu-old`; untracked, so it
# travels with the tree); its bench runs with its own defaults.
# 1. .ci/gpu_tests.sh with $SUITE_LIMIT_S (skipped when unset)                            ~330 s
# 2. bench/engine.py, Qwen2.5-0.5B: bs=1 at 128 tokens and offline 1024/128 (256 prompts), with
#    cProfile summaries of both, async scheduling default then off                      2 x ~50 s
# 3. the same on OLD_TREE (when given)                                                    ~50 s
# Files in $OUT: suite/gpu-tests.txt, suite.log, engine-{default,off,old}.md, prof-*/, log.txt.
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
    mkdir -p "$OUT/prof-$mode" "$OUT/prof-old"
    step "0.5B, async scheduling $mode" 100 $PY -m pdserve.bench.engine "${args[@]}" --async-scheduling $mode \
      --profile-dir "$OUT/prof-$mode" --out "$OUT/engine-$mode.md" 2>&1 | grep -v " INFO "
  done
  if [ -n "${OLD_TREE:-}" ]; then
    local old=/tmp/pdserve-old d
    rm -rf $old && mkdir -p $old/pdserve
    for d in worker kernels bench protocol router cli; do ln -s "$REPO/$OLD_TREE/$d" "$old/pdserve/$d"; done
    PYTHONPATH=$old:$PDSERVE_DEPS step "0.5B, $OLD_TREE" 100 $PY -m pdserve.bench.engine "${args[@]}" \
      --profile-dir "$OUT/prof-old" --out "$OUT/engine-old.md" 2>&1 | grep -v " INFO "
  fi
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep -E "^===|passed|failed|error|Error|total|qwen" "$OUT/log.txt" | tail -n 40
