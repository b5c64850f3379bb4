"""Side-channel authentication: every message carries an HMAC-SHA256 under a shared secret.

The prefill and decode workers of one deployment share `--kv-secret` (in Kubernetes: an env
var from a Secret). Each request is `[op, body, mac]`, where the body carries a wall-clock
timestamp and a random nonce and `mac = HMAC(secret, "req" | op | body)`. The server checks
the MAC in constant time, refuses timestamps that are not finite or more than `WINDOW_S` away
from its clock, and refuses a nonce it has seen while its timestamp is still acceptable (so a
captured message cannot be replayed: a nonce is remembered until `WINDOW_S` after the later of
its timestamp and its arrival, so a message dated ahead of our clock is not forgotten while it
is still fresh).
Replies carry `HMAC(secret, "rep" | request nonce | status | payload)`, so the client knows
the answer came from a holder of the secret and belongs to its own request.

What this does not give: confidentiality. Bodies and KV bytes cross the network in clear;
the deployment isolates KV ports (NetworkPolicy) or runs on a trusted fabric. Bulk reply
frames and the block bytes of TCP data connections are not MACed: hashing every KV byte would
cost more than the copy.

With no secret configured, requests are unsigned and the server accepts them; a worker warns
at startup, and what such a channel still protects (transfer tokens, prompt binding, NIXL
metadata only inside a lease) is listed in docs/security.md.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import math
import secrets
import time

WINDOW_S = 60.0  # accepted clock skew plus delivery time; nonces are remembered this long
MAX_NONCES = 200_000  # memory bound of the replay cache (about 20 MB at its fullest)


class AuthError(PermissionError):
    pass


class SideChannelAuth:
    def __init__(self, secret: str | bytes | None):
        if isinstance(secret, str):
            secret = secret.encode()
        # A derived key, so the raw secret (perhaps shared with other uses) is never the MAC key.
        self._key = hashlib.sha256(b"pdserve-kv-side-channel\0" + secret).digest() if secret else None
        self._seen: set[bytes] = set()  # nonces still inside their window (server side)
        self._expiries: list[tuple[float, bytes]] = []  # heap of (expiry, nonce): they expire out of order

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _mac(self, *parts: bytes) -> bytes:
        return hmac.new(self._key, b"\0".join(parts), hashlib.sha256).digest()

    # -- client ---------------------------------------------------------------------------------

    def sign_request(self, op: str, body: dict) -> tuple[bytes, bytes, str]:
        """(body bytes, mac, nonce) for a request; mac is b"" without a secret."""
        nonce = secrets.token_hex(16)
        raw = json.dumps({**body, "ts": time.time(), "nonce": nonce}).encode()
        return raw, (self._mac(b"req", op.encode(), raw) if self._key else b""), nonce

    def verify_reply(self, nonce: str, status: bytes, payload: bytes, mac: bytes) -> None:
        if self._key and not hmac.compare_digest(mac, self._mac(b"rep", nonce.encode(), status, payload)):
            raise AuthError("the KV peer's reply is not signed with our --kv-secret")

    def sign_data(self, ticket: bytes, stream: int) -> bytes:
        """The MAC that opens stream `stream` of a TCP data transfer (tcp_stream.py): the ticket
        came in a signed reply, and only a holder of the secret can turn it into a connection."""
        return self._mac(b"data", ticket, str(stream).encode()) if self._key else bytes(32)

    def verify_data(self, ticket: bytes, stream: int, mac: bytes) -> bool:
        return not self._key or hmac.compare_digest(mac, self.sign_data(ticket, stream))

    # -- server ---------------------------------------------------------------------------------

    def verify_request(self, op: bytes, raw: bytes, mac: bytes) -> dict:
        """The request's body, or AuthError. Single-threaded (the side-channel thread)."""
        if self._key and not hmac.compare_digest(mac, self._mac(b"req", op, raw)):
            raise AuthError("unauthenticated: the request is not signed with this deployment's --kv-secret")
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        if self._key:
            ts, nonce = body.get("ts"), body.get("nonce")
            now = time.time()
            self._forget(now)
            # NaN compares false with everything, so `abs(now - nan) > WINDOW_S` would let it through.
            if (not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts)
                    or abs(now - ts) > WINDOW_S or not isinstance(nonce, str)):
                raise AuthError("stale or undated request (check the clocks of prefill and decode nodes)")
            key = nonce.encode()
            if key in self._seen:
                raise AuthError("replayed request")
            if len(self._seen) >= MAX_NONCES:
                raise AuthError("too many requests in the replay window; retry later")
            # Accepted until now - ts > WINDOW_S: remember it at least that long (a message dated
            # ahead of our clock stays acceptable for up to 2 x WINDOW_S after it arrives).
            self._seen.add(key)
            heapq.heappush(self._expiries, (max(ts, now) + WINDOW_S, key))
        return body

    def sign_reply(self, nonce: str, status: bytes, payload: bytes) -> bytes:
        return self._mac(b"rep", nonce.encode(), status, payload) if self._key else b""

    def _forget(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiries)[1])
