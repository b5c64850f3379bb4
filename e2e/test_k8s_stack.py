"""The whole stack on a real Kubernetes control plane, as README's "Kubernetes quick start" does it.

Real: etcd, kube-apiserver, controller-manager (Deployments, ReplicaSets, EndpointSlices, garbage
collection), scheduler, `helm install` of charts/pdserve, `kubectl`, the operator run from the
chart's own Deployment (command, args, env) under its ServiceAccount's token, the worker and
router processes the operator's Deployments describe, NIXL/TCP KV transfer between them, and
the `openai` client. Stand-in: e2e/kubelet.py plays node-0's kubelet: each pod as a podman/runc
container of the image the repository's Dockerfile builds (.ci/build_image.sh), with the pod's
securityContext, volumes (the model from a PersistentVolumeClaim bound to a hostPath
PersistentVolume), probes and limits (see e2e/containers.py); where podman cannot run (or with
PDSERVE_E2E_PODS=process), each pod as a local process on its own 127.0.0.x address.

One test, in stages, because each stage needs the previous one's state; the transcript (what
the closing note quotes) is written to $PDSERVE_E2E_TRANSCRIPT or the test's tmp dir.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from e2e.containers import PodmanRuntime, build_image, podman_unusable
from e2e.kubelet import Kubelet
from tests.helpers.metrics import metric as read_metric
from tests.k8s_cluster import SHARED_K8S, k8s_cluster, wait_for  # noqa: F401  (session fixture)

pytestmark = [pytest.mark.k8s, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pdserve"
MS = "tiny"
PROMPT = "The capital of France is"
MAX_TOKENS = 12
CHART_IMAGE = "ghcr.io/pdserve/pdserve:0.1.0"
RESYNC_S = 2


class Transcript:
    def __init__(self, path: Path):
        self.path = path
        self.lines: list[str] = []

    def add(self, title: str, text: str) -> None:
        self.lines.append(f"### {title}\n{text.rstrip()}\n")
        self.path.write_text("\n".join(self.lines))


@pytest.fixture(scope="module")
def tools() -> dict[str, str]:
    out = subprocess.run([str(SHARED_K8S / "get-tools.sh")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return {**os.environ, "PATH": f"{out.stdout.strip()}:{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}


@pytest.fixture(scope="module")
def runtime(k8s_cluster):  # noqa: F811
    """The runtime that runs node-0's pods as containers of the built image, where podman can
    (CI); else None: pods as local processes. One run, not one with each: every stage is the
    same against either, and the container run proves all the process run does and more (the
    image, volumes, securityContext, limits, in-cluster credentials). The kubelet stand-in's
    process runtime stays covered by tests/operator/test_k8s_autoscaling_stack.py;
    PDSERVE_E2E_PODS=process picks it here too."""
    forced = os.environ.get("PDSERVE_E2E_PODS", "")
    if forced not in ("", "process", "container"):
        raise ValueError(f"PDSERVE_E2E_PODS must be process or container, got {forced!r}")
    reason = "PDSERVE_E2E_PODS=process" if forced == "process" else podman_unusable()
    if reason:
        if forced == "container":
            pytest.fail(f"PDSERVE_E2E_PODS=container, but {reason}")
        print(f"\npods run as local processes: {reason}")
        return None
    rt = PodmanRuntime(api_host="127.0.0.1", api_port=k8s_cluster.port)
    built = build_image()
    # The name the chart and the operator write (appVersion), from the node's own image store,
    # as `kind load docker-image` does: nothing is pulled.
    rt.podman("tag", built, CHART_IMAGE, check=True)
    return rt


def sh(env: dict, *argv: str, check: bool = True, timeout: float = 300) -> str:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out.stdout + (out.stderr if out.returncode else "")


def router_url(core, ns: str) -> str:
    """Service -> its endpoints -> http://podIP:port (no kube-proxy here, so no ClusterIP).
    EndpointSlices, not core Endpoints: the latter reject loopback pod IPs."""
    svc = core.read_namespaced_service(f"{MS}-router", ns)
    target = svc.spec.ports[0].target_port
    from kubernetes import dynamic
    from kubernetes.dynamic.exceptions import ResourceNotFoundError

    dyn = dynamic.DynamicClient(core.api_client)
    for version in ("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1"):  # v1 from Kubernetes 1.21
        try:
            api = dyn.resources.get(api_version=version, kind="EndpointSlice")
            break
        except ResourceNotFoundError:
            continue
    slices = api.get(namespace=ns, label_selector=f"kubernetes.io/service-name={svc.metadata.name}").to_dict()
    for s in slices["items"]:
        port = next((p["port"] for p in s.get("ports") or () if p.get("name") == target), None)
        for ep in s.get("endpoints") or ():
            if port and (ep.get("conditions") or {}).get("ready", True):
                return f"http://{ep['addresses'][0]}:{port}"
    return ""


def pods_by_role(core, ns: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in core.list_namespaced_pod(ns).items:
        if p.metadata.deletion_timestamp:
            continue
        role = (p.metadata.labels or {}).get("pdserve.io/role")
        ready = any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or ())
        if role and ready:
            out.setdefault(role, []).append(p)
    return out


def worker_key(core, ns: str) -> str:
    """The API key the operator generated for the workers (Secret <ms>-worker-api-key)."""
    import base64

    return base64.b64decode(core.read_namespaced_secret(f"{MS}-worker-api-key", ns).data["api-key"]).decode()


def metric(pod_ip: str, key: str, name: str) -> float:
    """A worker's counter summed over its labels; /metrics is keyed."""
    return read_metric(f"http://{pod_ip}:8000", name, headers={"Authorization": f"Bearer {key}"})


def finished(pod_ip: str, key: str) -> float:
    """Requests a worker finished (vllm:request_success_total, all reasons)."""
    return metric(pod_ip, key, "vllm:request_success_total")


def router_sees(base: str, prefill: int, decode: int) -> None:
    """Pods Ready is not yet the router discovering them (it lists EndpointSlices every 2 s)."""
    want = {"status": "ready", "decode_workers": decode, "prefill_workers": prefill}
    wait_for(lambda: httpx.get(f"{base}/ready", timeout=5).json() == want, timeout=60, what=f"router sees {want}")


def ms_ready(custom, ns: str) -> dict | None:
    obj = custom.get_namespaced_custom_object("pdserve.io", "v1alpha1", ns, "modelservings", MS)
    st = obj.get("status") or {}
    ok = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or ())
    return obj if ok and st.get("observedGeneration") == obj["metadata"]["generation"] else None


def stream(base_url: str, served: str, prompt: str = PROMPT) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    chunks = client.completions.create(model=served, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def model_claim(core, ns: str, model: Path) -> str:
    """A hostPath PersistentVolume holding the checkpoint and a claim the controller-manager binds
    to it; the kubelet stand-in mounts the bound volume's path. Readable by the pods' UID 1000."""
    model.chmod(0o755)
    for f in model.iterdir():
        f.chmod(0o644)
    core.create_persistent_volume({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-models"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "hostPath": {"path": str(model), "type": "Directory"},
                 "claimRef": {"namespace": ns, "name": "models"}}})
    core.create_namespaced_persistent_volume_claim(ns, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": f"{ns}-models",
                 "resources": {"requests": {"storage": "1Gi"}}}})
    wait_for(lambda: core.read_namespaced_persistent_volume_claim("models", ns).status.phase == "Bound",
             timeout=60, what="model claim Bound")
    return "models"


def pod_identity(proc, tmp_path: Path, cluster) -> str:
    """A kubeconfig with the credentials the pod itself holds: the process's KUBECONFIG, or the
    container's projected ServiceAccount token."""
    if "KUBECONFIG" in proc.env:
        return proc.env["KUBECONFIG"]
    import yaml

    sa = tmp_path / f"{proc.namespace}_{proc.name}" / "serviceaccount"
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "pod",
           "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{cluster.port}",
                                                  "certificate-authority": str(sa / "ca.crt")}}],
           "users": [{"name": "pod", "user": {"tokenFile": str(sa / "token")}}],
           "contexts": [{"name": "pod", "context": {"cluster": "c", "user": "pod"}}]}
    path = tmp_path / f"{proc.name}.kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.timeout(1500)  # ~3-5 min alone; more on a busy 2-core machine
def test_helm_install_modelserving_scale_rollout_delete(k8s_cluster, tools, tiny_checkpoint, tmp_path, runtime):  # noqa: F811
    from kubernetes import client

    core, custom = k8s_cluster.core(), client.CustomObjectsApi(k8s_cluster.api_client)
    apps = client.AppsV1Api(k8s_cluster.api_client)
    transcript = Transcript(Path(os.environ.get("PDSERVE_E2E_TRANSCRIPT", tmp_path / "transcript.md")))
    env = {**tools, "KUBECONFIG": str(k8s_cluster.kubeconfig)}
    system_ns = k8s_cluster.create_namespace("pdserve-system")
    ns = k8s_cluster.create_namespace("e2e")
    # cluster-scoped names (ClusterRole, ClusterRoleBinding) follow the release: unique per run
    release = system_ns.replace("-system", "")
    model = tiny_checkpoint("llama")
    source = str(model)
    if runtime is not None:  # a container sees the model only through a volume: a hostPath PV's claim
        source = f"pvc://{model_claim(core, ns, model)}"

    kubelet = Kubelet(k8s_cluster.api_client, f"https://127.0.0.1:{k8s_cluster.port}",
                      k8s_cluster.run_dir / "pki" / "apiserver.crt", tmp_path,
                      namespaces=[system_ns, ns], runtime=runtime).start()
    try:
        # -- 1. helm install: CRD, RBAC, the operator (its pod runs under the kubelet stand-in)
        # The operator refreshes a ModelServing's status (Ready once its pods are, Degraded) on its
        # resync timer: the chart's 15 s default would add up to 15 s to each stage's wait.
        out = sh(env, "helm", "install", release, str(CHART), "-n", system_ns,
                 "--set", f"operator.watchNamespaces={{{ns}}}", "--set", f"operator.resyncSeconds={RESYNC_S}",
                 "--wait", "--timeout", "5m", timeout=400)
        transcript.add(
            f"helm install {release} charts/pdserve -n {system_ns} --set operator.watchNamespaces={{{ns}}} "
            f"--set operator.resyncSeconds={RESYNC_S} --wait", out
        )
        op = core.list_namespaced_pod(system_ns, label_selector="app.kubernetes.io/component=operator").items[0]
        proc = next(p for p in kubelet.pods.values() if p.name == op.metadata.name)
        assert proc.argv[1:3] == ["operator", f"--namespace={ns}"], proc.argv  # the chart's own command/args
        assert f"--resync-seconds={RESYNC_S}" in proc.argv, proc.argv  # ...with the values' settings
        identity = pod_identity(proc, tmp_path, k8s_cluster)
        who = sh({**env, "KUBECONFIG": identity}, "kubectl", "auth", "can-i", "create", "deployments",
                 "-n", ns, check=False)
        assert who.strip().startswith("yes")  # the operator's identity is its ServiceAccount's
        for verb, resource, where in (("delete", "secrets", ns), ("create", "deployments", "default")):
            answer = sh({**env, "KUBECONFIG": identity}, "kubectl", "auth", "can-i", verb, resource,
                        "-n", where, check=False)
            assert answer.strip().startswith("no"), (verb, resource, where)  # least privilege, watched namespace only

        # -- 2. kubectl apply a minimal ModelServing (no image: the operator's default; the KV
        #       peer allowlist names this cluster's loopback pod network)
        manifest = tmp_path / "tiny.yaml"
        manifest.write_text(f"""apiVersion: pdserve.io/v1alpha1
kind: ModelServing
metadata: {{name: {MS}}}
spec:
  model: {{source: {source}, servedName: {MS}}}
  device: cpu
  prefill: {{replicas: 1}}
  decode: {{replicas: 1}}
  kvTransfer: {{peerAllow: [127.0.0.0/8]}}  # this cluster's pod network is loopback, not a private range
""")
        transcript.add(f"cat {manifest.name}", manifest.read_text())
        transcript.add(
            f"kubectl -n {ns} apply -f {manifest.name}", sh(env, "kubectl", "-n", ns, "apply", "-f", str(manifest))
        )
        obj = wait_for(lambda: ms_ready(custom, ns), timeout=300, interval=1, what="ModelServing Ready")
        assert obj["spec"].get("image") is None
        assert "Forbidden" not in proc.log_path.read_text(errors="replace")  # its role is enough
        deploy = apps.read_namespaced_deployment(f"{MS}-decode", ns)
        assert deploy.spec.template.spec.containers[0].image == "ghcr.io/pdserve/pdserve:0.1.0"  # chart appVersion
        transcript.add(
            f"kubectl -n {ns} get ms,pods -o wide", sh(env, "kubectl", "-n", ns, "get", "ms,pods", "-o", "wide")
        )
        if runtime is not None:
            transcript.add("podman ps (node-0's containers)", runtime.podman(
                "ps", "--format", "{{.Names}}\t{{.Image}}\t{{.Status}}", check=True).stdout)

        # -- 3. the workers are keyed (the operator's generated Secret): without the key a
        #       worker answers only /health; the router holds the key, so P/D goes through
        key = worker_key(core, ns)
        base = wait_for(lambda: router_url(core, ns), timeout=60, what="router endpoint")
        router_sees(base, prefill=1, decode=1)
        pods = pods_by_role(core, ns)
        prefill_ip, decode_ip = pods["prefill"][0].status.pod_ip, pods["decode"][0].status.pod_ip
        body = {"model": MS, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        for ip in (prefill_ip, decode_ip):
            assert httpx.get(f"http://{ip}:8000/health", timeout=5).status_code == 200
            for method, path in (("POST", "/v1/completions"), ("GET", "/metrics"), ("GET", "/v1/models")):
                r = httpx.request(
                    method, f"http://{ip}:8000{path}", json=body if method == "POST" else None, timeout=30
                )
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (ip, path, r.text)
        p0, moved0 = finished(prefill_ip, key), metric(decode_ip, key, "pdserve_kv_transfer_bytes_total")
        fallbacks0 = metric(decode_ip, key, "pdserve_kv_local_prefill_fallbacks_total")
        answer = stream(base, MS)
        assert finished(prefill_ip, key) == p0 + 1  # it was prefilled on the prefill worker...
        # ...whose KV the keyed decode worker took from the router's params and pulled
        assert metric(decode_ip, key, "pdserve_kv_transfer_bytes_total") > moved0
        assert metric(decode_ip, key, "pdserve_kv_local_prefill_fallbacks_total") == fallbacks0
        single = httpx.post(f"http://{decode_ip}:8000/v1/completions", timeout=120, json=body,
                            headers={"Authorization": f"Bearer {key}"}).json()["choices"][0]["text"]
        assert answer == single and answer  # ...and equals one worker's own greedy answer
        transcript.add("keyed workers: unkeyed calls", f"/health 200; /v1/completions, /metrics, /v1/models 401 "
                       f"invalid_api_key on {prefill_ip} and {decode_ip}")
        transcript.add(f"openai streaming completion via {base} (Service {MS}-router)",
                       f"prompt: {PROMPT!r}\nanswer (P/D, streamed): {answer!r}\nsingle decode worker:   {single!r}")

        # -- 4. scale decode to 2: both serve
        sh(env, "kubectl", "-n", ns, "patch", "ms", MS, "--type", "merge", "-p", '{"spec":{"decode":{"replicas":2}}}')
        wait_for(lambda: len(pods_by_role(core, ns).get("decode", ())) == 2 and ms_ready(custom, ns), timeout=300,
                 interval=1, what="2 ready decode workers")
        router_sees(base, prefill=1, decode=2)
        decode_ips = [p.status.pod_ip for p in pods_by_role(core, ns)["decode"]]
        before = {ip: finished(ip, key) for ip in decode_ips}

        def both_used() -> bool:
            threads = [threading.Thread(target=stream, args=(base, MS, f"{PROMPT} {i}")) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return all(finished(ip, key) > before[ip] for ip in decode_ips)

        wait_for(both_used, timeout=120, interval=0.5, what="both decode workers used")
        used = {ip: finished(ip, key) - before[ip] for ip in decode_ips}
        transcript.add("scale decode to 2", f"kubectl -n {ns} patch ms {MS} --type merge -p "
                       f"'{{\"spec\":{{\"decode\":{{\"replicas\":2}}}}}}'\nrequests finished per decode worker: {used}")

        # -- 5. change the spec: a rolling update (new worker revision) under a client loop
        old_revision = obj["status"]["revision"]
        counts = {"requests": 0, "failures": 0}
        errors: list[str] = []
        stop = threading.Event()

        def client_loop(i: int) -> None:
            while not stop.is_set():
                try:
                    text = stream(base, MS, f"{PROMPT} {i}")
                    assert text, "empty answer"
                except Exception as e:  # counted, then reported below
                    counts["failures"] += 1
                    errors.append(repr(e))
                counts["requests"] += 1

        loops = [threading.Thread(target=client_loop, args=(i,)) for i in range(2)]
        for t in loops:
            t.start()
        sh(
            env,
            "kubectl",
            "-n",
            ns,
            "patch",
            "ms",
            MS,
            "--type",
            "merge",
            "-p",
            '{"spec":{"model":{"maxModelLen":1024}}}',
        )

        def rolled() -> bool:
            o = ms_ready(custom, ns)
            if not o or o["status"].get("revision") == old_revision:
                return False
            live = [p for p in core.list_namespaced_pod(ns).items
                    if (p.metadata.labels or {}).get("pdserve.io/role") in ("prefill", "decode")]
            return len(live) == 3 and all(p.metadata.labels.get("pdserve.io/revision") == o["status"]["revision"]
                                          and not p.metadata.deletion_timestamp for p in live)

        try:
            wait_for(rolled, timeout=400, interval=1, what="rolling update to the new revision")
            time.sleep(3)  # a few requests on the new revision only
        finally:
            stop.set()
            for t in loops:
                t.join(180)
        transcript.add("rolling update (spec.model.maxModelLen: 1024) under 2 streaming client loops",
                       f"revision {old_revision} -> {ms_ready(custom, ns)['status']['revision']}\n"
                       f"requests: {counts['requests']}, failed: {counts['failures']}")
        transcript.add(f"kubectl -n {ns} get ms,pods -o wide (after the rollout)",
                       sh(env, "kubectl", "-n", ns, "get", "ms,pods", "-o", "wide"))
        assert counts["requests"] > 0
        assert counts["failures"] == 0, errors[:5]

        # -- 5b. containers only: a decode pod over its memory limit is OOM-killed (the kernel, by
        #        the container's cgroup limit) and the ModelServing's status says so
        if runtime is not None:
            sh(env, "kubectl", "-n", ns, "patch", "ms", MS, "--type", "merge", "-p",
               '{"spec":{"decode":{"resources":{"limits":{"memory":"150Mi"}}}}}')

            def oom_status() -> dict | None:
                obj = custom.get_namespaced_custom_object("pdserve.io", "v1alpha1", ns, "modelservings", MS)
                cond = next(
                    (c for c in (obj.get("status") or {}).get("conditions") or () if c["type"] == "Degraded"), {}
                )
                return cond if cond.get("status") == "True" and "OOMKilled" in cond.get("message", "") else None

            try:
                degraded = wait_for(oom_status, timeout=300, interval=1, what="Degraded: OOMKilled")
            except AssertionError as e:  # say what the status, the pods and the kubelet did instead
                obj = custom.get_namespaced_custom_object("pdserve.io", "v1alpha1", ns, "modelservings", MS)
                raise AssertionError(
                    f"{e}; conditions {(obj.get('status') or {}).get('conditions')}; pods "
                    f"{sh(env, 'kubectl', '-n', ns, 'get', 'pods', '-o', 'wide', check=False)}; kubelet "
                    f"{kubelet.events[-20:]}") from None
            oom_pod = next(p for p in core.list_namespaced_pod(ns).items
                           if any(((cs.last_state and cs.last_state.terminated) or None) is not None
                                  and cs.last_state.terminated.reason == "OOMKilled"
                                  for cs in p.status.container_statuses or ()))
            assert oom_pod.spec.containers[0].resources.limits["memory"] == "150Mi"
            transcript.add("decode memory limit 150Mi: OOM-killed",
                           f"kubectl -n {ns} patch ms {MS} --type merge -p "
                           "'{\"spec\":{\"decode\":{\"resources\":{\"limits\":{\"memory\":\"150Mi\"}}}}}'\n"
                           f"status.conditions[Degraded]: {degraded['reason']}: {degraded['message']}\n"
                           + sh(env, "kubectl", "-n", ns, "get", "ms,pods", "-o", "wide"))

        # -- 6. delete: everything goes (garbage collection, the kubelet stops the processes)
        transcript.add(
            f"kubectl -n {ns} delete ms {MS}", sh(env, "kubectl", "-n", ns, "delete", "ms", MS, "--wait=false")
        )
        wait_for(lambda: not core.list_namespaced_pod(ns).items and not apps.list_namespaced_deployment(ns).items
                 and not core.list_namespaced_service(ns).items, timeout=180, interval=1, what="children gone")
        wait_for(lambda: not [p for p in kubelet.running() if p.namespace == ns], timeout=60, what="processes gone")
        transcript.add(
            f"helm uninstall {release} -n {system_ns}", sh(env, "helm", "uninstall", release, "-n", system_ns)
        )
        wait_for(lambda: not kubelet.running(), timeout=60, what="operator process gone")
        transcript.add(
            f"kubectl -n {ns} get all; ps",
            sh(env, "kubectl", "-n", ns, "get", "all")
            or "No resources found\n" + f"pod processes still running: {len(kubelet.running())}",
        )
        transcript.add("kubelet stand-in log", "\n".join(kubelet.events))
    except BaseException:
        logs = "".join(
            f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(tmp_path.glob("*.log"))
        )
        transcript.add("kubelet stand-in log", "\n".join(kubelet.events) + logs)
        raise
    finally:
        kubelet.stop()
        if runtime is not None:
            k8s_cluster.core().delete_persistent_volume(f"{ns}-models")
        sh(env, "helm", "uninstall", release, "-n", system_ns, check=False)
        k8s_cluster.delete_namespace(ns)
        k8s_cluster.delete_namespace(system_ns)
        print(f"\ntranscript: {transcript.path}\n" + "\n".join(transcript.lines))
