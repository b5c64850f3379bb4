#!/usr/bin/env bash
# One device run of bench/structured.py (1x H100, ~5 minutes). From the repo root, after staging
# the wheels and SmolLM2's tokenizer here (the device machine reaches no index):
#
#   mkdir -p .bench-structured/smollm2 && echo /.bench-structured/ >> .git/info/exclude
#   pip download --no-deps -d .bench-structured llguidance xgrammar apache-tvm-ffi pydantic \
#       pydantic-core annotated-types typing-inspection
#   cp ~/.cache/pdserve/models/SmolLM2-135M-Instruct/{tokenizer.json,tokenizer_config.json,config.json} \
#       .bench-structured/smollm2/
#   then, on the device:  bash tools/gpu/structured.sh     (carry: [".bench-structured"])
#
# Writes $OUT/structured.md (else ./structured_out). Wheels that do not fit the device's Python
# are skipped; the bench skips an engine that does not import. Only torch, triton and
# transformers are needed besides: the bench never imports the server.
set -u
# pdserve importable; the wheels are installed below, each tried on its own, since which engines
# fit the device's Python is part of what this run reports.
source tools/gpu/lib.sh
gpu_begin structured none || exit 1
for w in .bench-structured/*.whl; do $PY -m pip install -q --no-deps --no-index "$w" 2>&1 | tail -1 || true; done \
  | tee -a "$OUT/env.txt"
timeout --kill-after=10 540 $PY -m pdserve.bench.structured --device cuda --tokenizer .bench-structured/smollm2 \
  --batch 1 8 32 --out "$OUT/structured.md" "$@" 2>&1 | grep -v Warning | tee "$OUT/log.txt"
