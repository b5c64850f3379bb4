"""`--kv-peer-allow` entries: which KV peers (host and port) a decode worker may contact.

An entry is a peer, optionally followed by the ports it may be reached on:

  10.0.0.0/8               any port of these addresses
  10.0.0.0/8:5600-5607     only ports 5600..5607 (a prefill worker of TP size 8 on --kv-port 5600)
  prefill-0.svc:5600       an exact host name, one port
  [fd00::/8]:5600-5603     IPv6: brackets around the peer when ports follow

A peer is a CIDR (an address is a /32 or /128) or an exact host name. The worker parses the
entries (worker/kv/peer_policy.py); the operator and `pdserve up` write them, adding the KV
ports of the prefill workers they start, so params naming an allowed host but another port
(a port an attacker listens on, say) are refused. Shared here so writer and reader agree.
"""

from __future__ import annotations

import ipaddress
import re

_PORTS = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?")


def parse_peer(entry: str) -> tuple[str, tuple[int, int] | None]:
    """(peer, (first port, last port) or None for any port). ValueError says what is wrong."""
    if not entry or any(c.isspace() for c in entry):
        raise ValueError(f"{entry!r} is not a peer (a CIDR or host name, optionally :PORT or :FIRST-LAST)")
    ports = None
    if entry.startswith("["):
        m = re.fullmatch(r"\[([^\]]+)\](?::(.*))?", entry)
        if m is None:
            raise ValueError(f"{entry!r}: expected [IPv6 address or CIDR]:PORTS")
        peer, spec = m.group(1), m.group(2)
        if spec is not None:
            ports = _parse_ports(entry, spec)
    elif entry.count(":") == 1:  # host:ports (an IPv6 peer without ports has several colons)
        peer, spec = entry.split(":")
        ports = _parse_ports(entry, spec)
    else:
        peer = entry
    try:
        ipaddress.ip_network(peer, strict=False)
    except ValueError:
        if not peer or "/" in peer or ":" in peer:
            raise ValueError(f"{entry!r}: {peer!r} is neither a CIDR nor a host name") from None
    return peer, ports


def _parse_ports(entry: str, spec: str) -> tuple[int, int]:
    m = _PORTS.fullmatch(spec)
    first, last = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not (m and 1 <= first <= last <= 65535):
        raise ValueError(f"{entry!r}: ports must be PORT or FIRST-LAST within 1..65535, got {spec!r}")
    return first, last


def with_ports(entry: str, first: int, last: int) -> str:
    """`entry` limited to ports first..last, unless it names its own ports already."""
    peer, ports = parse_peer(entry)
    if ports is not None:
        return entry
    spec = str(first) if first == last else f"{first}-{last}"
    return f"[{peer}]:{spec}" if ":" in peer else f"{peer}:{spec}"
