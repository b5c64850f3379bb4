"""Per-tenant token rate (`--flow-control-tenant-tokens-per-minute`): a bucket per tenant that
fills at the rate and holds a minute's worth. A request is let through while its tenant's
bucket is above zero and then charged in full (prompt + max_tokens, what it may cost), so one
request larger than a minute's worth still passes on a full bucket and its tenant then waits
for the debt to refill; a request on an empty bucket gets 429 with the seconds until it refills."""

from __future__ import annotations

import math
import time

from pdserve.protocol.errors import APIError


class TokenRate:
    def __init__(self, tokens_per_minute: int, clock=time.monotonic):
        self.per_s = tokens_per_minute / 60.0
        self.capacity = float(tokens_per_minute)
        self._clock = clock
        self._level: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, when)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def _now_level(self, tenant: str) -> float:
        level, when = self._level.get(tenant, (self.capacity, self._clock()))
        return min(self.capacity, level + (self._clock() - when) * self.per_s)

    def charge(self, tenant: str, tokens: int) -> None:
        """Charge `tokens` to `tenant`, or raise 429 (reason tenant_token_rate) with Retry-After."""
        if not self.enabled:
            return
        level = self._now_level(tenant)
        if level <= 0:
            wait = max(1, math.ceil((1 - level) / self.per_s))
            raise APIError(429, f"tenant {tenant!r} is over its {int(self.capacity)} tokens per minute; "
                                f"retry in {wait}s", code="tenant_token_rate", headers={"Retry-After": str(wait)})
        self._level[tenant] = (level - tokens, self._clock())
        if len(self._level) > 10_000:  # full buckets carry no state: forget them
            self._level = {t: v for t, v in self._level.items() if self._now_level(t) < self.capacity}
