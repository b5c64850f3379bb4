"""What a worker exposes when the deployment says little (issue 23 items 3 and 4), on real
`pdserve worker` processes: a bare worker listens on loopback only; one asked to serve KV beyond
loopback without a secret, or to decode with no peer to pull from, refuses to start and says
which flag is missing (exit 2, as for any bad flag)."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys

import httpx
import pytest

from pdserve.protocol.contract import ENV_API_KEYS, ENV_KV_SECRET
from tests.net import free_port
from tests.worker.test_server_harness import WorkerProcess

SMALL = ("--max-model-len", "128", "--kv-cache-memory", str(1 << 22))
# A worker that starts instead of refusing serves until killed: this bounds the test, not a timing.
START_BOUND_S = 120


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (ENV_KV_SECRET, ENV_API_KEYS)}


def listening_addresses(port: int) -> set[str]:
    """The local addresses sockets LISTEN on at `port` (Linux /proc/net/tcp and tcp6)."""
    found = set()
    for path, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hexport = fields[1].split(":")
            if fields[3] != "0A" or int(hexport, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(str(ipaddress.ip_address(raw)))
    return found


def non_loopback_ipv4() -> list[str]:
    """This machine's own non-loopback IPv4 addresses (another host would reach us on these)."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return []
    return [a for a in out if ipaddress.ip_address(a).version == 4 and not ipaddress.ip_address(a).is_loopback]


def run_worker(ckpt, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", "worker", "--model", str(ckpt), "--device", "cpu",
                           "--port", str(free_port()), "--kv-port", str(free_port()), *SMALL, *args],
                          capture_output=True, text=True, timeout=START_BOUND_S, env=clean_env())


def test_a_bare_worker_listens_on_loopback_only(tiny_checkpoint):
    """Issue 23 item 4: `pdserve worker` with no --host, no key and no secret (here a prefill
    worker, which serves the KV side channel) binds HTTP and KV to 127.0.0.1: from this machine's
    other addresses both ports refuse connections, while loopback serves."""
    kv_port = free_port()
    with WorkerProcess(tiny_checkpoint("llama"), *SMALL, "--role", "prefill", "--kv-transfer", "tcp", "--kv-port",
                       str(kv_port), host=None, env=clean_env()) as w:
        assert httpx.get(f"{w.url}/debug/kv", timeout=10).status_code == 200  # loopback serves (no key set)
        for port in (w.port, kv_port):
            assert listening_addresses(port) == {"127.0.0.1"}, (port, listening_addresses(port))
        for address in non_loopback_ipv4():  # none on a machine without a network: the check above stands
            for port in (w.port, kv_port):
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection((address, port), timeout=10).close()


@pytest.mark.parametrize("args", [("--host", "0.0.0.0"), ("--kv-host", "0.0.0.0"), ("--kv-host", "192.0.2.9")],
                         ids=["host", "kv-host", "kv-host-address"])
def test_serving_kv_beyond_loopback_needs_a_secret(tiny_checkpoint, args):
    """Issue 23 item 4: a worker that would serve its KV side channel on the network without
    --kv-secret refuses to start and names the flag (the operator and `pdserve up` always pass
    a secret: tests/operator/test_production_builders.py::test_worker_accepts_the_args_as_built)."""
    r = run_worker(tiny_checkpoint("llama"), "--role", "prefill", "--kv-transfer", "tcp", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--kv-secret" in r.stderr and ENV_KV_SECRET in r.stderr and "Traceback" not in r.stderr


def test_a_decode_worker_with_no_peer_to_pull_from_refuses_to_start(tiny_checkpoint):
    """Issue 23 item 3: without --kv-peer-allow a decode worker could pull from no one and
    answered every P/D request with a 400 blaming kv_transfer_params, a field the client never
    sent. The mistake is the deployment's: it is refused at start, naming the flag."""
    r = run_worker(tiny_checkpoint("llama"), "--role", "decode", "--kv-transfer", "tcp")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--kv-peer-allow" in r.stderr and "Traceback" not in r.stderr


def test_what_may_start_without_a_secret_or_peers():
    """The other side of the two refusals, without starting engines: a decode worker (no KV
    side channel) may listen on 0.0.0.0 without a secret; a prefill worker may with one; a
    prefill worker needs no peers."""
    import argparse

    from pdserve.worker.server.main import add_arguments, configs_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def configs(*argv, environ=None):
        return configs_from_args(parser.parse_args(list(argv)), environ=environ or {})

    engine, server = configs("--role", "decode", "--host", "0.0.0.0", "--kv-peer-allow", "10.0.0.0/8:5600")
    assert server.host == "0.0.0.0" and engine.kv_peer_allow == ("10.0.0.0/8:5600",)
    engine, _ = configs("--role", "prefill", "--host", "0.0.0.0", environ={ENV_KV_SECRET: "s" * 32})
    assert engine.kv_listen_host == "0.0.0.0" and engine.serves_kv
    engine, server = configs("--role", "prefill")
    assert server.host == "127.0.0.1" and engine.kv_listen_host == "127.0.0.1"
