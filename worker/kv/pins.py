"""Blocks a prefill worker holds for a remote decode worker, until released or expired.

Shared between the engine's step thread (adds, frees) and the side-channel thread (leases
for reads, releases), hence the lock. A pin under lease (a read in progress) is never freed
by TTL: its blocks could be reallocated while their bytes are on the wire.

A pin is bound to the digest of the prompt its blocks were computed from: a reader must
present the digest of *its* prompt, so valid params replayed with another prompt of the same
length get nothing (the decode side would otherwise cache A's KV under B's block hashes).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

from pdserve.worker.kv.prompt_binding import bind_token


# How long a reader may hold a pin past its TTL while its bytes are on the wire.
LEASE_S = 60.0


@dataclass
class Pin:
    block_ids: list[int]
    token: str
    prompt_digest: str  # prompt_binding.prompt_digest of the prompt these blocks hold
    expires_at: float  # monotonic
    leased_until: float = 0.0
    released: bool = False


class PinError(PermissionError):
    pass


class PinTable:
    def __init__(self, ttl: float):
        self.ttl = ttl
        self._pins: dict[str, Pin] = {}
        self._lock = threading.Lock()

    def add(self, request_id: str, block_ids: list[int], prompt_digest: str,
            token: str | None = None) -> tuple[str, float]:
        """Pin blocks; returns (transfer token, wall-clock expiry) for kv_transfer_params.
        `token`: a tensor-parallel rank >= 1 mirrors rank 0's pin under rank 0's token."""
        token = token or bind_token(secrets.token_urlsafe(24), prompt_digest)
        with self._lock:
            self._pins[request_id] = Pin(list(block_ids), token, prompt_digest, time.monotonic() + self.ttl)
        return token, time.time() + self.ttl

    def lease(self, request_id: str, token: str, seconds: float, prompt_digest: str) -> list[int]:
        """Authenticate a reader and hold the pin for `seconds`; returns the pinned block ids."""
        now = time.monotonic()
        if not (isinstance(request_id, str) and isinstance(token, str) and isinstance(prompt_digest, str)):
            raise PinError("request_id, token and prompt_digest must be strings")
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or pin.released or not secrets.compare_digest(pin.token.encode(), token.encode()):
                raise PinError("unknown, released or expired transfer, or a wrong transfer token")
            if pin.expires_at <= now:
                raise PinError("the transfer token has expired")
            if not secrets.compare_digest(pin.prompt_digest.encode(), prompt_digest.encode()):
                raise PinError("prompt mismatch: these KV blocks were computed from a different prompt")
            pin.leased_until = now + seconds
            return list(pin.block_ids)

    def release(self, request_id: str, token: str) -> bool:
        if not (isinstance(request_id, str) and isinstance(token, str)):
            return False
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or not secrets.compare_digest(pin.token.encode(), token.encode()):
                return False
            pin.released = True
            pin.leased_until = 0.0
            return True

    def collect(self) -> list[tuple[str, list[int], bool]]:
        """Pins to free now: released ones, and expired ones not under lease. (id, blocks, expired)."""
        now = time.monotonic()
        out = []
        with self._lock:
            for rid, pin in list(self._pins.items()):
                if pin.leased_until > now:
                    continue
                if pin.released or pin.expires_at <= now:
                    out.append((rid, pin.block_ids, not pin.released))
                    del self._pins[rid]
        return out

    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(p.block_ids) for p in self._pins.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._pins)
