#!/usr/bin/env bash
# Issue 52's tracing overhead on one GPU, in one device call (<= 10 minutes). From the repo root,
# with .whl/ holding the server wheels (lib.sh's SERVER_DEPS) and the tracing ones below:
#
#   pip download --no-deps -d .whl opentelemetry-sdk opentelemetry-semantic-conventions \
#     opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common \
#     opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common opentelemetry-proto \
#     protobuf googleapis-common-protos requests urllib3 charset-normalizer
#   run(kind="nvidia-h200", carry=[".whl"], command="GIT_COMMIT=<sha> bash tools/gpu/tracing.sh")
#
# Runs tools/tracing_overhead.py (its docstring has the plan): two `pdserve up` stacks on the one
# card (1 prefill + 1 decode worker and the router each; every worker --gpu-memory-utilization
# 0.2, so four fit), Llama-3.1-8B-shaped random bf16 weights made on the GPU (--load-format dummy:
# bench/disagg.py's config-only checkpoint, nothing written), tracing off against on (sampling
# 1.0, OTLP/HTTP to a real receiver in its own process), alternating pairs of closed-loop runs,
# 1024 in / 128 out at concurrency 16. Extra arguments go to the harness (e.g. --pairs 4, --control).
# Files in $OUT (else ./gpu_tracing_out): results.md, runs.json, env.txt, log.txt.
set -u
source tools/gpu/lib.sh
TRACING_DEPS=(opentelemetry.sdk:opentelemetry_sdk opentelemetry.semconv:opentelemetry_semantic_conventions
  opentelemetry.exporter.otlp.proto.http:opentelemetry_exporter_otlp_proto_http
  opentelemetry.exporter.otlp.proto.common:opentelemetry_exporter_otlp_proto_common
  opentelemetry.exporter.http.transport:opentelemetry_exporter_http_transport
  opentelemetry.exporter.otlp.common:opentelemetry_exporter_otlp_common
  opentelemetry.proto:opentelemetry_proto google.protobuf:protobuf google.rpc.status_pb2:googleapis_common_protos
  requests:requests urllib3:urllib3 charset_normalizer:charset_normalizer)
SERVER_DEPS+=("${TRACING_DEPS[@]}")
gpu_begin gpu_tracing server triton transformers pdserve.router.app pdserve.bench.serve pdserve.worker.server.app \
  opentelemetry.sdk.trace opentelemetry.exporter.otlp.proto.http.trace_exporter || exit 1
echo "setup: $(( $(date +%s) - T0 ))s"
cd /tmp
CKPT=/tmp/tracing_cfg
[ -f "$CKPT/tokenizer.json" ] || $PY -m pdserve.bench.disagg --out /tmp/tracing_ck_out --make-checkpoint "$CKPT" \
  --config-only > "$OUT/checkpoint.log" 2>&1 || { tail -n 30 "$OUT/checkpoint.log"; exit 1; }
# What the call has left after the setup, less the stacks' stop and the report; the harness
# starts no pair past its budget.
BUDGET=$(( 560 - ($(date +%s) - T0) - 60 ))
timeout --kill-after=10 "$(( BUDGET + 50 ))" $PY "$REPO/tools/tracing_overhead.py" --out "$OUT" --device cuda \
  --model "$CKPT" --worker-args="--load-format dummy --gpu-memory-utilization 0.2" --input-len 1024 \
  --output-len 128 --concurrency 16 --requests 64 --pairs 8 --budget-s "$BUDGET" "$@" > "$OUT/log.txt" 2>&1
echo "tracing_overhead: rc=$? in $(( $(date +%s) - T0 ))s (setup included)"
grep "^\[tracing" "$OUT/log.txt" | tail -n 30
cat "$OUT/results.md" 2>/dev/null || tail -n 60 "$OUT/log.txt"
