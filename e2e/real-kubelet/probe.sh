#!/usr/bin/env bash
# Issue 28's question "can a real kubelet v1.20 run here?", answered by running one (not used by
# CI yet; see docs/kubernetes.md). Builds kubelet v1.20.2 from the same Debian source package
# as ../shared/k8s (shared/k8s/build.sh with WHAT=cmd/kubelet, ~20 min on a busy 2-core
# machine), runs Debian's containerd 1.6 with runc and the CNI bridge plugin, registers node-1
# with a throwaway control plane, and runs pod.yaml: a restricted pod (UID 1000, read-only
# root, all capabilities dropped) and one OOM-killed by its 32Mi limit.
#
#   e2e/real-kubelet/probe.sh DIR     # DIR: a scratch directory; prints kubectl get pods -o wide
#
# Needs root, apt (containerd, containernetworking-plugins, podman, mmdebstrap) and a base
# image from .ci/build_image.sh in podman's storage (used as the pause and test image).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${1:?scratch directory}
mkdir -p "$DIR"/bin "$DIR"/cni/net.d "$DIR"/ctrd "$DIR"/root
export CONTAINERS_CONF="$HERE/../../.ci/containers.conf"
command -v containerd >/dev/null || apt-get install -y -q containerd containernetworking-plugins >/dev/null
if [ ! -x "$DIR/bin/kubelet" ]; then
  sed -e 's#^make WHAT=.*#make WHAT="cmd/kubelet" >"$W"/make.log 2>\&1 || { tail -40 "$W"/make.log >\&2; exit 1; }#' \
      -e 's#^cp _output/bin/kube-apiserver.*#cp _output/bin/kubelet "$BIN"/#' \
      -e 's#^if \[ -x "\$BIN/kube-apiserver" \].*#if [ -x "$BIN/kubelet" ]; then#' \
      -e "s#^HOME_DIR=.*#HOME_DIR=$DIR#" "$HERE/../../../shared/k8s/build.sh" > "$DIR/build-kubelet.sh"
  bash "$DIR/build-kubelet.sh"
fi
sed "s#@DIR@#$DIR#g" "$HERE/containerd.toml" > "$DIR/containerd.toml"
cp "$HERE/10-bridge.conflist" "$DIR/cni/net.d/"
containerd --config "$DIR/containerd.toml" > "$DIR/containerd.log" 2>&1 & echo $! > "$DIR/containerd.pid"
# The pause image: a Debian base whose command sleeps (registry.k8s.io is not reachable here).
base=$(podman images --format '{{.Repository}}:{{.Tag}}' | grep pdserve-ci-base:bookworm | head -1)
printf 'FROM %s\nCMD ["sleep", "infinity"]\n' "$base" | podman build -q -t localhost/pause:probe -f - "$DIR" >/dev/null
podman save --format oci-archive -o "$DIR/pause.tar" localhost/pause:probe
sleep 2
ctr -a "$DIR/ctrd/containerd.sock" -n k8s.io images import "$DIR/pause.tar" >/dev/null
PDSERVE_K8S_PORT=${PDSERVE_K8S_PORT:-26443} "$HERE/../../../shared/k8s/start-cluster.sh" "$DIR/run" >/dev/null
export KUBECONFIG=$DIR/run/kubeconfig
"$DIR/bin/kubelet" --kubeconfig="$KUBECONFIG" --config="$HERE/kubelet-config.yaml" --container-runtime=remote \
  --container-runtime-endpoint="unix://$DIR/ctrd/containerd.sock" --hostname-override=node-1 \
  --root-dir="$DIR/root" --network-plugin=cni --cni-conf-dir="$DIR/cni/net.d" --cni-bin-dir=/usr/lib/cni \
  --pod-infra-container-image=localhost/pause:probe > "$DIR/kubelet.log" 2>&1 & echo $! > "$DIR/kubelet.pid"
K=$(dirname "$(command -v kubectl || echo /var/cache/pdserve-k8s/bin/kubectl)")/kubectl
for _ in $(seq 60); do "$K" get node node-1 2>/dev/null | grep -q ' Ready' && break; sleep 1; done
"$K" create serviceaccount default >/dev/null 2>&1 || true
"$K" apply -f "$HERE/pod.yaml" >/dev/null
for _ in $(seq 60); do
  [ "$("$K" get pod oom -o jsonpath='{.status.containerStatuses[0].state.terminated.reason}')" = OOMKilled ] \
    && "$K" get pod probe | grep -q Running && break
  sleep 1
done
"$K" get nodes -o wide; "$K" get pods -o wide
echo "stop: kill \$(cat $DIR/kubelet.pid) \$(cat $DIR/containerd.pid); ../shared/k8s/stop-cluster.sh $DIR/run"
