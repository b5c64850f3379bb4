"""Which hosts a decode worker may pull KV from.

kv_transfer_params come from a request body: without a check, a forged body could make a
worker connect anywhere. Default: loopback and the private ranges pod networks use.
"""

from __future__ import annotations

import ipaddress
import socket

DEFAULT_ALLOW = ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")


class PeerNotAllowed(PermissionError):
    pass


class PeerPolicy:
    def __init__(self, allow: tuple[str, ...] = ()):
        self.networks = []
        self.hosts = set()
        for item in allow or DEFAULT_ALLOW:
            try:
                self.networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                self.hosts.add(item.lower())

    def check(self, host: str) -> str:
        """Return the address to connect to, or raise PeerNotAllowed."""
        if host.lower() in self.hosts:
            return host
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            try:
                addr = ipaddress.ip_address(socket.gethostbyname(host))
            except (OSError, ValueError) as e:
                raise PeerNotAllowed(f"KV peer {host!r} does not resolve") from e
        if any(addr in n for n in self.networks):
            return str(addr)
        raise PeerNotAllowed(f"KV peer {host} is not in --kv-peer-allow")
