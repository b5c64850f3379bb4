#!/usr/bin/env bash
# Builds .whl/ (git-ignored), what every tools/gpu script and .ci/gpu_tests.sh carry to the device
# machine (run(carry=[".whl"])): the wheels of lib.sh's SERVER_DEPS and PEFT_DEPS for the device
# image's Python (3.12, x86_64), at the versions this checkout's .venv runs, and in .whl/tokenizer the
# default model's tokenizer files. From the repo root, with .venv set up (README's test command):
#
#   bash tools/gpu/wheels.sh          # ~1 min; then du -sh .whl must stay under the carry's 64 MiB
#
# nixl-cu13's wheel is repacked without nixl_ep_cu13/ (expert-parallel kernels pdserve does not use)
# so that the whole folder fits the carry.
set -euo pipefail
VENV=${VENV:-.venv}
DEST=.whl
PYV=${DEVICE_PYTHON:-3.12}
mkdir -p "$DEST"
# The distributions behind lib.sh's module:wheel pairs (a wheel name is its distribution's, normalized).
DISTS=(pyzmq llguidance nixl-cu13 prometheus_client pydantic pydantic_core annotated-types typing-inspection fastapi
  starlette annotated-doc typing_extensions opentelemetry-api anyio idna uvicorn click h11 httptools httpx httpcore
  certifi aiohttp aiosignal frozenlist multidict yarl propcache aiohappyeyeballs attrs tqdm uvloop
  peft accelerate psutil)
pins=()
for d in "${DISTS[@]}"; do
  v=$("$VENV/bin/python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$d")
  pins+=("$d==$v")
done
platforms=(--platform any --platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for glibc in $(seq 5 34); do platforms+=(--platform "manylinux_2_${glibc}_x86_64"); done  # the image's glibc is 2.39
"$VENV/bin/pip" download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  "${platforms[@]}" -d "$DEST" "${pins[@]}"

nixl=$(ls "$DEST"/nixl_cu13-*.whl | head -n 1)
python3 - "$nixl" <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as src:
    if not any(n.startswith("nixl_ep_cu13/") for n in src.namelist()):
        sys.exit(0)
    with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith("nixl_ep_cu13/"):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(True) if not line.startswith(b"nixl_ep_cu13/"))
            dst.writestr(info, data)
os.replace(path + ".tmp", path)
EOF

# The tiny test checkpoints take the default model's tokenizer (tests/conftest.py: PDSERVE_TEST_TOKENIZER_DIR).
model=$(cd /tmp && "$OLDPWD/$VENV/bin/python" -c \
  "from pdserve.worker.models.default_model import ensure_default_model; print(ensure_default_model())")
mkdir -p "$DEST/tokenizer"
for f in "$model"/tokenizer* "$model"/special_tokens_map.json "$model"/vocab.json "$model"/merges.txt; do
  [ -e "$f" ] && cp "$f" "$DEST/tokenizer/"
done
ls "$DEST/tokenizer"
du -sh "$DEST"
