#!/usr/bin/env bash
# Builds the repository's Dockerfile (the file users build) with podman, as CI does, and prints
# the image's name. The defaults a user gets (CUDA base, torch from PyTorch's cu130 index)
# cannot be reached here, so the two build arguments change:
#   BASE_IMAGE      Debian bookworm minbase made by mmdebstrap from Debian's packages, imported
#                   once into podman's storage under a tag naming its recipe's hash;
#   TORCH_VERSION   2.13.0+cpu, the CPU build (the pin the README's install commands use);
#   TORCH_PIP_ARGS  this machine's wheel folder holding that wheel, mounted at /wheels (torch's
#                   own dependencies come from PyPI, as everything else in the image).
# Caching between runs lives in podman's own storage (outside the clone): the base image, and
# podman's layer cache (the torch layer; the dependency layer keyed by pyproject.toml; only the
# source layers rebuild when only the source changed).
set -euo pipefail
cd "$(dirname "$0")/.."
export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/.ci/containers.conf}"
IMAGE="${PDSERVE_IMAGE:-localhost/pdserve:ci}"
WHEELS="${PDSERVE_TORCH_WHEELS:-/opt/wheels}"
# This machine reaches PyPI through a TLS-intercepting proxy: pip in the build trusts its CA bundle.
CA="${PDSERVE_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
MIRROR="${PDSERVE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE_RECIPE="mmdebstrap --variant=minbase --mode=root bookworm - $MIRROR"
BASE="localhost/pdserve-ci-base:bookworm-$(printf '%s' "$BASE_RECIPE" | sha256sum | cut -c1-12)"

if ! podman image exists "$BASE"; then
  echo "building the base $BASE: $BASE_RECIPE" >&2
  # shellcheck disable=SC2086  # the recipe is the command line
  $BASE_RECIPE 2>/dev/null | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >&2
fi
# --network host: the build's RUN steps reach Debian and PyPI without a container network.
podman build --layers --network host --volume "$WHEELS:/wheels:ro" \
  --volume "$CA:/etc/pdserve-ci-ca.crt:ro" --build-arg PIP_CERT=/etc/pdserve-ci-ca.crt \
  --build-arg BASE_IMAGE="$BASE" --build-arg TORCH_VERSION=2.13.0+cpu --build-arg TORCH_PIP_ARGS="--find-links /wheels" \
  --tag "$IMAGE" . >&2
# Images of earlier runs' source that nothing is tagged or built on any more.
podman image prune --force >/dev/null 2>&1 || true
echo "$IMAGE"
