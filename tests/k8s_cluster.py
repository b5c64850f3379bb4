"""A real Kubernetes control plane for tests, from `<repo>/../shared/k8s` (see its README).

    from tests.k8s_cluster import k8s_cluster  # the session fixture, in a test module or conftest

    def test_x(k8s_cluster):
        k8s_cluster.kubeconfig          # path to an admin kubeconfig
        k8s_cluster.api_client          # kubernetes.client.ApiClient bound to it
        ns = k8s_cluster.create_namespace("x")

The fixture only starts the control plane: etcd, kube-apiserver, controller-manager and
scheduler on free loopback ports in a temp RUN_DIR, stopped when the session ends. It never
builds them: compiling Kubernetes takes minutes (more on a busy machine), longer than pytest's
per-test timeout, so `.ci/run` runs `../shared/k8s/build.sh` once, bounded, before pytest starts,
and a developer runs it once by hand. Without the binaries the fixture fails under CI (env CI
set) and skips elsewhere, naming build.sh either way. One cluster per session even if several modules import the
fixture: it lives in the pytest session's stash. There is no kubelet: `Kubelet` below plays one
by patching pod status through the status subresource.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

SHARED_K8S = Path(__file__).resolve().parents[2] / "shared" / "k8s"
# Where build.sh puts the binaries (its PDSERVE_K8S_HOME, same default).
K8S_BIN = Path(os.environ.get("PDSERVE_K8S_HOME", "/var/cache/pdserve-k8s")) / "bin"
K8S_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")


@dataclass
class Cluster:
    run_dir: Path
    port: int
    kubeconfig: Path
    api_client: Any = field(repr=False)

    def core(self):
        from kubernetes import client

        return client.CoreV1Api(self.api_client)

    def create_namespace(self, prefix: str) -> str:
        """A fresh namespace per test keeps tests independent on one shared cluster."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.core().create_namespace({"metadata": {"name": name}})
        return name

    def delete_namespace(self, name: str) -> None:
        """Delete a namespace and, as no kubelet will ever confirm it, force-delete its pods so
        their resources (GPUs on node-0) are free for the next test."""
        core = self.core()
        core.delete_namespace(name, _preload_content=False)
        for pod in core.list_namespaced_pod(name).items:
            core.delete_namespaced_pod(pod.metadata.name, name, grace_period_seconds=0, _preload_content=False)

    def stop(self) -> None:
        subprocess.run([str(SHARED_K8S / "stop-cluster.sh"), str(self.run_dir)], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)


def _free_port_triple() -> int:
    """A port p with p, p+1, p+2 free (apiserver, etcd client, etcd peer)."""
    for _ in range(200):
        p = random.randint(20000, 40000)
        try:
            for q in (p, p + 1, p + 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    raise RuntimeError("no three consecutive free loopback ports")


def missing_control_plane() -> str | None:
    """Why the control plane cannot start here (scripts or built binaries absent), or None."""
    if not (SHARED_K8S / "start-cluster.sh").exists():
        return f"control plane scripts not found at {SHARED_K8S}"
    missing = [name for name in K8S_BINARIES if not os.access(K8S_BIN / name, os.X_OK)]
    if shutil.which("etcd") is None:
        missing.append("etcd")
    if missing:
        return (f"control plane not built ({', '.join(missing)} missing from {K8S_BIN} or PATH): "
                f"run {SHARED_K8S / 'build.sh'} once first (~5 min on 2 cores; .ci/run does it before pytest)")
    return None


def _stop_when_gone(pid: int, run_dir: Path) -> None:
    """start-cluster.sh runs the control plane in sessions of its own: a pytest process killed
    before its cleanup (Ctrl-C under xdist, a timeout) would leave it running for good, a tenth
    of a core or more. A detached watcher stops it once that process is gone (and exits once
    stop-cluster.sh has removed RUN_DIR)."""
    watch = 'while kill -0 "$1" 2>/dev/null && [ -d "$2" ]; do sleep 5; done; [ -d "$2" ] && exec "$3" "$2"'
    subprocess.Popen(["bash", "-c", watch, "k8s-watch", str(pid), str(run_dir), str(SHARED_K8S / "stop-cluster.sh")],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)


def start_cluster() -> Cluster:
    """Start a control plane from the built binaries; the caller must call .stop()."""
    reason = missing_control_plane()
    if reason:
        raise RuntimeError(reason)
    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-k8s-"))
    port = _free_port_triple()
    env = {**os.environ, "PDSERVE_K8S_PORT": str(port)}
    started = subprocess.run([str(SHARED_K8S / "start-cluster.sh"), str(run_dir)], env=env,
                             capture_output=True, text=True, timeout=180)
    cluster = Cluster(run_dir, port, run_dir / "kubeconfig", None)
    if started.returncode != 0:
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in run_dir.glob("*.log"))
        cluster.stop()
        raise RuntimeError(f"start-cluster.sh failed: {started.stderr[-2000:]}{logs}")
    _stop_when_gone(os.getpid(), run_dir)
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    cluster.api_client = client.ApiClient(cfg)
    return cluster


_CLUSTER_KEY = pytest.StashKey[Cluster]()


def stop_cluster(config: pytest.Config) -> None:
    """Stops the control plane this process started, if it did (tests/helpers/run_hooks.py calls it once
    the process's last k8s test is through; the session's own cleanup then finds it gone)."""
    cluster = config.stash.get(_CLUSTER_KEY, None)
    if cluster is not None:
        del config.stash[_CLUSTER_KEY]
        cluster.stop()


@pytest.fixture(scope="session")
def k8s_cluster(request: pytest.FixtureRequest) -> Cluster:
    stash = request.config.stash
    if _CLUSTER_KEY not in stash:
        reason = missing_control_plane()
        if reason:
            # Under CI a missing control plane is a broken setup, never a reason to skip.
            if os.environ.get("CI"):
                pytest.fail(reason, pytrace=False)
            pytest.skip(reason)
        cluster = start_cluster()
        request.config.add_cleanup(cluster.stop)
        stash[_CLUSTER_KEY] = cluster
    return stash[_CLUSTER_KEY]


def wait_for(predicate: Callable[[], Any], timeout: float = 60, interval: float = 0.2, what: str = "condition") -> Any:
    """Poll until predicate() is truthy and return its value; fail naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # an object not created yet reads as 404
            last_error = e
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_error})" if last_error else "")
    )


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Kubelet:
    """Plays node-0's kubelet for pods the scheduler bound: reports them Running and Ready
    (or crash-looping) through the status subresource. Starts no processes: tests that need
    real containers run their own (see e2e/)."""

    def __init__(self, cluster: Cluster, namespace: str):
        self.core = cluster.core()
        self.namespace = namespace
        self._next_ip = 2

    def _ip(self) -> str:
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        return ip

    def bound_pods(self, selector: str) -> list:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        return [p for p in pods if p.spec.node_name and not p.metadata.deletion_timestamp]

    def set_ready(self, pod, ready: bool = True) -> None:
        now = _now()
        flag = "True" if ready else "False"
        containers = [{"name": c.name, "image": c.image, "imageID": "", "ready": ready, "restartCount": 0,
                       "started": True, "state": {"running": {"startedAt": now}}} for c in pod.spec.containers]
        body = {"status": {
            "phase": "Running", "podIP": (pod.status.pod_ip or self._ip()), "hostIP": "127.0.0.1", "startTime": now,
            "conditions": [{"type": t, "status": s, "lastTransitionTime": now} for t, s in (
                ("PodScheduled", "True"), ("Initialized", "True"), ("ContainersReady", flag), ("Ready", flag))],
            "containerStatuses": containers}}
        self.core.patch_namespaced_pod_status(pod.metadata.name, self.namespace, body)

    def crash_loop(self, pod, message: str = "exit code 1") -> None:
        now = _now()
        containers = [
            {
                "name": c.name,
                "image": c.image,
                "imageID": "",
                "ready": False,
                "restartCount": 5,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": message}},
                "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "startedAt": now, "finishedAt": now}},
            }
            for c in pod.spec.containers
        ]
        body = {"status": {"phase": "Running", "podIP": pod.status.pod_ip or self._ip(), "hostIP": "127.0.0.1",
                           "startTime": now,
                           "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
                           "containerStatuses": containers}}
        self.core.patch_namespaced_pod_status(pod.metadata.name, self.namespace, body)

    def reap(self) -> None:
        """Confirm deletions, as a kubelet does once containers stop: a pod with a deletion
        timestamp is removed for good (without this, terminating pods keep their GPUs)."""
        for pod in self.core.list_namespaced_pod(self.namespace).items:
            if pod.metadata.deletion_timestamp:
                self.core.delete_namespaced_pod(pod.metadata.name, self.namespace, grace_period_seconds=0,
                                                _preload_content=False)

    def make_ready(self, selector: str) -> int:
        """Reap deleted pods, then mark every bound, not-yet-ready pod matching selector Ready;
        returns how many were marked."""
        self.reap()
        n = 0
        for pod in self.bound_pods(selector):
            conds = {c.type: c.status for c in (pod.status.conditions or ())}
            if conds.get("Ready") != "True":
                self.set_ready(pod)
                n += 1
        return n
