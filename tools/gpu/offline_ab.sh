#!/usr/bin/env bash
# Qwen2.5-0.5B offline 1024/128 (and bs=1 at 128) on this tree against an older one, alternating, in
# one device call on one H200 (<= 4 minutes): does a change of the offline number come from the
# code or from the call? From the repo root:
#
#   git archive REV worker kernels bench protocol router cli | (mkdir -p .gpu-old && tar -x -C .gpu-old)
#   run(kind="nvidia-h200", carry=[".whl", ".gpu-old"], command="OLD_TREE=.gpu-old bash tools/gpu/offline_ab.sh")
#
# (.gitignore keeps /.gpu-* out of commits, so a tree travels only where carry names it.) A tree may also be a
# gzipped archive, unpacked on the device: `git archive -o .gpu-old.tar.gz REV worker kernels
# bench protocol` is ~0.6 MB where the folder is ~2.6 (the carry's limit is 64 MiB with .whl's
# ~50). Rounds a and b, each:
# this tree with PDL off (PDSERVE_PDL=0; NEW_PDL0=0 skips it), OLD_TREE with its defaults, this
# tree with its defaults (ROUNDS="a" for one round). OLD_TREE may name several trees
# (OLD_TREE=".gpu-old .gpu-old2": a bisect in one call), each run in turn in every round.
# Files in $OUT: engine-{new-pdl0,old[N],new}-{a,b}.md, log.txt.
set -u
source tools/gpu/lib.sh
gpu_begin offline_ab engine || exit 1
main() {
  cd /tmp
  local args=(--models qwen2.5-0.5b --decode-inputs 128 --offline 1024 --no-hf --no-eager)
  local round tree i
  local trees=($OLD_TREE)
  for i in "${!trees[@]}"; do tree_farm "${trees[$i]}" /tmp/pdserve-old$i || return 1; done
  for round in ${ROUNDS:-a b}; do
    [ "${NEW_PDL0:-1}" = 0 ] || PDSERVE_PDL=0 step "new, PDL off ($round)" 80 $PY -m pdserve.bench.engine \
      "${args[@]}" --out "$OUT/engine-new-pdl0-$round.md" 2>&1 | grep -v " INFO "
    for i in "${!trees[@]}"; do
      tree=old; [ "$i" = 0 ] || tree=old$i
      PYTHONPATH=/tmp/pdserve-old$i:$PDSERVE_DEPS step "$tree: ${trees[$i]} ($round)" 80 $PY -m pdserve.bench.engine \
        "${args[@]}" --out "$OUT/engine-$tree-$round.md" 2>&1 | grep -v " INFO "
    done
    step "new ($round)" 80 $PY -m pdserve.bench.engine "${args[@]}" --out "$OUT/engine-new-$round.md" 2>&1 \
      | grep -v " INFO "
  done
  echo "total: $(( $(date +%s) - T0 ))s"
}
main > "$OUT/log.txt" 2>&1
grep -E "^===|Error|total" "$OUT/log.txt" | tail -n 20
for f in "$OUT"/engine-*.md; do echo "## $f"; grep -E "pdserve \(|pdserve \(256" "$f"; done
