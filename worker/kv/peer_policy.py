"""Which hosts a decode worker may pull KV from (`--kv-peer-allow`).

kv_transfer_params come from a request body: without a check, a forged body could make a
worker connect anywhere (SSRF) or tie up its pulls on hosts that never answer. Default:
nobody. A deployment declares its prefill workers: the local stack passes loopback, the
operator the prefill pods' CIDR. Entries are CIDRs (an address is a /32 or /128) or exact
host names; a name not listed is refused without a DNS lookup, so a forged name cannot make
the worker query a resolver the attacker controls.
"""

from __future__ import annotations

import ipaddress


class PeerNotAllowed(PermissionError):
    pass


class PeerPolicy:
    def __init__(self, allow: tuple[str, ...] = ()):
        self.networks = []
        self.hosts = set()
        for item in allow:
            try:
                self.networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                self.hosts.add(item.lower())

    def check(self, host: str) -> str:
        """Return the address to connect to, or raise PeerNotAllowed."""
        if not self.networks and not self.hosts:
            raise PeerNotAllowed(f"KV peer {host!r} refused: this worker pulls from no one (--kv-peer-allow is empty)")
        if host.lower() in self.hosts:
            return host
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            raise PeerNotAllowed(f"KV peer {host!r} is not an address and not a host named in "
                                 f"--kv-peer-allow") from None
        if any(addr in n for n in self.networks):
            return str(addr)
        raise PeerNotAllowed(f"KV peer {host} is not in --kv-peer-allow")
