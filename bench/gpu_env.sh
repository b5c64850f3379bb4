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
for spec in "$@"; do
  module=${spec%%:*} wheel=${spec##*:}
  $PY -c "import $module" 2>/dev/null && continue
  whl=$(ls .whl/"$wheel"-*.whl .bench-structured/"$wheel"-*.whl 2>/dev/null | head -n 1)
  if [ -n "$whl" ]; then
    $PY -m pip install -q --no-deps --no-index --target "$PDSERVE_DEPS" "$whl" 2>&1 | grep -v "^WARNING" || true
  elif [ -d ".whl/site/$module" ]; then
    ln -s "$PWD/.whl/site/$module" "$PDSERVE_DEPS/$module"
  else
    echo "missing Python module $module: carry its wheel in .whl/ or .bench-structured/ (or the package in .whl/site/)" >&2
    return 1 2>/dev/null || exit 1
  fi
done
PD=/tmp/pdserve-path
rm -rf "$PD" && mkdir -p "$PD/pdserve"
for d in worker kernels bench protocol router cli; do ln -s "$PWD/$d" "$PD/pdserve/$d"; done
export PYTHONPATH="$PD:$PDSERVE_DEPS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
