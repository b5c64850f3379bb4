"""Free loopback ports for the benchmarks' own processes (a prefill side, a decode side).

A port is chosen here and bound seconds later by a child process. Ports come from below the
kernel's ephemeral range, where outgoing connections take their source ports (a busy machine's
HTTP clients would otherwise hold the very port the child is about to bind), at random, and never
twice from one process.
"""

from __future__ import annotations

import random
import socket

_FLOOR = 10000  # below: well-known and registered services
_rng = random.SystemRandom()
_handed_out: set[int] = set()


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections' source ports)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n: int = 1) -> int:
    """The first of n consecutive loopback ports that nothing listens on now (a TP=n prefill
    worker serves rank r on --kv-port + r; a bench's decode side listens on the prefill's + 1)."""
    high = max(_FLOOR + 2 * n, ephemeral_low() - n)
    for _ in range(2000):
        p = _rng.randrange(_FLOOR, high)
        ports = range(p, p + n)
        if not any(q in _handed_out for q in ports) and all(bindable(q) for q in ports):
            _handed_out.update(ports)
            return p
    raise RuntimeError(f"no {n} consecutive free loopback ports")
