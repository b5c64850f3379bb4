"""A free TCP port for a test process to listen on (the one definition every test imports)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now. Another process could take it before the caller
    binds it; tests accept that small race for the simplicity of passing ports on command lines."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
