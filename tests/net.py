"""A free TCP port for a test process to listen on (the one definition every test imports)."""

from __future__ import annotations

import random
import socket

from pdserve.bench.ports import bindable, ephemeral_low

_FLOOR = 10000  # below: well-known and registered services
_rng = random.SystemRandom()  # not the `random` module's state, which a test may seed (same ports in two processes)
_handed_out: set[int] = set()  # this process's ports so far: never the same one twice


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port nothing listens on right now, and not one handed out before by this process (with
    `span`, the first of that many such ports in a row: a server that also binds port + 1).

    The caller binds it later (a child process, seconds on). Two races are closed: a port from
    the kernel's bind(0) could come back from the very next bind(0) (a test asks for an HTTP and
    a KV port at once, then starts both processes), and outgoing connections take their source
    ports from the same (ephemeral) range, so one could hold it when the child binds. Ports come
    from below that range, and are never repeated. What is left: another process on the machine
    taking the same port in that window."""
    low = ephemeral_low()
    def take(port: int) -> bool:
        ports = range(port, port + span)
        if port + span > 65536 or any(q in _handed_out for q in ports) or not all(bindable(q, host) for q in ports):
            return False
        _handed_out.update(ports)
        return True

    if low - _FLOOR >= 2000:
        for _ in range(1000):
            if take(port := _rng.randrange(_FLOOR, low - span + 1)):
                return port
    for _ in range(1000):  # a machine whose ephemeral range starts low: the kernel's choice, unrepeated
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if take(port):
            return port
    raise RuntimeError("no free loopback port")
