#!/usr/bin/env bash
# Qwen2.5-0.5B offline 1024/128 (and bs=1 at 128) on this tree against an older one, alternating, in
# one device call on one H200 (<= 4 minutes): does a change of the offline number come from the
# code or from the call? From the repo root:
#
#   git archive REV worker kernels bench protocol router cli | (mkdir -p .gpu-old && tar -x -C .gpu-old)
#   run(kind="nvidia-h200", carry=[".whl"], command="OLD_TREE=.gpu-old bash tools/gpu/offline_ab.sh")
#
# (.gpu-old is untracked, so it travels with the tree; never commit it.) Rounds a and b, each:
# this tree with PDL off (PDSERVE_PDL=0), OLD_TREE with its defaults, this tree with its defaults
# (ROUNDS="a" for one round).
# Files in $OUT: engine-{new-pdl0,old,new}-{a,b}.md, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin offline_ab engine || exit 1
main() {
  cd /tmp
  local args=(--models qwen2.5-0.5b --decode-inputs 128 --offline 1024 --no-hf --no-eager)
  local farm=/tmp/pdserve-old d round
  rm -rf $farm && mkdir -p $farm/pdserve
  for d in worker kernels bench protocol router cli; do ln -s "$REPO/$OLD_TREE/$d" "$farm/pdserve/$d"; done
  for round in ${ROUNDS:-a b}; do
    PDSERVE_PDL=0 step "new, PDL off ($round)" 80 $PY -m pdserve.bench.engine "${args[@]}" \
      --out "$OUT/engine-new-pdl0-$round.md" 2>&1 | grep -v " INFO "
    PYTHONPATH=$farm:$PDSERVE_DEPS step "old ($round)" 80 $PY -m pdserve.bench.engine "${args[@]}" \
      --out "$OUT/engine-old-$round.md" 2>&1 | grep -v " INFO "
    step "new ($round)" 80 $PY -m pdserve.bench.engine "${args[@]}" --out "$OUT/engine-new-$round.md" 2>&1 \
      | grep -v " INFO "
  done
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep -E "^===|Error|total" "$OUT/log.txt" | tail -n 20
for f in "$OUT"/engine-*.md; do echo "## $f"; grep -E "pdserve \(|pdserve \(256" "$f"; done
