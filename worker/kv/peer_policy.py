"""Which KV peers (host and port) a decode worker may pull from (`--kv-peer-allow`).

kv_transfer_params come from a request body: without a check, a forged body could make a
worker connect anywhere (SSRF) or tie up its pulls on hosts that never answer. Default:
nobody (a decode worker refuses to start without entries: worker/config/engine.py). A deployment
declares its prefill workers: the local stack passes loopback and each prefill worker's KV
port, the operator the prefill pods' CIDRs and the KV ports of their tensor-parallel ranks.
Entries are CIDRs (an address is a /32 or /128) or exact host names, optionally with ports
(protocol/kv_peers.py); a name not listed is refused without a DNS lookup, so a forged name
cannot make the worker query a resolver the attacker controls. An entry without ports allows
every port of its hosts: the worker warns at startup.
"""

from __future__ import annotations

import ipaddress

from pdserve.protocol.kv_peers import parse_peer

Ports = tuple[int, int] | None  # None: any port


class PeerNotAllowed(PermissionError):
    pass


class PeerPolicy:
    def __init__(self, allow: tuple[str, ...] = ()):
        self.networks: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, Ports]] = []
        self.hosts: list[tuple[str, Ports]] = []
        for item in allow:
            peer, ports = parse_peer(item)
            try:
                self.networks.append((ipaddress.ip_network(peer, strict=False), ports))
            except ValueError:
                self.hosts.append((peer.lower(), ports))

    @property
    def empty(self) -> bool:
        return not self.networks and not self.hosts

    def any_port(self) -> list[str]:
        """Entries that allow every port of their hosts (worth a warning: see the module doc)."""
        return [str(p) for p, ports in self.networks + self.hosts if ports is None]

    def check(self, host: str, port: int) -> str:
        """Return the address to connect to, or raise PeerNotAllowed."""
        if self.empty:
            raise PeerNotAllowed(f"KV peer {host!r} refused: this worker pulls from no one (--kv-peer-allow is empty)")
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            addr = None
        if addr is None:
            matched = [ports for name, ports in self.hosts if name == host.lower()]
            if not matched:
                raise PeerNotAllowed(f"KV peer {host!r} is not an address and not a host named in --kv-peer-allow")
        else:
            matched = [ports for net, ports in self.networks if addr.version == net.version and addr in net]
            if not matched:
                raise PeerNotAllowed(f"KV peer {host} is not in --kv-peer-allow")
        if not any(ports is None or ports[0] <= port <= ports[1] for ports in matched):
            raise PeerNotAllowed(f"KV peer {host} port {port} is not a port --kv-peer-allow allows for that host")
        return host if addr is None else str(addr)
