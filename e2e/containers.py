"""A pod's container as a podman (runc) container of its image, for the kubelet stand-in.

e2e/kubelet.py decides *when* a container runs (sync, restarts, probes, deletion); this file
says *how*: the podman command line a real kubelet's container runtime would amount to.

- image: the pod's image from podman's local storage (`--pull never`: the test tags the image it
  built under the name the operator and chart write, as `kind load` does for a kind cluster);
- command/args: `command` replaces the image's ENTRYPOINT and `args` its CMD, as in Kubernetes;
- env: only the pod's (value, fieldRef, secretKeyRef, configMapKeyRef resolved by the kubelet),
  over the image's own ENV; the ServiceAccount token projected at
  /var/run/secrets/kubernetes.io/serviceaccount with KUBERNETES_SERVICE_HOST/PORT, so clients
  use in-cluster credentials as in a real pod;
- securityContext (pod, then container): runAsUser/runAsGroup, fsGroup as a supplementary
  group, runAsNonRoot refused for a root user, allowPrivilegeEscalation=false as
  no_new_privileges, capabilities drop/add, readOnlyRootFilesystem (podman's extra tmpfs on
  /tmp, /run is turned off: a real kubelet adds none); podman's default seccomp profile
  (RuntimeDefault);
- volumes: emptyDir on disk as a per-pod directory owned by fsGroup, emptyDir medium Memory as
  a tmpfs of its sizeLimit (/dev/shm as the container's shm size), persistentVolumeClaim as its
  bound PersistentVolume's hostPath, secret/configMap as files;
- resources.limits: memory and cpu as the container's cgroup limits (a container over its
  memory limit is OOM-killed by the kernel; `oom_killed` reads it back).

Not emulated: the pod network namespace (containers share the host's network, and
e2e/podnet narrows wildcard binds to the pod's own 127.0.0.x address as in process mode),
image pulls, init and sidecar containers, emptyDir sizeLimit on disk.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

PODNET = Path(__file__).resolve().parent / "podnet"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
CONTAINERS_CONF = Path(__file__).resolve().parents[1] / ".ci" / "containers.conf"
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_bytes(q: str | int) -> int:
    """A Kubernetes memory quantity ("512Mi", "1G", "1e9", 1000) in bytes."""
    m = re.fullmatch(r"([0-9.e+]+)([kMGT]i?|)", str(q))
    if not m:
        raise ValueError(f"unsupported quantity {q!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def quantity_cpus(q: str | int) -> float:
    s = str(q)
    return int(s[:-1]) / 1000 if s.endswith("m") else float(s)


class PodSpecError(RuntimeError):
    """What a kubelet reports as CreateContainerConfigError: the pod cannot start as written."""


@dataclass
class PodmanRuntime:
    """Runs containers through podman with runc (CONTAINERS_CONF: .ci/containers.conf)."""

    api_host: str  # where in-cluster clients reach the API server (host network: loopback)
    api_port: int
    env: dict[str, str] = field(default_factory=lambda: {
        **os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))})

    def podman(self, *args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
        out = subprocess.run(["podman", *args], capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"podman {args[0]} failed: {out.stderr.strip()[-800:]}")
        return out

    # -- the command line -------------------------------------------------------------------

    def run_argv(self, name: str, pod, c, command: list[str], args: list[str], env: dict[str, str], ip: str,
                 pod_dir: Path, token: str | None, ca_file: Path, core) -> list[str]:
        """`podman run` for container `c` of `pod` (foreground: the kubelet watches the process);
        `command`/`args` are c's with $(VAR) already expanded."""
        argv = ["podman", "run", "--name", name, "--pull", "never", "--network", "host"]
        argv += self._security(pod, c)
        argv += self._resources(c)
        argv += self._volumes(pod, c, pod_dir, core)
        if token is not None:
            sa = pod_dir / "serviceaccount"
            sa.mkdir(exist_ok=True)
            (sa / "token").write_text(token)
            (sa / "namespace").write_text(pod.metadata.namespace)
            shutil.copyfile(ca_file, sa / "ca.crt")
            for f in sa.iterdir():
                f.chmod(0o644)
            argv += ["--volume", f"{sa}:{SA_DIR}:ro",
                     "--env", f"KUBERNETES_SERVICE_HOST={self.api_host}",
                     "--env", f"KUBERNETES_SERVICE_PORT={self.api_port}"]
        # The pod's network namespace, emulated (see e2e/podnet): wildcard binds -> the pod IP.
        argv += ["--volume", f"{PODNET}:/podnet:ro", "--env", "PYTHONPATH=/podnet",
                 "--env", f"PDSERVE_KUBELET_POD_IP={ip}", "--env", f"HOSTNAME={pod.metadata.name}"]
        for k, v in env.items():
            argv += ["--env", f"{k}={v}"]
        if command:  # replaces ENTRYPOINT, and CMD with it (args or nothing), as in Kubernetes
            argv += ["--entrypoint", json.dumps(command)]
        argv.append(c.image)
        argv += args
        return argv

    def _security(self, pod, c) -> list[str]:
        psc, csc = pod.spec.security_context, c.security_context

        def pick(attr: str):
            v = getattr(csc, attr, None) if csc is not None else None
            return v if v is not None else (getattr(psc, attr, None) if psc is not None else None)

        uid, gid, non_root = pick("run_as_user"), pick("run_as_group"), pick("run_as_non_root")
        if uid is None:
            user = self.podman("image", "inspect", "--format", "{{.Config.User}}", c.image).stdout.strip()
            uid = int(user.split(":")[0]) if user.split(":")[0].isdigit() else (0 if user in ("", "root") else None)
        if non_root and uid in (0, None):
            raise PodSpecError(f"container {c.name} has runAsNonRoot and image will run as root")
        out = []
        if uid is not None:
            out += ["--user", f"{uid}:{gid if gid is not None else uid}"]
        fs_group = getattr(psc, "fs_group", None) if psc is not None else None
        if fs_group is not None:
            out += ["--group-add", str(fs_group)]
        if csc is not None:
            if csc.allow_privilege_escalation is False:
                out += ["--security-opt", "no-new-privileges"]
            caps = csc.capabilities
            for cap in (caps.drop or ()) if caps else ():
                out += ["--cap-drop", cap]
            for cap in (caps.add or ()) if caps else ():
                out += ["--cap-add", cap]
            if csc.read_only_root_filesystem:
                out += ["--read-only", "--read-only-tmpfs=false"]
            if csc.privileged:
                raise PodSpecError(f"container {c.name}: privileged containers are not run here")
        return out

    @staticmethod
    def _resources(c) -> list[str]:
        limits = (c.resources.limits if c.resources else None) or {}
        out = []
        if "memory" in limits:
            mem = quantity_bytes(limits["memory"])
            out += ["--memory", str(mem), "--memory-swap", str(mem)]  # no swap: over the limit is an OOM kill
        if "cpu" in limits:
            out += ["--cpus", str(quantity_cpus(limits["cpu"]))]
        return out

    def _volumes(self, pod, c, pod_dir: Path, core) -> list[str]:
        psc = pod.spec.security_context
        fs_group = getattr(psc, "fs_group", None) if psc is not None else None
        by_name = {v.name: v for v in pod.spec.volumes or ()}
        out = []
        for m in c.volume_mounts or ():
            v = by_name.get(m.name)
            if v is None:
                raise PodSpecError(f"volumeMount {m.name!r}: no such volume")
            mode = "ro" if m.read_only else "rw"
            if v.empty_dir is not None:
                size = v.empty_dir.size_limit
                if v.empty_dir.medium == "Memory":
                    if m.mount_path == "/dev/shm":
                        out += ["--shm-size", str(quantity_bytes(size)) if size else "64m"]
                    else:
                        opts = f"rw,mode=1777{',size=' + str(quantity_bytes(size)) if size else ''}"
                        out += ["--tmpfs", f"{m.mount_path}:{opts}"]
                    continue
                host = pod_dir / "volumes" / v.name
                host.mkdir(parents=True, exist_ok=True)
                if fs_group is not None:  # fsGroup owns the volume, group-writable (setgid), as a kubelet does
                    os.chown(host, 0, fs_group)
                    host.chmod(0o2775)
                else:
                    host.chmod(0o777)
                out += ["--volume", f"{host}:{m.mount_path}:{mode}"]
            elif v.persistent_volume_claim is not None:
                claim = v.persistent_volume_claim
                mode = "ro" if m.read_only or claim.read_only else "rw"
                out += ["--volume", f"{self._claim_path(pod, claim.claim_name, core)}:{m.mount_path}:{mode}"]
            elif v.secret is not None or v.config_map is not None:
                host = pod_dir / "volumes" / v.name
                host.mkdir(parents=True, exist_ok=True)
                if v.secret is not None:
                    data = {
                        k: base64.b64decode(b)
                        for k, b in (
                            core.read_namespaced_secret(v.secret.secret_name, pod.metadata.namespace).data or {}
                        ).items()
                    }
                else:
                    data = {
                        k: s.encode()
                        for k, s in (
                            core.read_namespaced_config_map(v.config_map.name, pod.metadata.namespace).data or {}
                        ).items()
                    }
                for k, b in data.items():
                    (host / k).write_bytes(b)
                    (host / k).chmod(0o644)
                host.chmod(0o755)
                out += ["--volume", f"{host}:{m.mount_path}:ro"]
            else:
                raise PodSpecError(f"volume {v.name!r}: only emptyDir, persistentVolumeClaim (hostPath PV), "
                                   "secret and configMap are run here")
        return out

    @staticmethod
    def _claim_path(pod, claim: str, core) -> str:
        pvc = core.read_namespaced_persistent_volume_claim(claim, pod.metadata.namespace)
        if pvc.status.phase != "Bound" or not pvc.spec.volume_name:
            raise PodSpecError(f"persistentVolumeClaim {claim!r} is not bound")
        pv = core.read_persistent_volume(pvc.spec.volume_name)
        if pv.spec.host_path is None:
            raise PodSpecError(f"PersistentVolume {pv.metadata.name}: only hostPath volumes are run here")
        return pv.spec.host_path.path

    # -- a running container ----------------------------------------------------------------

    def stop(self, name: str, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after the grace period (podman stop does both)."""
        self.podman("stop", "--time", str(max(0, int(round(grace_s)))), name, timeout=grace_s + 60)

    def exec(self, name: str, command: list[str], timeout: float) -> int:
        return self.podman("exec", name, *command, timeout=timeout).returncode

    def oom_killed(self, name: str, workdir: Path | None = None) -> bool:
        """Whether the kernel's OOM killer ended the container, by its memory cgroup's limit.
        podman's own flag stays false on this cgroup v1 host: conmon (podman 4.3) writes its "oom"
        marker into its working directory (`workdir`, where `podman run` was started) instead of
        where podman looks. That marker comes from the cgroup's own OOM notification; the kernel
        log is read as well, as a kubelet's OOM watcher (cAdvisor) does (its kill line names the
        container's cgroup), though the kernel rate-limits that line (10 in 5 s)."""
        if workdir is not None and (workdir / "oom").exists():  # the kubelet removes it before each run
            return True
        out = self.podman("inspect", "--format", "{{.State.OOMKilled}} {{.Id}}", name).stdout.split()
        if not out:
            return False
        if out[0] == "true":
            return True
        log = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
        return any("oom-kill:" in line and "oom_memcg=" in line and f"libpod-{out[1]}" in line
                   for line in log.splitlines())

    def remove(self, name: str) -> None:
        self.podman("rm", "--force", "--volumes", "--time", "0", name)  # and the image's anonymous /cache


def podman_unusable() -> str | None:
    """Why podman cannot run containers here, or None."""
    missing = [t for t in ("podman", "runc", "mmdebstrap") if shutil.which(t) is None]
    if missing:
        return (f"{', '.join(missing)} not installed: the image build needs podman with runc and mmdebstrap "
                "(.ci/run installs them with apt, best effort; Debian: apt-get install podman runc mmdebstrap)")
    env = {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))}
    out = subprocess.run(["podman", "info"], capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0:
        return f"podman cannot run here: `podman info` failed: {out.stderr.strip()[-500:]}"
    return None


def build_image() -> str:
    """The repository's Dockerfile built as CI builds it (.ci/build_image.sh); its name."""
    env = {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))}
    out = subprocess.run([str(CONTAINERS_CONF.parent / "build_image.sh")], capture_output=True, text=True, env=env,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"image build failed:\n{out.stderr[-6000:]}")
    return out.stdout.strip().splitlines()[-1]


def container_name(pod, restarts: int) -> str:
    """k8s_<container>_<pod>_<namespace>_<uid>_<attempt>, as dockershim named them."""
    c = pod.spec.containers[0]
    return f"k8s_{c.name}_{pod.metadata.name}_{pod.metadata.namespace}_{pod.metadata.uid[:8]}_{restarts}"


