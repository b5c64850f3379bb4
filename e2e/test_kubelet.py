"""The kubelet stand-in's own pieces, without a cluster: Kubernetes' $(VAR) expansion and the
per-pod network emulation (two "pods" both listening on one port of their own address)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

from e2e.kubelet import PODNET, expand


def test_expand_follows_kubernetes_rules():
    env = {"POD_IP": "127.0.0.7", "PORT": "8000"}
    assert expand("--host=$(POD_IP):$(PORT)", env) == "--host=127.0.0.7:8000"
    assert expand("$(MISSING) stays", env) == "$(MISSING) stays"
    assert expand("$$(POD_IP) is escaped", env) == "$(POD_IP) is escaped"


def _listen_as_pod(ip: str, port: int) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import socket, sys, zmq
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", {port})); s.listen()
        z = zmq.Context().socket(zmq.PUB); z.bind("tcp://*:{port + 1}")
        print(s.getsockname()[0], z.LAST_ENDPOINT.decode(), flush=True)
        sys.stdin.read()
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(PODNET), "PDSERVE_KUBELET_POD_IP": ip})


def test_wildcard_binds_land_on_the_pod_ip():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pods = [_listen_as_pod(ip, port) for ip in ("127.0.0.201", "127.0.0.202")]
    try:
        lines = [p.stdout.readline().split() for p in pods]
        assert lines == [["127.0.0.201", f"tcp://127.0.0.201:{port + 1}"],
                         ["127.0.0.202", f"tcp://127.0.0.202:{port + 1}"]]
        for ip in ("127.0.0.201", "127.0.0.202"):
            socket.create_connection((ip, port), timeout=5).close()
    finally:
        for p in pods:
            p.kill()
            p.wait()


def test_pod_addresses_skip_ones_already_serving():
    """Another session's kubelet stand-in may hold 127.0.0.x: a pod never gets a busy address."""
    from e2e.kubelet import Kubelet, listening_ips

    with socket.socket() as s:
        s.bind(("127.0.0.3", 0))
        s.listen()
        assert "127.0.0.3" in listening_ips()
        k = Kubelet.__new__(Kubelet)
        k._next_ip = 3
        assert k._allocate_ip() != "127.0.0.3"
