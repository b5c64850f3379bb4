#!/usr/bin/env bash
# Sourced by the bench/*_gpu.sh scripts and bench/gpu_perf.sh, from the repo root, on a device
# machine: makes pdserve and the Python modules the device image lacks importable.
#
#   source bench/gpu_env.sh zmq:pyzmq llguidance:llguidance ...   # module:wheel-name pairs
#
# Each module the image lacks is installed (--no-deps, offline) from a carried wheel
# (.whl/<wheel>-*.whl or .bench-structured/<wheel>-*.whl) into $PDSERVE_DEPS, or linked from a
# carried package folder .whl/site/<module>. The worker engine itself needs pyzmq (the KV side
# channel) and llguidance (structured outputs' default grammar engine, checked at start).
# pdserve is a namespace package mapped from top-level folders: a link farm makes it importable
# without building anything (never the repo root itself: its operator/ folder would shadow the
# standard library).
PY=${PYTHON:-python3}
PDSERVE_DEPS=${PDSERVE_DEPS:-/tmp/pdserve-deps}
rm -rf "$PDSERVE_DEPS" && mkdir -p "$PDSERVE_DEPS"
# The image's own copy of a module is kept unless a carried wheel is newer (an older one can miss
# what the carried packages need: fastapi 0.165 wants starlette >= 1.6, pydantic typing_extensions
# >= 4.16); a module whose version cannot be read is taken from the wheel.
_gpu_env_keep() {  # _gpu_env_keep MODULE DIST WHEEL: 0 if the image's MODULE imports and is not older
  $PY - "$@" 2>/dev/null <<'EOF'
import importlib, importlib.metadata as md, sys
module, dist, whl = sys.argv[1:]
importlib.import_module(module)
if whl:
    from packaging.version import Version
    sys.exit(Version(md.version(dist)) < Version(whl.rsplit("/", 1)[-1].split("-")[1]))
EOF
}
GPU_ENV_WHEELS=()  # one pip call for all of them: pip's start costs a second each
for spec in "$@"; do
  module=${spec%%:*} wheel=${spec##*:}
  whl=$(ls .whl/"$wheel"-*.whl .bench-structured/"$wheel"-*.whl 2>/dev/null | head -n 1)
  _gpu_env_keep "$module" "$wheel" "$whl" && continue
  if [ -n "$whl" ]; then
    GPU_ENV_WHEELS+=("$whl")
  elif [ -d ".whl/site/$module" ]; then
    ln -s "$PWD/.whl/site/$module" "$PDSERVE_DEPS/$module"
  else
    echo "missing Python module $module: carry its wheel in .whl/ or .bench-structured/ (or the package in .whl/site/)" >&2
    return 1 2>/dev/null || exit 1
  fi
done
if [ ${#GPU_ENV_WHEELS[@]} -gt 0 ]; then
  $PY -m pip install -q --no-deps --no-index --no-compile --target "$PDSERVE_DEPS" "${GPU_ENV_WHEELS[@]}" 2>&1 \
    | grep -v "^WARNING" || true
fi
echo "gpu_env: installed from carried wheels: ${GPU_ENV_WHEELS[*]:-none}" >&2
PD=${PDSERVE_PATH:-/tmp/pdserve-path}  # one per script when several run at once
rm -rf "$PD" && mkdir -p "$PD/pdserve"
for d in worker kernels bench protocol router cli; do ln -s "$PWD/$d" "$PD/pdserve/$d"; done
export PYTHONPATH="$PD:$PDSERVE_DEPS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# The machine a GPU script ran on (its env.txt): date, commit, cards, links, versions.
gpu_env_report() {
  date -u
  echo "commit: ${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m 2>/dev/null | head -n 4
  $PY -c "import sys, torch; print('python', sys.version.split()[0], '· torch', torch.__version__, '· GPUs', torch.cuda.device_count())"
}
