"""A kubelet stand-in for node-0 of the loopback control plane (../shared/k8s has no kubelet).

Every pod the scheduler binds to node-0 runs, on its own loopback address (127.0.0.2,
127.0.0.3, ..., skipping addresses something already listens on), with one of two runtimes:

- processes (the default): command[0] is looked up on PATH with the project's .venv/bin first
  (the image's entrypoint `pdserve` is the local console script, so the image does not
  matter); no volumes (the model is a local path), no resource limits, no securityContext
  (processes run as the test's user); the ServiceAccount token is handed over as a kubeconfig
  in KUBECONFIG;
- containers (`runtime=` an e2e.containers.PodmanRuntime): the pod's container runs from its
  image with podman and runc, with its volumes, securityContext, memory/cpu limits and the
  token projected for in-cluster credentials; a container the kernel OOM-kills reports
  lastState.terminated.reason OOMKilled, exit code 137 (see e2e/containers.py).

Both:
- env: `value`, and `valueFrom` fieldRef (status.podIP, metadata.name, ...), secretKeyRef and
  configMapKeyRef read through the API; $(VAR) references expand as Kubernetes does;
- the pod's identity: a token minted by the TokenRequest API for spec.serviceAccountName;
- the pod's network namespace: e2e/podnet/sitecustomize.py narrows wildcard binds to the pod IP;
- status through the status subresource: Running with podIP once started, Ready when the
  readiness probe (httpGet) answers 2xx (at once without a probe), not Ready while it fails;
  a container that exits is restarted with back-off (waiting CrashLoopBackOff meanwhile, its
  exit in lastState.terminated), restartCount counting;
- startup and liveness probes (httpGet): failureThreshold failures in a row restart the
  container (after initialDelaySeconds); liveness starts once the startup probe (if any) has
  succeeded, as in Kubernetes;
- deletion: preStop hooks (exec, inside the container in container mode; httpGet) run first,
  then SIGTERM, SIGKILL after terminationGracePeriodSeconds, then the pod is removed for good
  (grace 0), as a kubelet confirms a deletion.

Not emulated: exec probes, init and sidecar containers (the first container only), the pod's
own network namespace (pods share the host's network), image pulls.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdserve.protocol.contract import ENV_NIXL_PROGRESS_NICE

log = logging.getLogger("kubelet")

ROOT = Path(__file__).resolve().parents[1]
PODNET = Path(__file__).resolve().parent / "podnet"
NODE = "node-0"
RESTART_BACKOFF_MAX_S = 10.0


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class PodProcess:
    namespace: str
    name: str
    uid: str
    ip: str
    log_path: Path
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    ready: bool | None = None  # last Ready reported (None: nothing reported yet)
    restarts: int = 0
    next_start: float = 0.0
    stopping: bool = False
    probe: dict[str, Any] | None = None
    liveness: dict[str, Any] | None = None
    container: str | None = None  # container mode: the running container's name
    probe_port: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known variables expand, $$ escapes, unknown ones stay."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def listening_ips() -> set[str]:
    """IPv4 addresses with a listening TCP socket on this machine (/proc/net/tcp)."""
    out = set()
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A":  # LISTEN
            addr = int(fields[1].split(":")[0], 16)  # little-endian hex
            out.add(".".join(str((addr >> s) & 0xFF) for s in (0, 8, 16, 24)))
    return out


class Kubelet:
    def __init__(self, api_client, server: str, ca_file: Path, work_dir: Path, namespaces: list[str],
                 first_ip: int = 2, poll_s: float = 0.3, runtime=None):
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.server = server  # the API server URL pods' kubeconfigs point at
        self.ca_file = ca_file  # what verifies its serving certificate (a pod's ca.crt)
        # Only these namespaces' pods run: other tests on the shared cluster play node-0's
        # kubelet for their own pods without processes.
        self.namespaces = list(namespaces)
        self.work_dir = work_dir
        self.poll_s = poll_s
        self._next_ip = first_ip
        self.pods: dict[str, PodProcess] = {}  # uid -> process
        self.events: list[str] = []  # what happened, for the transcript
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=1.0)
        self.runtime = runtime  # None: pods as local processes; else e2e.containers.PodmanRuntime

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "Kubelet":
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop syncing and kill every process still running (test teardown)."""
        self._stop.set()
        if self._thread:
            self._thread.join(10)
        for p in list(self.pods.values()):
            self._kill(p, grace_s=5)
            if p.container is not None:
                self.runtime.remove(p.container)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as e:  # the API server restarting or a pod vanishing mid-sync
                log.warning("kubelet sync failed: %r", e)
            self._stop.wait(self.poll_s)

    # -- one sync pass -----------------------------------------------------------------------

    def sync(self) -> None:
        pods = [pod for ns in self.namespaces
                for pod in self.core.list_namespaced_pod(ns, field_selector=f"spec.nodeName={NODE}").items]
        seen = set()
        for pod in pods:
            uid = pod.metadata.uid
            seen.add(uid)
            p = self.pods.get(uid)
            if pod.metadata.deletion_timestamp:
                if p is None:
                    self._confirm_deletion(pod)
                elif not p.stopping:
                    p.stopping = True
                    grace = pod.metadata.deletion_grace_period_seconds
                    grace = pod.spec.termination_grace_period_seconds if grace is None else grace
                    threading.Thread(target=self._terminate, args=(p, pod, 30 if grace is None else grace),
                                     daemon=True).start()
                continue
            try:
                if p is None:
                    p = self.pods[uid] = self._create(pod)
                self._run(p, pod)
            except Exception as e:  # e.g. its ServiceAccount not created yet: retried next pass
                log.warning("pod %s/%s: %r", pod.metadata.namespace, pod.metadata.name, e)
        # list(...) snapshots: terminating pods leave self.pods from their own threads
        for uid in [u for u, p in list(self.pods.items()) if u not in seen and not p.stopping]:
            self._kill(self.pods.pop(uid), grace_s=1)  # force-deleted behind our back

    def _run(self, p: PodProcess, pod) -> None:
        if p.proc is not None and p.proc.poll() is not None:
            code = p.proc.returncode
            reason = "Error" if code else "Completed"
            if p.container is not None:
                if self.runtime.oom_killed(p.container, self._pod_dir(pod)):
                    reason, code = "OOMKilled", 137
                self.runtime.remove(p.container)
                p.container = None
            p.restarts += 1
            p.next_start = time.monotonic() + min(RESTART_BACKOFF_MAX_S, 2.0 ** p.restarts)
            self._note(f"{p.namespace}/{p.name} exited {code} ({reason}); restart {p.restarts}")
            p.proc = None
            p.extra["last_terminated"] = {"exitCode": code, "reason": reason, "finishedAt": _now()}
            self._patch(p, pod, ready=False, waiting=(
                f"back-off {min(RESTART_BACKOFF_MAX_S, 2.0 ** p.restarts):.0f}s restarting failed "
                f"container={pod.spec.containers[0].name} pod={p.name}"))
            return
        if p.proc is None:
            if time.monotonic() < p.next_start:
                return
            p.proc = self._spawn(p, pod)
            p.extra["started"] = time.monotonic()
            p.extra["started_ok"] = "startup" not in p.extra  # liveness waits for the startup probe
            for probe in (p.liveness, p.extra.get("startup")):
                if probe is not None:
                    probe.update(failures=0, last=0.0)
            self._patch(p, pod, ready=False)
            if p.probe is None:
                self._patch(p, pod, ready=True)
            return
        if p.extra.get("killing") is p.proc:
            return  # a failed probe's restart is under way
        failed = None
        if not p.extra["started_ok"]:
            ok = self._check(p, p.extra["startup"])
            p.extra["started_ok"] = ok is True
            failed = "startup" if ok is False else None
        elif p.liveness is not None and self._check(p, p.liveness) is False:
            failed = "liveness"
        if failed:
            # SIGTERM, SIGKILL after the grace period, off the sync loop (other pods keep syncing);
            # the next pass after the exit restarts it.
            self._note(f"{p.namespace}/{p.name} {failed} probe failed {p.extra.get(failed, p.liveness)['failures']} "
                       "times: restarting")
            p.extra["killing"] = p.proc
            threading.Thread(target=self._kill, args=(p, pod.spec.termination_grace_period_seconds or 30),
                             daemon=True).start()
            return
        if p.probe is not None:
            ready = self._probe(p)
            if ready != p.ready:
                self._patch(p, pod, ready=ready)

    # -- pieces ------------------------------------------------------------------------------

    def _create(self, pod) -> PodProcess:
        c = pod.spec.containers[0]
        ip = self._allocate_ip()
        env = self._env(pod, c, ip)
        argv = [expand(a, env) for a in [*(c.command or ()), *(c.args or ())]]
        if self.runtime is not None:
            p = PodProcess(pod.metadata.namespace, pod.metadata.name, pod.metadata.uid, ip,
                           self.work_dir / f"{pod.metadata.namespace}_{pod.metadata.name}.log", argv, env)
            p.extra["command"] = [expand(a, env) for a in c.command or ()]
            p.extra["args"] = [expand(a, env) for a in c.args or ()]
            return self._probes(p, c, f"{c.image} {' '.join(argv) or '(image entrypoint)'}")
        if not argv:
            raise RuntimeError(f"pod {pod.metadata.name}: no command (the image's entrypoint is not emulated)")
        venv_bin = str(ROOT / ".venv" / "bin")
        exe = shutil.which(argv[0], path=f"{venv_bin}:{env.get('PATH', '')}")
        if exe is None:
            raise RuntimeError(f"pod {pod.metadata.name}: {argv[0]!r} not found")
        argv[0] = exe
        p = PodProcess(pod.metadata.namespace, pod.metadata.name, pod.metadata.uid, ip,
                       self.work_dir / f"{pod.metadata.namespace}_{pod.metadata.name}.log", argv, env)
        return self._probes(p, c, ' '.join([Path(argv[0]).name, *argv[1:]]))

    def _probes(self, p: PodProcess, c, what: str) -> PodProcess:
        p.extra["ports"] = {cp.name: cp.container_port for cp in (c.ports or ()) if cp.name}
        probe = c.readiness_probe
        if probe is not None and probe.http_get is not None:
            p.probe = {"path": probe.http_get.path or "/", "period": probe.period_seconds or 10}
            p.probe_port = self._port(p, probe.http_get.port)
            p.extra["last_probe"] = 0.0
        live, startup = c.liveness_probe, c.startup_probe
        if live is not None and live.http_get is not None:
            p.liveness = self._http_probe(p, live)
        if startup is not None and startup.http_get is not None:
            p.extra["startup"] = self._http_probe(p, startup)
        self._note(f"{p.namespace}/{p.name} -> {p.ip}: {what}")
        return p

    def _http_probe(self, p: PodProcess, probe) -> dict[str, Any]:
        return {"path": probe.http_get.path or "/", "port": self._port(p, probe.http_get.port),
                "period": probe.period_seconds or 10, "delay": probe.initial_delay_seconds or 0,
                "threshold": probe.failure_threshold or 3, "timeout": probe.timeout_seconds or 1,
                "failures": 0, "last": 0.0}

    @staticmethod
    def _port(p: PodProcess, port) -> int:
        return p.extra["ports"][port] if isinstance(port, str) and not port.isdigit() else int(port)

    def _allocate_ip(self) -> str:
        """The next loopback address (127.0.0.2 .. 127.0.0.254, then 127.0.1.2 ...) that nothing
        listens on: another test session on this machine may be playing a kubelet too, and a pod
        given an address already serving would answer with someone else's server."""
        busy = listening_ips()
        while True:
            n = self._next_ip
            self._next_ip += 1
            ip = f"127.0.{n // 253}.{n % 253 + 2}" if n >= 255 else f"127.0.0.{n}"
            if ip not in busy:
                return ip

    def _env(self, pod, c, ip: str) -> dict[str, str]:
        pod_dir = self._pod_dir(pod)
        pod_dir.mkdir(parents=True, exist_ok=True)
        if self.runtime is not None:  # the image's ENV, then the pod's (e2e/containers.py adds the rest)
            env = {}
        else:
            env = {"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin",
                   "HOME": os.environ.get("HOME", "/root"), "HOSTNAME": pod.metadata.name,
                   "PYTHONPATH": str(PODNET), "PDSERVE_KUBELET_POD_IP": ip, "PYTHONUNBUFFERED": "1"}
            for k in ("HF_HOME", "XDG_CACHE_HOME", "TMPDIR", "LANG"):  # the test user's caches (no downloads)
                if k in os.environ:
                    env[k] = os.environ[k]
            if self._automount(pod):
                env["KUBECONFIG"] = str(self._service_account_kubeconfig(pod, pod_dir))
        if ENV_NIXL_PROGRESS_NICE in os.environ:  # the test run's nice for NIXL's progress threads (tests/conftest.py)
            env[ENV_NIXL_PROGRESS_NICE] = os.environ[ENV_NIXL_PROGRESS_NICE]
        fields = {"status.podIP": ip, "status.hostIP": "127.0.0.1", "metadata.name": pod.metadata.name,
                  "metadata.namespace": pod.metadata.namespace, "metadata.uid": pod.metadata.uid,
                  "spec.nodeName": NODE, "spec.serviceAccountName": pod.spec.service_account_name or "default"}
        for e in c.env or ():
            if e.value_from is None:
                env[e.name] = expand(e.value or "", env)
            elif e.value_from.field_ref is not None:
                env[e.name] = fields[e.value_from.field_ref.field_path]
            elif e.value_from.secret_key_ref is not None:
                import base64

                ref = e.value_from.secret_key_ref
                data = self.core.read_namespaced_secret(ref.name, pod.metadata.namespace).data or {}
                env[e.name] = base64.b64decode(data[ref.key]).decode()
            elif e.value_from.config_map_key_ref is not None:
                ref = e.value_from.config_map_key_ref
                env[e.name] = (self.core.read_namespaced_config_map(ref.name, pod.metadata.namespace).data or {})[
                    ref.key
                ]
        return env

    def _automount(self, pod) -> bool:
        """The pod's automountServiceAccountToken, else its ServiceAccount's, else true."""
        if pod.spec.automount_service_account_token is not None:
            return pod.spec.automount_service_account_token
        sa = self.core.read_namespaced_service_account(
            pod.spec.service_account_name or "default", pod.metadata.namespace
        )
        return sa.automount_service_account_token is not False

    def _token(self, pod) -> str:
        """The pod's identity: a bound token for its ServiceAccount (TokenRequest API)."""
        sa = pod.spec.service_account_name or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": 3600 * 24,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod.metadata.name,
                                            "uid": pod.metadata.uid}}}
        return self.core.create_namespaced_service_account_token(sa, pod.metadata.namespace, body).status.token

    def _service_account_kubeconfig(self, pod, pod_dir: Path) -> Path:
        sa = pod.spec.service_account_name or "default"
        token = self._token(pod)
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "pod",
            "clusters": [
                {"name": "cluster", "cluster": {"server": self.server, "certificate-authority": str(self.ca_file)}}
            ],
            "users": [{"name": sa, "user": {"token": token}}],
            "contexts": [
                {"name": "pod", "context": {"cluster": "cluster", "user": sa, "namespace": pod.metadata.namespace}}
            ],
        }
        path = pod_dir / "kubeconfig"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def _spawn(self, p: PodProcess, pod) -> subprocess.Popen:
        if self.runtime is not None:
            from e2e.containers import container_name

            p.container = container_name(pod, p.restarts)
            self.runtime.remove(p.container)  # a leftover of an interrupted run
            pod_dir = self._pod_dir(pod)
            (pod_dir / "oom").unlink(missing_ok=True)  # conmon's marker is this run's alone
            token = self._token(pod) if self._automount(pod) else None
            argv = self.runtime.run_argv(p.container, pod, pod.spec.containers[0], p.extra["command"],
                                         p.extra["args"], p.env, p.ip, pod_dir, token, self.ca_file, self.core)
            # cwd: conmon (podman 4.3, cgroup v1) drops its "oom" marker in its working directory
            with open(p.log_path, "ab") as out:
                return subprocess.Popen(argv, env=self.runtime.env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True, cwd=pod_dir)
        with open(p.log_path, "ab") as out:
            return subprocess.Popen(p.argv, env=p.env, cwd=self.work_dir, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, process_group=0)  # not a session: cli/launcher.py

    def _pod_dir(self, pod) -> Path:
        return self.work_dir / f"{pod.metadata.namespace}_{pod.metadata.name}"

    def _check(self, p: PodProcess, probe: dict[str, Any]) -> bool | None:
        """A liveness or startup probe when due: True on success, False once it failed
        failureThreshold times in a row, None when not due or still under the threshold."""
        now = time.monotonic()
        if now - p.extra["started"] < probe["delay"] or now - probe["last"] < probe["period"]:
            return None
        probe["last"] = now
        try:
            ok = httpx.get(f"http://{p.ip}:{probe['port']}{probe['path']}", timeout=probe["timeout"]).status_code < 400
        except httpx.HTTPError:
            ok = False
        probe["failures"] = 0 if ok else probe["failures"] + 1
        return True if ok else (False if probe["failures"] >= probe["threshold"] else None)

    def _probe(self, p: PodProcess) -> bool:
        now = time.monotonic()
        if p.ready is True and now - p.extra["last_probe"] < min(p.probe["period"], 2):
            return True
        p.extra["last_probe"] = now
        try:
            return self._http.get(f"http://{p.ip}:{p.probe_port}{p.probe['path']}").status_code < 400
        except httpx.HTTPError:
            return False

    def _patch(self, p: PodProcess, pod, ready: bool, waiting: str | None = None) -> None:
        now = _now()
        flag = "True" if ready else "False"
        c = pod.spec.containers[0]
        state = ({"waiting": {"reason": "CrashLoopBackOff", "message": waiting}} if waiting
                 else {"running": {"startedAt": now}})
        status = {
            "phase": "Running", "podIP": p.ip, "podIPs": [{"ip": p.ip}], "hostIP": "127.0.0.1",
            "startTime": (pod.status.start_time.strftime("%Y-%m-%dT%H:%M:%SZ") if pod.status.start_time else now),
            "conditions": [{"type": t, "status": s, "lastTransitionTime": now} for t, s in (
                ("PodScheduled", "True"), ("Initialized", "True"), ("ContainersReady", flag), ("Ready", flag))],
            "containerStatuses": [{"name": c.name, "image": c.image, "imageID": "", "ready": ready,
                                   "restartCount": p.restarts, "started": waiting is None, "state": state,
                                   "lastState": ({"terminated": p.extra["last_terminated"]}
                                                 if "last_terminated" in p.extra else {})}],
        }
        try:
            self.core.patch_namespaced_pod_status(p.name, p.namespace, {"status": status})
            p.ready = ready
            if ready:
                self._note(f"{p.namespace}/{p.name} Ready at {p.ip}")
        except Exception as e:  # deleted meanwhile: the next sync sees it
            log.info("status patch of %s failed: %r", p.name, e)

    def _terminate(self, p: PodProcess, pod, grace_s: float) -> None:
        self._note(f"{p.namespace}/{p.name} terminating (grace {grace_s}s)")
        deadline = time.monotonic() + grace_s
        self._pre_stop(p, pod, grace_s)
        self._kill(p, max(1.0, deadline - time.monotonic()))
        if p.container is not None:
            self.runtime.remove(p.container)
        self._confirm_deletion(pod)
        self.pods.pop(p.uid, None)

    def _pre_stop(self, p: PodProcess, pod, grace_s: float) -> None:
        """The container's preStop hook (exec or httpGet) runs before SIGTERM, within the grace period."""
        hook = (pod.spec.containers[0].lifecycle or None) and pod.spec.containers[0].lifecycle.pre_stop
        if hook is None or p.proc is None or p.proc.poll() is not None:
            return
        try:
            if hook._exec is not None and hook._exec.command:
                self._note(f"{p.namespace}/{p.name} preStop: {' '.join(hook._exec.command)}")
                if p.container is not None:  # inside the container, as a kubelet runs it
                    self.runtime.exec(p.container, list(hook._exec.command), timeout=grace_s)
                else:
                    subprocess.run(hook._exec.command, env=p.env, timeout=grace_s, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
            elif hook.http_get is not None:
                self._note(f"{p.namespace}/{p.name} preStop: GET {hook.http_get.path}")
                port = self._port(p, hook.http_get.port)
                httpx.get(f"http://{p.ip}:{port}{hook.http_get.path or '/'}", timeout=grace_s)
        except Exception as e:  # a failing hook does not stop the termination
            log.info("preStop of %s failed: %r", p.name, e)

    def _kill(self, p: PodProcess, grace_s: float) -> None:
        proc = p.proc
        if proc is None or proc.poll() is not None:
            return
        if p.container is not None:  # SIGTERM to the container's process, SIGKILL after the grace
            self._note(f"{p.namespace}/{p.name} podman stop --time {grace_s:.0f}")
            self.runtime.stop(p.container, grace_s)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._note(f"{p.namespace}/{p.name} SIGKILL after {grace_s}s")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def _confirm_deletion(self, pod) -> None:
        from kubernetes.client import V1DeleteOptions, V1Preconditions

        try:
            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, body=V1DeleteOptions(
                grace_period_seconds=0, preconditions=V1Preconditions(uid=pod.metadata.uid)))
        except Exception:  # already gone
            pass

    def _note(self, line: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} kubelet: {line}")
        log.info(line)

    def running(self) -> list[PodProcess]:
        return [p for p in list(self.pods.values()) if p.proc is not None and p.proc.poll() is None]
