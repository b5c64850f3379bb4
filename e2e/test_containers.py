"""The container runtime of the kubelet stand-in (e2e/containers.py), without a cluster: a pod
spec as the operator writes it becomes the podman command line a kubelet's runtime amounts to.
(e2e/test_k8s_stack.py[container] runs those command lines for real.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client

from e2e.containers import PodmanRuntime, PodSpecError, quantity_bytes, quantity_cpus


def test_quantities():
    assert quantity_bytes("512Mi") == 512 * 2**20
    assert quantity_bytes("1G") == 10**9
    assert quantity_bytes("1e3") == 1000
    assert quantity_bytes(4096) == 4096
    assert quantity_cpus("500m") == 0.5 and quantity_cpus("2") == 2.0
    with pytest.raises(ValueError):
        quantity_bytes("lots")


def worker_pod(**container) -> client.V1Pod:
    c = dict(name="worker", image="ghcr.io/pdserve/pdserve:0.1.0", args=["worker", "--port", "8000"],
             security_context=client.V1SecurityContext(allow_privilege_escalation=False, read_only_root_filesystem=True,
                                                       capabilities=client.V1Capabilities(drop=["ALL"])),
             resources=client.V1ResourceRequirements(limits={"memory": "150Mi", "cpu": "500m"}),
             volume_mounts=[client.V1VolumeMount(name="tmp", mount_path="/tmp"),
                            client.V1VolumeMount(name="shm", mount_path="/dev/shm"),
                            client.V1VolumeMount(name="scratch", mount_path="/scratch")])
    c.update(container)
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name="p", namespace="ns", uid="0123456789"),
        spec=client.V1PodSpec(
            security_context=client.V1PodSecurityContext(
                run_as_user=1000, run_as_group=1000, fs_group=1000, run_as_non_root=True
            ),
            volumes=[
                client.V1Volume(name="tmp", empty_dir=client.V1EmptyDirVolumeSource()),
                client.V1Volume(name="shm", empty_dir=client.V1EmptyDirVolumeSource(medium="Memory", size_limit="1Gi")),
                client.V1Volume(
                    name="scratch", empty_dir=client.V1EmptyDirVolumeSource(medium="Memory", size_limit="64Mi")
                ),
            ],
            containers=[client.V1Container(**c)],
        ),
    )


def argv_of(pod: client.V1Pod, tmp_path: Path, command=(), args=None) -> list[str]:
    rt = PodmanRuntime(api_host="127.0.0.1", api_port=6443)
    c = pod.spec.containers[0]
    return rt.run_argv("k8s_x", pod, c, list(command), list(c.args or []) if args is None else args,
                       {"POD_IP": "127.0.0.9"}, "127.0.0.9", tmp_path, None, tmp_path / "ca.crt", core=None)


def test_pod_spec_to_podman_run(tmp_path, monkeypatch):
    monkeypatch.setattr("os.chown", lambda *a: None)  # fsGroup ownership needs root; the mode is checked
    argv = argv_of(worker_pod(), tmp_path)
    joined = " ".join(argv)
    # securityContext
    assert "--user 1000:1000" in joined and "--group-add 1000" in joined
    assert "--security-opt no-new-privileges" in joined and "--cap-drop ALL" in joined
    assert "--read-only --read-only-tmpfs=false" in joined  # no tmpfs a kubelet would not add
    # limits as cgroup limits, no swap above the memory limit
    assert f"--memory {150 * 2**20} --memory-swap {150 * 2**20}" in joined and "--cpus 0.5" in joined
    # emptyDirs: on disk (fsGroup-owned, setgid), /dev/shm as the shm size, Memory as a sized tmpfs
    assert f"--volume {tmp_path}/volumes/tmp:/tmp:rw" in joined
    assert (tmp_path / "volumes" / "tmp").stat().st_mode & 0o7777 == 0o2775
    assert f"--shm-size {2**30}" in joined
    assert f"--tmpfs /scratch:rw,mode=1777,size={64 * 2**20}" in joined
    # env: only the pod's, plus the emulated pod network
    assert "--env POD_IP=127.0.0.9" in joined and "--env PDSERVE_KUBELET_POD_IP=127.0.0.9" in joined
    # no command: the image's ENTRYPOINT runs with the pod's args in place of CMD
    assert "--entrypoint" not in argv
    assert argv[-4:] == ["ghcr.io/pdserve/pdserve:0.1.0", "worker", "--port", "8000"]


def test_command_replaces_the_entrypoint(tmp_path, monkeypatch):
    monkeypatch.setattr("os.chown", lambda *a: None)
    argv = argv_of(worker_pod(command=["python", "-c"], args=["print(1)"]), tmp_path,
                   command=["python", "-c"], args=["print(1)"])
    assert argv[argv.index("--entrypoint") + 1] == '["python", "-c"]'
    assert argv[-2:] == ["ghcr.io/pdserve/pdserve:0.1.0", "print(1)"]


def test_run_as_non_root_refuses_root(tmp_path):
    pod = worker_pod()
    pod.spec.security_context.run_as_user = 0
    with pytest.raises(PodSpecError, match="runAsNonRoot"):
        argv_of(pod, tmp_path)


def test_unsupported_volume_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr("os.chown", lambda *a: None)
    pod = worker_pod()
    pod.spec.volumes[0] = client.V1Volume(name="tmp", host_path=client.V1HostPathVolumeSource(path="/"))
    with pytest.raises(PodSpecError, match="volume 'tmp'"):
        argv_of(pod, tmp_path)
